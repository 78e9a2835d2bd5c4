"""Megatron-LM's ``train()`` as a ``TrainerHandle`` that recoveries re-enter.

Megatron-LM's loop keeps its model, optimizer, LR schedule and data iterators in local
variables, so no layout can change under it. ``LMLoop.train`` stands in for
``megatron.training.training.train`` while the hook is installed: it calls the original, and
when that raises (a failed step, evaluation or checkpoint) or is unwound by a layout change
between steps (``Reenter``), the plugins recover through this handle (``rebuild`` goes
through Megatron-LM's own ``setup_model_and_optimizer``), and the original is called again
with the new objects, ``args.iteration`` and ``args.consumed_train_samples`` at the agreed
step and data iterators rebuilt at that sample: the same global batches, the same schedule.

Once the original returns, the loop runs the work ``pretrain()`` does after ``train()``
(``END_OF_JOB``: its final checkpoint, its evaluations on the validation and test sets) in
the same recovery scope, with the objects trained now; pretrain()'s own calls of that work
are then skipped (``lm_end``), so a failure there is recovered like one in a step.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Iterator

import torch

from chameleon_megatron.megatron.ddp_release import release_grad_hooks
from chameleon_megatron.training import lm_layout, lm_plan, lm_work
from chameleon_megatron.training.checkpoint import TRACKER_FILE
from chameleon_megatron.training.engine_step import engine_step, step_record
from chameleon_megatron.training.frames import clear_frames
from chameleon_megatron.training.lm_end import EndOfJobDone
from chameleon_megatron.training.lm_globals import (
    reset_rerun_state,
    reset_timers,
    set_megatron_args,
    timers_of,
)
from chameleon_megatron.training.lm_stage import megatron_lm_stages
from chameleon_megatron.training.lm_work import Entry
from chameleon_megatron.training.loop_position import LoopPosition, end_of_job_due, work_due
from chameleon_megatron.training.plugin import (
    AFTER_STEP,
    END_OF_JOB,
    TrainContext,
    TrainerPlugin,
)
from chameleon_megatron.training.stage_builder import StageBuilder

logger = logging.getLogger(__name__)


class Reenter(Exception):
    """Unwinds Megatron-LM's ``train()`` after a plugin changed the layout between steps."""


class Joining(Exception):
    """Ends a joiner's ``pretrain()`` once Megatron-LM's arguments are set, before it builds
    a world, a model or data (``MegatronLMHook.join`` goes on from there)."""


class Leave(Exception):
    """This rank left the job (a spare at its end): unwinds ``pretrain()`` itself, as what
    follows ``train()`` there needs the world this rank is no longer in."""


@dataclass(frozen=True)
class Providers:
    """What ``pretrain()`` was given to build a model and its data, kept for rebuilds."""

    dataset_provider: Callable[..., Any]
    model_provider: Callable[..., Any]
    model_type: Any
    forward_step_func: Callable[..., Any]


