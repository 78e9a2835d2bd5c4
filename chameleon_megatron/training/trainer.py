"""The GPT training loop: set-up, steps, evaluation, checkpoints, logs and metrics."""

from __future__ import annotations

import argparse
import copy
import logging
from importlib.metadata import version
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from chameleon_megatron.config import ChameleonConfig
from chameleon_megatron.megatron import groups
from chameleon_megatron.megatron.ddp_release import release_grad_hooks
from chameleon_megatron.metrics_file import MetricsWriter, continue_run, run_record
from chameleon_megatron.training import checkpoint, data, distributed
from chameleon_megatron.training import model as model_lib
from chameleon_megatron.training.engine import StepEngine
from chameleon_megatron.training.engine_step import engine_step, step_record
from chameleon_megatron.training.env import DistEnv, env_from_torchrun
from chameleon_megatron.training.frames import clear_frames
from chameleon_megatron.training.megatron_engine import MegatronEngine
from chameleon_megatron.training.loop_position import LoopPosition, work_due
from chameleon_megatron.training.metrics import log_line
from chameleon_megatron.training.optim import build_optimizer, build_scheduler
from chameleon_megatron.training.plugin import (
    AFTER_STEP,
    StepAction,
    TrainContext,
    TrainerPlugin,
    plugins_step,
)
from chameleon_megatron.training.stage_builder import StageBuilder, trainer_stages
from chameleon_megatron.training.startup import parameters_held, startup_line
from chameleon_megatron.training.step import configure_schedule
from chameleon_megatron.training.validate import validate_args

logger = logging.getLogger(__name__)


