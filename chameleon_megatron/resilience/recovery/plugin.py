"""``ResiliencePlugin``: fault tolerance as a trainer plugin (``--chameleon-ft``).

    plugins.append(ResiliencePlugin(cfg.ft))   # when cfg.ft.enabled, under chameleon-run

``on_model_built`` (first time) connects to the job store, starts heartbeats with the
start-up timeouts and builds the recovery controller; every time, it installs the fault
injection hooks on the (re)built model. A restarted worker (``joiners.JOIN_ENV`` set) builds
its controller in ``on_train_start`` instead and waits there to be admitted into the job.
``step_context`` times each training step: the detector derives the timeouts from it and
beats, estimator feedback gets the time; before a checkpoint or an evaluation the timeouts
are relaxed to the start-up value until the next step. ``on_step_failed`` hands the failure
to the controller, ``between_steps`` lets it admit joiners or leave rerouting,
``leave_plan`` change from a plan to a megatron layout for Megatron-LM's evaluation or
checkpoint. ``metrics`` adds ``{"ft": {"generation", "estimated_step_s"}}``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from chameleon_megatron.configurable import ConfigError
from chameleon_megatron.megatron import groups
from chameleon_megatron.megatron.lm_limits import RAMPUP_REFUSED, VPP_REFUSED
from chameleon_megatron.resilience.config import ResilienceConfig
from chameleon_megatron.resilience.decision.center import uniform_plan
from chameleon_megatron.resilience.decision.layout import UniformLayout
from chameleon_megatron.resilience.decision.profile import load_profile
from chameleon_megatron.resilience.dist_opt import is_distributed
from chameleon_megatron.resilience.model_state import (
    ModelState, check_migratable, unit_buffers, unit_parameters)
from chameleon_megatron.resilience.recovery.controller import RecoveryController
from chameleon_megatron.resilience.recovery.detector import (
    FailureDetector,
    is_communication_error,
)
from chameleon_megatron.resilience.recovery.fault_hooks import install_fault_hooks
from chameleon_megatron.training.loop_position import work_due
from chameleon_megatron.resilience.recovery.faults import FaultInjector
from chameleon_megatron.resilience.recovery.live_profile import check_profile
from chameleon_megatron.resilience.recovery.shard_replica import ShardReplicas
from chameleon_megatron.resilience.store.env import RELAUNCH_ENV
from chameleon_megatron.resilience.store.heartbeat import dump_stacks_on_request
from chameleon_megatron.resilience.store.job_store import JobStore
from chameleon_megatron.resilience.store.joiners import join_id_from_env
from chameleon_megatron.training.plugin import (
    AFTER_STEP,
    StepAction,
    TrainContext,
    TrainerHandle,
    TrainerPlugin,
)

logger = logging.getLogger(__name__)


def check_recoverable(ctx: TrainContext, ft: ResilienceConfig) -> None:
    """Refuse, before training, what in-memory recovery cannot do (ConfigError/ValueError)."""
    args = ctx.args
    if ctx.vpp_size > 1:
        raise ConfigError(f"--chameleon-ft: {VPP_REFUSED}; drop "
                          "--num-layers-per-virtual-pipeline-stage")
    if args.rampup_batch_size is not None:
        raise ConfigError(f"--chameleon-ft: {RAMPUP_REFUSED}")
    optimizer = ctx.extra["optimizer"]
    if is_distributed(optimizer):  # recovered from its shard copies
        check_migratable(optimizer)
        unit_parameters(ctx.model)
        buffers = sorted({n for named in unit_buffers(ctx.model).values() for n in named})
        if buffers:  # the shard copies hold the optimizer's pieces only
            raise ConfigError("--chameleon-ft with --use-distributed-optimizer: the shard "
                              f"copies do not hold module buffers ({', '.join(buffers)}); "
                              "drop --use-distributed-optimizer")
    else:
        ModelState(ctx.model, optimizer, role="source")  # refuses the optimizer
    if ft.profile:
        check_profile(load_profile(ft.profile), args)


class ResiliencePlugin(TrainerPlugin):
    def __init__(self, ft: ResilienceConfig, *, swap_bandwidth_Bps: float = 0.0) -> None:
        """``swap_bandwidth_Bps``: the job swaps activations at this bandwidth (0: no)."""
        self.ft = ft
        self.swap_bandwidth_Bps = swap_bandwidth_Bps
        self.controller: RecoveryController | None = None
        self._args: Any = None
        self._remove_hooks: Callable[[], None] = lambda: None
        self._iteration = 0
        """The training step being computed (0 outside training steps: no fault fires)."""
        self._completed = 0
        self._relaxed = False
        self._leaving = False

    def on_model_built(self, ctx: TrainContext) -> None:
        self._args = ctx.args
        if self.controller is None:
            self.controller = self._start(ctx)
        self._remove_hooks()
        remove_faults = install_fault_hooks(self.controller.injector, ctx.model,
                                            ctx.extra["optimizer"], lambda: self._iteration)
        pulse = self.controller.detector.pulse
        pulses = [chunk.register_forward_pre_hook(lambda *_: pulse()) for chunk in ctx.model]

        def remove() -> None:
            remove_faults()
            for handle in pulses:
                handle.remove()
        self._remove_hooks = remove

    def on_model_dropped(self) -> None:
        """The hooks hold the old model and optimizer (the fault hooks' closure)."""
        self._remove_hooks()
        self._remove_hooks = lambda: None

    def _start(self, ctx: TrainContext) -> RecoveryController:
        check_recoverable(ctx, self.ft)
        a = ctx.args
        layout = UniformLayout(tp=a.tensor_model_parallel_size,
                               pp=a.pipeline_model_parallel_size, dp=a.data_parallel_size)
        plan = uniform_plan(layout, range(layout.world_size), a.num_layers,
                            a.global_batch_size // a.micro_batch_size)
        return self._controller(ctx.rank, plan, dist.get_backend())

    def _controller(self, me: int, plan: Any, backend: str) -> RecoveryController:
        job = JobStore.from_env()
        dump_stacks_on_request()  # what its agent asks for before killing it as silent
        detector = FailureDetector(job, me, self.ft)
        detector.beat()
        groups.set_timeouts(detector.timeouts.pg_s)  # never megatron's 30-minute default
        injector = FaultInjector.from_strings(me, self.ft.inject_fault)
        shards = (ShardReplicas(self.ft.shard_replica_interval,
                                fault=lambda step: injector.check(step, "copy"))
                  if self._args.use_distributed_optimizer else None)
        return RecoveryController(
            job=job, detector=detector, injector=injector, ft=self.ft, me=me,
            plan=plan, backend=backend, swap_bandwidth_Bps=self.swap_bandwidth_Bps,
            shards=shards).watch()

    def on_train_start(self, trainer: TrainerHandle) -> StepAction | None:
        relaunch = os.environ.get(RELAUNCH_ENV)
        if relaunch is not None:
            record = {"event": "recovery", "cause": "store_lost", "fallback": "checkpoint",
                      "relaunch": int(relaunch), "resumed_iteration": trainer.iteration,
                      "world_size": trainer.world_size}
            logger.warning("job relaunched by the surviving nodes after the job store was "
                           "lost: %s", record)
            trainer.emit(record)
        me = join_id_from_env()
        if me is None:
            if self.controller.shards is not None:  # copies of the starting state
                self.controller.refresh_shards(trainer)
            self.controller.precompute_decisions(trainer)  # ready before the first failure
            return None
        self._args = trainer.args
        backend = "nccl" if trainer.device.type == "cuda" else "gloo"
        self.controller = self._controller(me, None, backend)
        logger.info("rank %d waits to join the running job", me)
        return "stop" if self.controller.join(trainer) == "stop" else None

    @contextlib.contextmanager
    def step_context(self, iteration: int, *, training: bool) -> Iterator[None]:
        if not training:  # an evaluation step after step ``iteration``
            self.controller.injector.check(iteration, "eval")
            yield
            return
        assert self.controller is not None, "on_model_built was not called"
        detector = self.controller.detector
        if self._relaxed:
            groups.set_timeouts(detector.timeouts.pg_s)
            self._relaxed = False
        self._iteration = iteration
        self.controller.step_started(iteration)
        start = time.perf_counter()
        try:
            yield
        finally:
            self._iteration = 0
        seconds = time.perf_counter() - start
        detector.step_done(iteration, seconds)
        self.controller.step_done(seconds)
        self._completed = iteration
        if self._slow_work_after(iteration):
            # twice the groups' timeout, as in steps: a peer hung in that work is found by
            # the survivors' collectives timing out, before their own silence kills them
            detector.hold(2 * self.ft.startup_timeout_s)
            groups.set_timeouts(self.ft.startup_timeout_s)
            self._relaxed = True

    def on_checkpoint(self, iteration: int) -> None:
        self.controller.injector.check(iteration, "save")

    def on_end_of_job(self, phase: str, iteration: int) -> None:
        self.controller.injector.check(iteration, phase)  # type: ignore[arg-type]

    def _slow_work_after(self, iteration: int) -> bool:
        """A checkpoint or an evaluation follows this step (no beats, long collectives);
        after the last one, Megatron-LM's pretrain() may run its end-of-job work."""
        return iteration == self._args.train_iters or any(
            work_due(self._args, iteration, phase, final_save=True) for phase in AFTER_STEP)

    def on_step_failed(self, exc: BaseException, trainer: TrainerHandle) -> StepAction | None:
        """A peer's failure (a communication error): recover. A local error is another
        plugin's to fix, or ends this process, which its agent then announces."""
        assert self.controller is not None, "on_model_built was not called"
        if not is_communication_error(exc):
            return None
        action = self.controller.handle(exc, trainer)
        self._leaving = action is None
        return action

    def abandon_step(self, exc: BaseException, trainer: TrainerHandle) -> StepAction | None:
        """Every rank abandons the step and redoes it in the same layout."""
        assert self.controller is not None, "on_model_built was not called"
        reason = "oom" if isinstance(exc, torch.OutOfMemoryError) else type(exc).__name__
        return self.controller.abandon(trainer, reason)

    def between_steps(self, trainer: TrainerHandle) -> StepAction | None:
        assert self.controller is not None, "on_model_built was not called"
        shards = self.controller.shards
        if shards is not None and shards.due(trainer.iteration):
            self.controller.refresh_shards(trainer, wait=False)  # overlaps the next steps
        return self.controller.between_steps(trainer)

    def leave_plan(self, trainer: TrainerHandle, work: str) -> StepAction | None:
        assert self.controller is not None, "on_model_built was not called"
        return self.controller.leave_plan(trainer, work)

    def metrics(self) -> dict[str, Any]:
        return {"ft": self.controller.metrics()} if self.controller is not None else {}

    def on_train_end(self) -> None:
        self._remove_hooks()
        if self.controller is not None:
            finished = self._completed == self._args.train_iters and not self._leaving
            if finished and self.controller.shards is not None:
                self.controller.shards.settle()  # the last copy's exchange, with the peers'
            self.controller.close(finished=finished)