class LMLoop(LoopPosition):
    """One rank's run of Megatron-LM's training loop, seen by plugins as a trainer."""

    def __init__(self, training: ModuleType, plugins: list[TrainerPlugin], providers: Providers,
                 *, setup: Callable[..., Any], build_iterators: Callable[..., Any],
                 announce: Callable[[TrainContext], None],
                 emit: Callable[[dict[str, Any]], None],
                 new_world: Callable[[int], None],
                 set_args: Callable[[Any], None] | None = None) -> None:
        """``setup`` and ``build_iterators``: Megatron-LM's originals (not the hook's);
        ``announce`` shows a rebuilt model to the plugins, ``emit`` writes a record,
        ``new_world(rank)`` tells the metrics file who its rank 0 is; ``set_args`` installs
        Megatron-LM's global arguments (``global_vars.set_args`` unless given)."""
        self._training = training
        self._set_args = set_args or set_megatron_args
        self.plugins = plugins
        self.providers = providers
        self._setup = setup
        self._build_iterators = build_iterators
        self._announce = announce
        self._emit = emit
        self._new_world = new_world
        self.iteration = 0
        self.consumed_samples = 0
        self.after_step = ""
        self._redo_after = ""
        self._flops = 0.0
        self.model: list[torch.nn.Module] = []
        self.optimizer: Any = None
        self.scheduler: Any = None
        self.config: Any = None
        self.engine: Any = None
        """The plan's step engine while a plan runs (``lm_plan``); None: a megatron layout."""
        self._plan_data: lm_plan.PlanData | None = None
        self._device = torch.device("cpu")
        """Where the model was, kept over ``drop_layout``."""
        self.hints: dict[str, Any] = {}
        self._iterators: dict[int, Any] = {}
        """id(an iterator pretrain() built) -> the one that replaces it now."""
        self._originals: tuple[Any, Any, Any] = (None, None, None)
        self._given: tuple[Any, Any] = (None, None)
        """The (train, valid) iterators ``train()`` is entered with (``current`` maps them)."""
        self._valid_mark = (-1, 0)
        """(iteration, consumed validation samples) when that step's evaluation started."""
        self._checkpointing: dict[str, Any] = {}
        """pretrain()'s checkpointing context (its cached save and load strategies hold the
        groups of the layout they were made for)."""
        self._changes = 0
        """Layout changes and checkpoint loads so far (one between steps unwinds ``train()``)."""
        self._ended_at = -1
        """The step at which Megatron-LM's ``train()`` last returned."""
        self._final_valid = 0
        """Consumed validation samples when the final evaluation started."""
        self.end = EndOfJobDone()
        """The end-of-job work this loop ran, which pretrain() then skips (``lm_hook``)."""

    # ----------------------------------------------------------------- what pretrain built
    def built(self, model: list[Any], optimizer: Any, scheduler: Any) -> None:
        self.model, self.optimizer, self.scheduler = list(model), optimizer, scheduler
        self.config = self._training.get_model_config(self.model[0])

    def iterators_built(self, iterators: tuple[Any, Any, Any]) -> None:
        """pretrain()'s (train, valid, test) iterators: later rebuilds replace them."""
        self._originals = iterators
        self._iterators = {id(it): it for it in iterators if it is not None}

    def current(self, iterator: Any) -> Any:
        """The iterator that replaces ``iterator`` (built by pretrain()) now."""
        return self._iterators.get(id(iterator), iterator)

    def current_objects(self, model: Any, optimizer: Any, scheduler: Any) -> tuple[Any, Any, Any]:
        """The objects trained now, for a seam pretrain() calls with the ones it built."""
        return (self.model if model is not None else None,
                self.optimizer if optimizer is not None else None,
                self.scheduler if scheduler is not None else None)

    # ----------------------------------------------------------------- the loop
    def train(self, original: Callable[..., Any], forward_step_func: Callable[..., Any],
              model: list[Any], optimizer: Any, scheduler: Any, train_iterator: Any,
              valid_iterator: Any, process_non_loss_data_func: Any, config: Any,
              checkpointing_context: Any, non_loss_data_func: Any = None,
              *rest: Any, **named: Any) -> tuple[int, float]:
        """Megatron-LM's ``train()`` (``original``), re-entered after every recovery."""
        entry = Entry(forward_step_func, process_non_loss_data_func, checkpointing_context,
                      non_loss_data_func)
        args = self._training.get_args()
        timers_of(self._training.get_timers())  # what a recovery resets, checked first
        self.iteration, self.consumed_samples = args.iteration, args.consumed_train_samples
        self._flops = args.num_floating_point_operations_so_far
        if isinstance(checkpointing_context, dict):
            self._checkpointing = checkpointing_context
        self._valid_mark = (-1, args.consumed_valid_samples)
        if any(p.on_train_start(self) == "stop" for p in self.plugins):
            raise Leave()
        self._given = (train_iterator, valid_iterator)
        return self._run(original, entry, rest, named)

    def join(self, original: Callable[..., Any], entry: Entry) -> tuple[int, float]:
        """A joiner's run of Megatron-LM's ``train()``: its ``pretrain()`` stopped before
        Megatron-LM built anything (``Joining``); the plugins admit it into the running
        job (``on_train_start``: holding nothing until invited), whose recovery builds its
        groups and model and moves the survivors' state and position in; then it trains from
        there with the others (who re-enter ``train()`` at the same step), data iterators
        built at the agreed sample."""
        timers_of(self._training.get_timers())
        if any(p.on_train_start(self) == "stop" for p in self.plugins):
            raise Leave()
        if not self.model:
            raise RuntimeError("the recovery that admitted this rank built it no model")
        self._checkpointing = entry.checkpointing_context
        args = self._at_position()
        if self.engine is None:  # a plan reads its data by sample (lm_plan)
            self.iterators_built(self._iterators_at_mark(args))
        self._given = self._originals[:2]
        return self._run(original, entry, (), {})

    def _run(self, original: Callable[..., Any], entry: Entry, rest: tuple[Any, ...],
             named: dict[str, Any]) -> tuple[int, float]:
        """Megatron-LM's ``train()`` and then pretrain()'s end-of-job work, both recovered:
        after a recovery, what the members agreed to redo, then ``train()`` again."""
        result = None
        while True:
            try:
                start = self._end_of_job_redo()
                if not start:
                    if self._redo_after:
                        self._after_step_work(entry, self._take_redo_after())
                    if self.engine is not None:
                        self._plan_train(entry)
                    else:
                        result = original(entry.forward_step_func, self.model, self.optimizer,
                                          self.scheduler, self.current(self._given[0]),
                                          self.current(self._given[1]),
                                          entry.process_non_loss_data_func, self.config,
                                          entry.checkpointing_context,
                                          entry.non_loss_data_func, *rest, **named)
                    self._ended_at, start = self.iteration, END_OF_JOB[0]
                self._end_of_job(entry, start)
                self.end.returned = True
                return result if result is not None else (self.iteration, self._flops)
            except Reenter:
                self._reentry()
            except Leave:
                raise
            except Exception as exc:
                clear_frames(exc)  # the failed step's activations
                phase, iteration = self.after_step, self.iteration
                try:
                    action = self._on_step_failed(exc)
                finally:
                    self.after_step = ""
                if action is None:
                    raise
                if action == "stop":
                    raise Leave() from None
                self._redo_alone(phase, iteration)
                self._reentry()

    @property
    def valid_samples(self) -> int:
        """The validation position where the evaluation this rank is inside began (now, when
        in none)."""
        if self.after_step == "eval" and self._valid_mark[0] == self.iteration:
            return self._valid_mark[1]
        if self.after_step == "final-eval":
            return self._final_valid
        return self._training.get_args().consumed_valid_samples

    def resume_at(self, *, iteration: int, consumed_samples: int,
                  scheduler_state: dict[str, Any], after_step: str = "",
                  valid_samples: int) -> None:
        super().resume_at(iteration=iteration, consumed_samples=consumed_samples,
                          scheduler_state=scheduler_state, after_step=after_step,
                          valid_samples=valid_samples)
        # A spare made active never evaluated: it takes the survivors' position.
        self._training.get_args().consumed_valid_samples = valid_samples
        if after_step == "eval":
            self._valid_mark = (iteration, valid_samples)
        if after_step == "final-eval":
            self._final_valid = valid_samples

    def _reentry(self) -> None:
        """Where train() starts again: the agreed step, its sample, fresh data iterators
        (a plan reads its data by sample, ``lm_plan``)."""
        args = self._at_position()
        if self.engine is not None:
            return
        fresh = self._iterators_at_mark(args)
        if all(it is None for it in self._originals):  # joined into a plan: none built yet
            self.iterators_built(fresh)
            self._given = fresh[:2]
            return
        self._iterators = {id(old): new for old, new in zip(self._originals, fresh)
                           if old is not None}

    def _at_position(self) -> Any:
        """Megatron-LM's arguments, timers and rerun state put where train() starts again
        (the agreed step and its samples); returns the arguments."""
        args = self._training.get_args()
        args.iteration, args.consumed_train_samples = self.iteration, self.consumed_samples
        args.num_floating_point_operations_so_far = self._flops
        if self._redo_after == "eval" and self._valid_mark[0] == self.iteration:
            args.consumed_valid_samples = self._valid_mark[1]
        if self._redo_after == "final-eval":  # the final evaluation's batches again
            args.consumed_valid_samples = self._final_valid
        if self.engine is None:  # train() sets them again; it refuses a no_sync_func left
            self.config.no_sync_func = self.config.grad_sync_func = None
            self.config.param_sync_func = None
        reset_timers(self._training.get_timers())
        reset_rerun_state()
        return args

    def _iterators_at_mark(self, args: Any) -> tuple[Any, Any, Any]:
        """Data iterators at the consumed sample counts in ``args``. Megatron-LM takes a
        validation count of 0 after step 0 for an old checkpoint's and derives one from the
        iteration; before the first evaluation 0 is right, so it is shown step 0."""
        derive = (args.iteration > 0 and args.consumed_valid_samples == 0
                  and not getattr(args, "phase_transition_iterations", None))
        iteration = args.iteration
        if derive:
            args.iteration = 0
        try:
            return self._build_iterators(self.providers.dataset_provider)
        finally:
            args.iteration = iteration

    # ----------------------------------------------------------------- seams inside train()
    def before_step(self) -> None:
        """Called by the train_step seam: the plugins' work between steps (not before the
        first step of an entry), then where the step starts."""
        args = self._training.get_args()
        if args.curr_iteration > args.iteration:
            self._between_steps()
        self.iteration, self.consumed_samples = args.curr_iteration, args.consumed_train_samples

    def step_applied(self, samples: int, flops: float) -> None:
        """The optimizer update of the step is applied: state describes one more step."""
        self.iteration += 1
        self.consumed_samples += samples
        self._flops += flops

    @contextlib.contextmanager
    def after_step_phase(self, phase: str) -> Iterator[None]:
        """Marks the evaluation or checkpoint after step ``iteration`` while it runs."""
        if phase == "eval" and self._valid_mark[0] != self.iteration:
            self._valid_mark = (self.iteration, self._training.get_args().consumed_valid_samples)
        if phase == "save":
            for plugin in self.plugins:
                plugin.on_checkpoint(self.iteration)
        self.after_step = phase
        yield  # a failure leaves the phase set: the recovery agrees on it
        self.after_step = ""

    def _after_step_work(self, entry: Entry, start: str) -> None:
        """Redo the work after step ``iteration`` that is due, from phase ``start`` on."""
        args, it = self._training.get_args(), self.iteration
        for phase in AFTER_STEP[AFTER_STEP.index(start):]:
            if not work_due(args, it, phase, final_save=False):
                continue
            if self.engine is not None:
                self.after_step = phase  # a failure in the change redoes it
                self._leave_plan(phase)
            elif phase == "eval":
                lm_work.evaluate(self._training, entry, self._trained())
            elif phase == "save":
                lm_work.save(self._training, entry, self._trained(), final=False)

    def _plan_train(self, entry: Entry) -> None:
        """Megatron-LM's ``train()`` while a plan runs (``lm_plan``): its steps through the
        plan's engine, the plugins' work between them; work due after a step leaves the plan
        (``_leave_plan``)."""
        args, first = self._training.get_args(), True
        while self.iteration < args.train_iters:
            if not first:
                self._between_steps()
            first = False
            gbs = args.global_batch_size
            applied, seconds = engine_step(self.engine, self._plan_data.train, self.plugins,
                                           iteration=self.iteration,
                                           consumed=self.consumed_samples, gbs=gbs)
            if not applied.skipped:
                self.scheduler.step(increment=gbs)
            self.step_applied(gbs, self._training.num_floating_point_operations(args, gbs))
            record = step_record(self.engine, applied, self.plugins, iteration=self.iteration,
                                 consumed=self.consumed_samples, gbs=gbs, seconds=seconds,
                                 world_size=self.world_size,
                                 lr=self.optimizer.param_groups[0]["lr"],
                                 seq_length=args.seq_length)
            self._emit(record)
            if self.rank == 0:
                logger.info("iteration %d/%d (plan %s) | lm loss: %.6E", self.iteration,
                            args.train_iters, record["layout"].get("plan"), record["loss"])
            self._after_step_work(entry, AFTER_STEP[0])

    def _between_steps(self) -> None:
        """The plugins' work between two steps; a layout change unwinds the loop."""
        changes = self._changes
        if "stop" in [plugin.between_steps(self) for plugin in self.plugins]:
            raise Leave()
        if self._changes != changes:
            raise Reenter()

    def _leave_plan(self, phase: str) -> None:
        """Megatron-LM's evaluation and checkpoint read megatron's parallel state, which a
        plan has none of: the plugins change to a megatron layout first, a transition that
        agrees to redo ``phase`` (``after_step``, set by the caller), and the loop redoes it
        there (``Reenter``)."""
        changes = self._changes
        actions = [plugin.leave_plan(self, phase) for plugin in self.plugins]
        if "stop" in actions:
            raise Leave()
        if self._changes == changes:
            raise RuntimeError(f"the {phase} after step {self.iteration} needs a megatron "
                               "layout and no plugin changed to one")
        self.after_step = ""
        raise Reenter()

    def _trained(self) -> lm_work.Trained:
        return lm_work.Trained(self.model, self.optimizer, self.scheduler, self.config,
                               self.iteration, self._flops,
                               tuple(self.current(it) for it in self._originals))

    # ----------------------------------------------------------------- after the loop
    def _end_of_job_redo(self) -> str:
        """The end-of-job phase a recovery agreed to redo from ("" : none; training, or
        the work after a step, comes first). A recovery that went back to an earlier
        step trains again up to the end first, then runs the whole end-of-job work."""
        if self._redo_after in END_OF_JOB and self.iteration == self._ended_at:
            return self._take_redo_after()
        if self._redo_after in END_OF_JOB:
            self._redo_after = ""
        return ""

    def _end_of_job(self, entry: Entry, start: str) -> None:
        """What Megatron-LM's ``pretrain()`` does after ``train()`` returns (its final
        checkpoint, its evaluations on the validation and test sets), from phase ``start``
        on, inside this loop's recovery; pretrain()'s own calls of them are then skipped
        (``end``)."""
        args, it = self._training.get_args(), self.iteration
        for phase in END_OF_JOB[END_OF_JOB.index(start):]:
            if not end_of_job_due(args, it, phase):
                continue
            if phase == "final-eval":
                self._final_valid = args.consumed_valid_samples
            for plugin in self.plugins:
                plugin.on_end_of_job(phase, it)
            self.after_step = phase
            self._run_end_of_job(entry, phase)
            self.after_step = ""  # a failure leaves the phase set: the recovery agrees on it
            self.end.ran(phase)

    def _run_end_of_job(self, entry: Entry, phase: str) -> None:
        """Megatron-LM's own call of ``phase``, with the objects trained now."""
        if self.engine is not None:
            self._leave_plan(phase)
        elif phase == "final-save":
            lm_work.save(self._training, entry, self._trained(), final=True)
        else:
            lm_work.evaluate(self._training, entry, self._trained(),
                             "validation" if phase == "final-eval" else "test")

    # ----------------------------------------------------------------- TrainerHandle
    @property
    def args(self) -> Any:
        return self._training.get_args()

    @property
    def device(self) -> torch.device:
        return next(self.model[0].parameters()).device if self.model else self._device

    @property
    def rank(self) -> int:
        return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0

    @property
    def stage_builder(self) -> StageBuilder:
        return megatron_lm_stages(self._training.get_args, self.providers.model_provider,
                                  self.providers.forward_step_func)

    @property
    def world_size(self) -> int:
        return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1

    def scheduler_state(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def model_and_optimizer(self) -> tuple[list[Any], Any]:
        return self.model, self.optimizer

    def drop_layout(self) -> None:
        """Forget the model, optimizer and schedule until the next ``rebuild``. pretrain()
        and the first entry of train() still hold the objects pretrain() built: only the
        layouts built here are freed."""
        if not self.model:
            return
        self._device = self.device
        for plugin in self.plugins:
            plugin.on_model_dropped()
        # train() set the config's sync functions to the model's bound methods
        self.config.no_sync_func = self.config.grad_sync_func = None
        self.config.param_sync_func = None
        release_grad_hooks(self.model)
        self.model, self.optimizer, self.scheduler = [], None, None
        self.engine = None

    def use_engine(self, engine: Any, *, rank: int, world_size: int,
                   hints: dict[str, Any] | None = None) -> None:
        """Train through a plan's ``engine`` from now on (``lm_plan``), with a fresh
        Megatron-LM LR schedule on its optimizer and Megatron-LM's datasets on this rank
        (collective). Groups and moving state in are the caller's, as for ``rebuild``."""
        self._plan_data = lm_plan.plan_data(self._training, self.providers.dataset_provider)
        self.engine = engine
        self.model, self.optimizer, self.config = list(engine.model), engine.optimizer, \
            engine.config
        self.scheduler = self._training.get_optimizer_param_scheduler(engine.optimizer)
        self.hints = dict(hints or {})
        self._new_world(rank)
        self._changes += 1
        self._announce(self.context())

    def rebuild(self, *, tp: int, pp: int, rank: int, world_size: int,
                hints: dict[str, Any] | None = None) -> None:
        """Model, optimizer and a fresh LR schedule through Megatron-LM's own
        ``setup_model_and_optimizer`` for the layout whose groups the caller built; state
        is the caller's to move in (nothing is loaded from ``--load``)."""
        standing = self._training.get_args()
        layout = lm_layout.layout_arguments(standing, tp=tp, pp=pp, rank=rank,
                                            world_size=world_size)
        with lm_layout.arguments_for(standing, self._set_args, layout) as staged:
            built = lm_layout.setup_without_load(self._setup, self.providers.model_provider,
                                                 self.providers.model_type, staged)
        self.built(*built)
        self.engine, self._plan_data = None, None
        for cached in ("save_strategy", "load_strategy"):  # made for the old groups
            self._checkpointing.pop(cached, None)
        self.hints = dict(hints or {})
        self._new_world(rank)
        self._changes += 1
        self._announce(self.context())

    def load(self, path: str) -> bool:
        """Load the latest Megatron-LM checkpoint under ``path``; False when there is none."""
        if not os.path.isfile(os.path.join(path, TRACKER_FILE)):  # the same layout as ours
            return False
        args = self._training.get_args()
        kept_load, args.load = args.load, path
        try:
            iteration, flops = self._training.load_checkpoint(
                self.model, self.optimizer, self.scheduler,
                checkpointing_context=self._checkpointing)
        finally:
            args.load = kept_load
        self.iteration, self.consumed_samples = iteration, args.consumed_train_samples
        self._flops = flops
        self._redo_after = ""  # a checkpoint is written after its step's evaluation
        self._changes += 1
        return True

    def emit(self, record: dict[str, Any]) -> None:
        self._emit(record)

    def drop_final_save(self) -> None:
        self._training.get_args().save = None

    def context(self) -> TrainContext:
        mpu, args = self._training.mpu, self._training.get_args()
        extra = {"optimizer": self.optimizer, "opt_param_scheduler": self.scheduler,
                 **self.hints}
        if self.engine is not None:
            return TrainContext(model=list(self.model), config=self.config, args=args,
                                device=self.device, rank=self.rank, vpp_size=1, extra=extra,
                                pipeline_group=self.engine.pipeline_group(),
                                **self.engine.position())
        return TrainContext(
            model=list(self.model), config=self.config, args=args, device=self.device,
            rank=self.rank, tp_rank=mpu.get_tensor_model_parallel_rank(),
            pp_rank=mpu.get_pipeline_model_parallel_rank(),
            pp_size=mpu.get_pipeline_model_parallel_world_size(),
            dp_rank=mpu.get_data_parallel_rank(),
            vpp_size=args.virtual_pipeline_model_parallel_size or 1,
            pipeline_group=mpu.get_pipeline_model_parallel_group(), extra=extra,
        )