class Trainer(LoopPosition):
    """One training run on this rank; ``setup()`` then ``train()``, ``close()`` at the end.
    Plugins see it as a ``TrainerHandle``."""

    def __init__(self, args: argparse.Namespace, cfg: ChameleonConfig,
                 plugins: list[TrainerPlugin] | None = None,
                 env: DistEnv | None = None) -> None:
        self.args = args
        self.cfg = cfg
        self.plugins = list(plugins or [])
        self.env = env or env_from_torchrun()
        self.iteration = 0
        self.consumed_samples = 0
        self.after_step = ""
        """The work after step ``iteration`` this rank is inside (``AFTER_STEP``), else ""."""
        self._redo_after = ""
        self.history: list[dict[str, Any]] = []
        self.engine: StepEngine
        """Runs the steps: megatron's schedules (``_build``) or a plan's (``use_engine``)."""
        self.hints: dict[str, Any] = {}
        """What the last recovery told the plugins of the layout (``TrainContext.extra``)."""
        self.metrics = MetricsWriter(cfg.metrics.file, enabled=self.env.rank == 0)

    # ----------------------------------------------------------------------------- set-up
    def setup(self, *, join: bool = False) -> None:
        """Groups, model, data (and the checkpoint of ``--load``). ``join``: this process
        joins a running job (a resilience plugin admits it in ``on_train_start``): data
        only; the groups and the model come with the layout it is given."""
        args = self.args
        self.device = distributed.device_for(self.env)
        if join:
            distributed.seed_unplaced(args.seed)
            self.datasets = data.build_datasets(args)
            return
        backend = args.distributed_backend or ("nccl" if self.device.type == "cuda" else "gloo")
        timeout_s = args.distributed_timeout_minutes * 60
        groups.init_from_launcher(rank=self.env.rank, world_size=self.env.world_size,
                                  backend=backend, timeout_s=timeout_s)
        groups.build_uniform(args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                             vpp=args.virtual_pipeline_model_parallel_size, timeout_s=timeout_s)
        distributed.seed_everything(args.seed)
        self._build(args)
        self.datasets = data.build_datasets(args)
        if args.load:
            self.load(args.load)
        self._announce_model()
        self._log_start()
        self.metrics.write(run_record(self.env.world_size, args, version("megatron-core")))

    def _build(self, args: argparse.Namespace) -> None:
        """Model chunks, DDP, optimizer and LR schedule for the current parallel state, kept
        only once all are built."""
        kernels = model_lib.available_kernels()
        config = model_lib.transformer_config(args, kernels)
        model = model_lib.wrap_ddp(args, config, model_lib.build_model_chunks(args, config, kernels))
        optimizer = build_optimizer(args, model)
        scheduler = build_scheduler(args, optimizer)
        configure_schedule(config, model, optimizer, args.overlap_grad_reduce)
        engine = MegatronEngine(args, config, model, optimizer, self.device)
        self.model, self.optimizer, self.scheduler, self.engine = (model, optimizer, scheduler,
                                                                   engine)

    def _log_start(self) -> None:
        """The start-up line (rank 0), parameters summed over the model-parallel ranks."""
        first = parallel_state.get_pipeline_model_parallel_rank() == 0
        held = torch.tensor([parameters_held(self.model, first)], dtype=torch.int64,
                            device=self.device)
        dist.all_reduce(held, group=parallel_state.get_model_parallel_group())
        if self.env.rank == 0:
            logger.info(startup_line(self.args, self.cfg, int(held), self.env.world_size))

    def _announce_model(self) -> None:
        for plugin in self.plugins:
            plugin.on_model_built(self.context())

    def load(self, path: str) -> bool:
        """Load the latest checkpoint under ``path``; False when there is none."""
        a = self.args
        resumed = checkpoint.load_checkpoint(path, self.model, self.optimizer, self.scheduler,
                                             a, load_optim=not a.no_load_optim,
                                             load_rng=not a.no_load_rng)
        if resumed is None:
            return False
        self.iteration = resumed.iteration
        self.consumed_samples = resumed.consumed_samples
        self._redo_after = ""  # a checkpoint is written after its step's evaluation
        return True

    def rebuild(self, *, tp: int, pp: int, rank: int, world_size: int,
                hints: dict[str, Any] | None = None) -> None:
        """Rebuild model, DDP, optimizer and a fresh LR schedule for a new layout.

        The caller has already built torch.distributed's and megatron's groups for it
        (``chameleon_megatron.megatron.groups``); this neither creates groups nor re-seeds.
        State (weights, optimizer, schedule step, data position) is the caller's to move in.
        Raises ConfigError, before touching anything, if the layout does not fit the model.
        The arguments state the new layout once the build succeeded (as Megatron-LM's loop's
        do). ``hints`` reach the plugins with the new model (``TrainContext.extra``).
        """
        args = copy.copy(self.args)
        args.tensor_model_parallel_size, args.pipeline_model_parallel_size = tp, pp
        validate_args(args, world_size)
        self._build(args)
        self.args = args
        self._new_world(rank, world_size, hints)
        self._announce_model()

    def use_engine(self, engine: StepEngine, *, rank: int, world_size: int,
                   hints: dict[str, Any] | None = None) -> None:
        """Train through ``engine`` from now on (a layout megatron cannot express), with a
        fresh LR schedule on its optimizer. As for ``rebuild``: groups are the caller's, and
        so is moving state (weights, optimizer, schedule step, data position) in."""
        self._new_world(rank, world_size, hints)
        self.engine = engine
        self.model, self.optimizer = engine.model, engine.optimizer
        self.scheduler = build_scheduler(self.args, self.optimizer)
        self._announce_model()

    def drop_layout(self) -> None:
        """Forget the model, optimizer, schedule and engine (``TrainerHandle.drop_layout``):
        until ``rebuild`` or ``use_engine`` the trainer has none."""
        for plugin in self.plugins:
            plugin.on_model_dropped()
        release_grad_hooks(self.__dict__.get("model", ()))
        for name in ("model", "optimizer", "scheduler", "engine"):
            self.__dict__.pop(name, None)

    def _new_world(self, rank: int, world_size: int, hints: dict[str, Any] | None) -> None:
        self.hints = dict(hints or {})
        self.metrics = continue_run(self.metrics, self.cfg.metrics.file, rank)
        self.env = DistEnv(rank=rank, world_size=world_size, local_rank=self.env.local_rank)

    # ----------------------------------------------------------------------------- handle
    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def stage_builder(self) -> StageBuilder:
        return trainer_stages(self.args)

    def scheduler_state(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def model_and_optimizer(self) -> tuple[list[Any], Any]:
        return self.model, self.optimizer

    def drop_final_save(self) -> None:
        self.args = copy.copy(self.args)
        self.args.save = None

    def context(self) -> TrainContext:
        extra = {"optimizer": self.optimizer, "scheduler": self.scheduler, **self.hints}
        return TrainContext(model=self.model, config=self.engine.config, args=self.args,
                            device=self.device, rank=self.env.rank,
                            vpp_size=self.engine.vpp_size, extra=extra,
                            pipeline_group=self.engine.pipeline_group(),
                            **self.engine.position())

    def layout(self) -> dict[str, Any]:
        return self.engine.layout()

    # ----------------------------------------------------------------------------- steps
    def train_one(self) -> dict[str, Any]:
        """Run the next iteration and return its metrics record.

        ``iteration`` and ``consumed_samples`` advance as soon as the optimizer update is
        applied, before the loss is summed across ranks, so they always describe the weights.
        """
        gbs = data.global_batch_size_at(self.args, self.consumed_samples)
        applied, seconds = engine_step(self.engine, self.datasets.train, self.plugins,
                                       iteration=self.iteration,
                                       consumed=self.consumed_samples, gbs=gbs)
        if not applied.skipped:
            self.scheduler.step(increment=gbs)
        self.iteration += 1
        self.consumed_samples += gbs
        return step_record(self.engine, applied, self.plugins, iteration=self.iteration,
                           consumed=self.consumed_samples, gbs=gbs, seconds=seconds,
                           world_size=self.env.world_size,
                           lr=self.optimizer.param_groups[0]["lr"],
                           seq_length=self.args.seq_length)

    def evaluate(self) -> dict[str, Any]:
        """Mean loss over ``--eval-iters`` validation batches (the same batches every time)."""
        if self.datasets.valid is None:
            raise RuntimeError("no validation split: give --split with a non-zero valid weight")
        a = self.args
        total, tokens = 0.0, 0
        for k in range(a.eval_iters):
            with plugins_step(self.plugins, self.iteration, training=False):
                loss, n = self._eval_step(k * a.global_batch_size)
            if loss is not None:
                total += loss * n
                tokens += n
        rec = {"event": "eval", "iteration": self.iteration,
               "loss": total / tokens if tokens else None}
        if self.env.rank == 0:
            logger.info(" validation loss at iteration %d | lm loss: %.6E", self.iteration,
                        rec["loss"] if rec["loss"] is not None else float("nan"))
        return rec

    def _eval_step(self, start: int) -> tuple[float | None, int]:
        return self.engine.evaluate(self.datasets.valid, start, self.args.global_batch_size)

    # ----------------------------------------------------------------------------- loop
    def train(self) -> list[dict[str, Any]]:
        if any(p.on_train_start(self) == "stop" for p in self.plugins):
            return self.history
        while self.iteration < self.args.train_iters:
            if self._redo_after:  # a recovery during the work after the last step
                follow = self._after_step_work(self._take_redo_after())
                if follow == "stop":
                    break
                if follow == "redo":
                    continue
            action = self._guarded(self.train_one)
            if action == "stop":
                break
            if action == "redo":
                continue
            follow = self._after_iteration(action)
            if follow == "stop":
                break
            if follow == "redo":
                continue
            if self._guarded(self._between_steps) == "stop":
                break
        return self.history

    def _guarded(self, work: Any) -> Any:
        """``work()``, or the plugins' answer to its failure ("redo"/"stop"; re-raised when
        no plugin takes it)."""
        try:
            return work()
        except Exception as exc:
            clear_frames(exc)  # a redo or a recovery must not keep the failed work's memory
            action = self._on_step_failed(exc)
            if action is None:
                raise
            return action

    def _between_steps(self) -> StepAction | None:
        actions = [plugin.between_steps(self) for plugin in self.plugins]
        return "stop" if "stop" in actions else None

    def _after_iteration(self, rec: dict[str, Any]) -> StepAction | None:
        """The step's record, then its evaluation and checkpoint when due."""
        a = self.args
        self.emit(rec)
        if self.env.rank == 0 and (self.iteration % a.log_interval == 0
                                   or self.iteration == a.train_iters):
            logger.info(log_line(rec, a.train_iters))
        return self._after_step_work(AFTER_STEP[0])

    def _after_step_work(self, start: str) -> StepAction | None:
        """The work after this step that is due, from phase ``start`` on. A failure during it
        is recovered like one in a step: "redo" then means that every member runs it again
        from the phase they agreed on (``_redo_after``), or the step after a checkpoint
        fallback; "stop" that this rank left (a spare at the job's end)."""
        iteration = self.iteration
        for phase in AFTER_STEP[AFTER_STEP.index(start):]:
            if not work_due(self.args, self.iteration, phase, final_save=True):
                continue
            self.after_step = phase
            try:
                action = self._guarded(self._evaluate_and_emit if phase == "eval" else self.save)
            finally:
                self.after_step = ""
            if action == "stop":
                return action
            if action is not None:
                self._redo_alone(phase, iteration)
                return "redo"
        return None


    def _evaluate_and_emit(self) -> None:
        self.emit(self.evaluate())

    def save(self) -> None:
        for plugin in self.plugins:
            plugin.on_checkpoint(self.iteration)
        if not self.engine.checkpointable:
            # dist_checkpointing shards by megatron's parallel state; a plan has none. The
            # last checkpoint stays the fallback until the job is back on a megatron layout.
            logger.warning("checkpoint at iteration %d skipped: layout %s is not a megatron "
                           "layout", self.iteration, self.layout().get("plan"))
            return
        checkpoint.save_checkpoint(self.args.save, self.model, self.optimizer, self.scheduler,
                                   iteration=self.iteration,
                                   consumed_samples=self.consumed_samples)

    def emit(self, rec: dict[str, Any]) -> None:
        """Keep a record in this rank's history and write it to the metrics file (rank 0)."""
        self.history.append(rec)
        self.metrics.write(rec)

    def close(self) -> None:
        for plugin in self.plugins:
            plugin.on_train_end()
        self.metrics.close()
