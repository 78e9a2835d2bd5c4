"""The recovery controller: what a surviving rank does between a failed step and its redo,
and between two steps when the layout should change without a failure.

    abandon the step -> wait for the announcement -> survivors meet under a new generation
    -> agree on the newest completed step -> the leader asks the decision center
    -> recovery group; active members: new world, then megatron's groups and a fresh
       model/optimizer (a uniform layout), or a plan's groups and runtime (heterogeneous
       pipelines, or the kept layout rerouting around dead ranks)
    -> state moves from surviving replicas (old state kept until every transfer is
       confirmed; rerouting copies in place) -> LR schedule, data position, RNG -> "redo"

Between steps (``between_steps``) every active rank learns, in one small all-reduce, whether
new members wait to join (restarted workers) or the decision center, recalibrated on the
measured step times, now prefers a re-plan to the rerouting in use; then they all enter a
new generation at the same step, as after a failure but with nothing to redo.

Survivors without a slot wait as spares and join the next generation (or stop at the end of
the job). When some state has no surviving copy, the new layout loads the last checkpoint
instead. A failure during any of this fails the attempt on every member; they retry under the
next generation from the state they held at the failure. The recovery's side effects (groups,
rebuild, transfers) are driven from here and nowhere else: the leader's decision is
``deciding``'s, the run states' exchange ``held``'s, the new layout's build ``rebuild``'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Any, Sequence

import torch
import torch.distributed as dist

from chameleon_megatron.megatron import groups
from chameleon_megatron.megatron.ckpt_writes import check_write_queue, drop_abandoned_writes
from chameleon_megatron.megatron.teardown import Teardown
from chameleon_megatron.resilience.config import ResilienceConfig
from chameleon_megatron.resilience.decision.center import RecoveryDecision, world_order
from chameleon_megatron.resilience.decision.feedback import Feedback
from chameleon_megatron.resilience.decision.layout import Plan
from chameleon_megatron.resilience.decision.reroute import ReroutePlan
from chameleon_megatron.resilience.execution.grad_sync import reduction_device
from chameleon_megatron.resilience.execution.runtime import PlanRuntime
from chameleon_megatron.resilience.recovery import (
    memory_peak,
    overlap,
    run_state,
)
from chameleon_megatron.resilience.recovery.deciding import Decider, Standing
from chameleon_megatron.resilience.recovery.declared import leave_declared_failed
from chameleon_megatron.resilience.recovery.detector import (
    AbortWatcher,
    FailureDetector,
    Timeouts,
    is_timeout,
    widened,
    windows,
)
from chameleon_megatron.resilience.recovery.errors import RecoveryFailed
from chameleon_megatron.resilience.recovery.faults import FaultInjector
from chameleon_megatron.resilience.recovery.held import Held, exchange
from chameleon_megatron.resilience.recovery.move_state import move_state
from chameleon_megatron.resilience.recovery.rebuild import rebuild
from chameleon_megatron.resilience.recovery.record import (
    PhaseClock,
    gather_peaks,
    layout_after,
    recovery_record,
    summary,
)
from chameleon_megatron.resilience.recovery.regroup import (
    DeclaredFailed,
    Membership,
    agree_membership,
    expect,
    expected_window,
    failed_before,
    recovery_group,
    retry_key,
    wait_as_spare,
)
from chameleon_megatron.resilience.recovery.shard_replica import ShardReplicas
from chameleon_megatron.resilience.recovery.traffic_pulse import TrafficPulse
from chameleon_megatron.resilience.store.announce import (
    AbandonRecord,
    announce_abandon,
    failed_ranks,
    failure_count,
    first_failed_at,
    read_failures,
    wait_for_failure,
)
from chameleon_megatron.resilience.store.job_store import JobStore
from chameleon_megatron.resilience.store.join_queue import JoinQueue
from chameleon_megatron.resilience.store.waits import barrier
from chameleon_megatron.training.loop_position import work_follows
from chameleon_megatron.training.plugin import StepAction, TrainerHandle
from chameleon_megatron.training.rng import rng_state

logger = logging.getLogger(__name__)


SLOW_PEER_WAIT_S = 2.0
"""After a timed-out operation or a failed recovery attempt: how long to wait for an
announcement that explains it before taking it for slowness (the step is abandoned, the
attempt retried)."""


class RecoveryController:
    """One rank's recoveries over a job: its generation, the members and the layout."""

    def __init__(self, *, job: JobStore, detector: FailureDetector, injector: FaultInjector,
                 ft: ResilienceConfig, me: int, plan: Plan | None, backend: str,
                 swap_bandwidth_Bps: float = 0.0, shards: ShardReplicas | None = None,
                 teardown: Teardown | None = None) -> None:
        """``plan``: the layout launched, over launch ranks (None: this process joins a
        running job and learns the layout when admitted). ``swap_bandwidth_Bps``: the job
        swaps activations (``--chameleon-swap``) at this bandwidth, so a layout whose stages
        are over device memory may swap to fit (0: it does not swap). ``shards``: the job uses the distributed optimizer, whose
        state is recovered from these copies (``refresh_shards``). ``teardown``: how this
        process leaves its groups (default: torch's, keeping the job store's connections)."""
        self.job = job
        self.shards = shards
        self.detector = detector
        self.injector = injector
        self.ft = ft
        self.me = me
        self.backend = backend
        self.plan = plan
        """The plan trained now (rerouting: the kept plan, dead ranks included)."""
        self.reroute: ReroutePlan | None = None
        self.runtime: PlanRuntime | None = None
        """The plan runtime this rank trains through (None: a megatron layout)."""
        self.active: tuple[int, ...] = world_order(plan)[1] if plan is not None else ()
        """Launch ranks of the current world, in world-rank order."""
        self.members = self.active
        """Every survivor of the last generation (spares included)."""
        self.joiners = JoinQueue(job)
        self.feedback = Feedback(warmup=1, window=ft.feedback_steps)
        self._feedback_record: dict[str, Any] | None = None
        self._cause, self._invited = "failure", ()
        """Why the recovery in progress happens, and whom it admits."""
        self._left: tuple[Plan, ReroutePlan | None] | None = None
        """The plan a work transition left (``leave_plan``), the same on every member."""
        self._feedback_on = False
        """Whether a recovery's layout is being measured against its estimate."""
        self.generation = 0
        self.known_failed: frozenset[int] = frozenset()
        self.estimated_step_s: float | None = None
        self.last_regroup_s: float | None = None
        self.longest_recovery_s = 0.0
        """The longest recovery so far (its waits' scale on this machine)."""
        self.teardown = teardown or Teardown(backend, job.port)
        check_write_queue()
        """Interrupts and leaves this process's groups, for the watcher's thread too."""
        self.watcher = AbortWatcher(job, abort=self.teardown.interrupt)
        """Started by ``watch`` (a thread: whoever starts it stops it with ``close``)."""
        self.traffic = TrafficPulse(detector.pulse, job.port)
        """Beats while a slow link stretches a step (started and stopped with the watcher)."""
        self._step_start: tuple[int, dict[str, Any]] | None = None
        """(iteration, RNG state) at the start of the step in progress."""
        self._window_s = 0.0
        """The current recovery attempt's window for each wait."""
        self._attempt_failures = 0
        """Failures announced when the current attempt's membership was agreed."""
        self._completed = 0
        """Steps this rank had completed when the recovery in progress began."""
        self._state_from: dict[str, Any] | None = None
        """Where the recovery in progress takes the state from (for its record)."""
        self._steady_peaks: dict[str, int | None] = {}
        """This rank's memory peaks from the end of the last recovery to this one."""
        self.decider = Decider(job=job, detector=detector, feedback=self.feedback, ft=ft, me=me,
                               swap_bandwidth_Bps=swap_bandwidth_Bps)
        """The decisions this rank makes as the leader (and precomputes between steps)."""

    def watch(self) -> RecoveryController:
        """Interrupt the step in progress as soon as a failure is announced (a thread)."""
        self.watcher.start()
        self.traffic.start()
        return self

    def step_started(self, iteration: int) -> None:
        """Remember the RNG state a redo of this step must start from."""
        self._step_start = (iteration, rng_state())

    def rng_for_redo(self, applied: int) -> dict[str, Any]:
        """The RNG state step ``applied + 1`` must start from: the one saved when the failed
        step started, unless that step was applied (then: the current one)."""
        if self._step_start is not None and self._step_start[0] == applied + 1:
            return self._step_start[1]
        return rng_state()

    def refresh_shards(self, trainer: TrainerHandle,
                       active: Sequence[int] | None = None, *, wait: bool = True) -> None:
        """Copy the distributed optimizer's shards to host memory and to each one's
        successor (collective over the world); ``wait``: until committed (else the
        exchange overlaps the next steps)."""
        model, optimizer = trainer.model_and_optimizer()
        rt = self.runtime
        self.shards.refresh(model, optimizer, run_state.of(trainer, rng_state()), me=self.me,
                            world_to_job=tuple(active if active is not None else self.active),
                            ring=rt.groups.host if rt else groups.data_parallel_gloo(),
                            partners=rt.unit_sharers() if rt else None, wait=wait)

    def _keepalive(self) -> None:
        """Beat before a wait that cannot: it may last a whole recovery window (a rank
        silent for longer than its hold is killed as hung)."""
        self.detector.hold(max(self.ft.startup_timeout_s, self._window_s + SLOW_PEER_WAIT_S))

    # ----------------------------------------------------------------------- entry
    def handle(self, exc: BaseException, trainer: TrainerHandle) -> StepAction | None:
        """A step raised ``exc``, a communication error: recover and say what the trainer
        does next (None: nobody announced anything, this rank leaves)."""
        try:
            return self._handle(exc, trainer)
        except dist.DistNetworkError as lost:  # the store's host (node 0's agent) is gone
            path = trainer.args.save or trainer.args.load
            message = (f"the job store is lost ({lost}): in-memory recovery is impossible; "
                       f"restart the job with --load {path} to resume from its last checkpoint")
            logger.error(message)
            trainer.emit({"event": "recovery", "generation": self.generation,
                          "fallback": "restart", "error": message})
            raise RecoveryFailed(message) from lost

    def _handle(self, exc: BaseException, trainer: TrainerHandle) -> StepAction | None:
        abandoned = time.time()
        self.watcher.caught()
        # From here every wait is bounded; store calls over a slow link may each take
        # seconds and do not beat (2 s of delay: 13 s without a beat, killed as hung).
        self._keepalive()
        timeouts = self.detector.timeouts
        # A dead peer's announcement follows its error within a monitor interval; a timeout
        # may be a slow peer nobody will announce.
        wait_s = min(timeouts.rendezvous_s, SLOW_PEER_WAIT_S) if is_timeout(exc) \
            else timeouts.rendezvous_s
        events = self.detector.wait_for_events(wait_s)
        if not events:  # slowness is not failure: every rank redoes the step
            logger.warning("communication error with nothing announced within %.1f s (%s): "
                           "every rank abandons the step", wait_s, exc)
            return self.abandon(trainer, "timeout")
        if self._speaks():
            logger.warning({
                "event": "failure_seen", "iteration": trainer.iteration + 1,
                "failed": [{"rank": f.rank, "reason": f.reason} for f in events.failures],
                "abandoned": [{"rank": a.rank, "reason": a.reason} for a in events.abandons],
                "next": f"survivors regroup under generation {self.generation + 1} and "
                        f"resume after step {trainer.iteration}"})
        return self._leave_step(trainer, events.cause, abandoned, timeouts)

    def abandon(self, trainer: TrainerHandle, reason: str) -> StepAction:
        """This rank cannot finish the step it is in (``reason``, e.g. "oom", now avoided):
        it tells the job, and every rank abandons the step and redoes it, in the same
        layout, as after a recovery."""
        self.watcher.caught()
        record = AbandonRecord(rank=self.me, iteration=trainer.iteration + 1, reason=reason,
                               time=time.time())
        announce_abandon(self.job, record)
        logger.warning("rank %d abandons step %d (%s): every rank redoes it", self.me,
                       record.iteration, reason)
        self.detector.wait_for_events(0.0)  # its own announcement: handled here
        return self._leave_step(trainer, reason, record.time, self.detector.timeouts)

    def _leave_step(self, trainer: TrainerHandle, cause: str, abandoned: float,
                    timeouts: Timeouts) -> StepAction:
        # Leave the old world now, whatever the watcher did: NCCL communicators aborted
        # (destroying them would wait for the abandoned step's work), connections shut
        # down (peers blocked on this rank see them close instead of waiting out a gloo
        # timeout; the old model still holds its groups), then the groups destroyed.
        self._keepalive()
        self.decider.cancel()  # the recovery needs the processor
        self.teardown.leave()
        dropped = drop_abandoned_writes()  # a save this failure cut off: its redo's, not ours
        if dropped:
            logger.warning("rank %d dropped the write results of %d interrupted checkpoint "
                           "save(s)", self.me, dropped)
        self._completed = trainer.iteration
        if self.shards is not None:
            self.shards.settle(failed=True)  # not a copy stuck on a rank that left
        held = Held.of(trainer, self.rng_for_redo(trainer.iteration), self.shards)
        self._cause, self._invited = cause, ()
        return self._serve(trainer, held, abandoned, timeouts)

    def _serve(self, trainer: TrainerHandle, held: Held, started: float,
               timeouts: Timeouts) -> StepAction:
        """Recover into the next layout; a spare waits for a later generation (or the end).
        A recovery that fails ends the job (``_job_failed``)."""
        self._steady_peaks = memory_peak.take()
        while True:
            try:
                recovered = self._recover(trainer, held, timeouts, started)
            except DeclaredFailed as exc:
                leave_declared_failed(exc, self.me)
            except RecoveryFailed as failed:
                self._job_failed(failed)
                raise
            if recovered:
                return "redo"
            if wait_as_spare(self.job, self.generation, active=self.active,
                             on_wait=self.detector.beat) == "done":
                # A spare holds no part of the model: it must not join the final checkpoint.
                trainer.drop_final_save()
                return "stop"
            held, started, timeouts = Held.nothing(), time.time(), self.detector.timeouts

    # ----------------------------------------------------------------------- no failure
    def step_done(self, seconds: float) -> None:
        """A training step of the current layout took ``seconds`` (for estimator feedback)."""
        if self._feedback_on:
            record = self.feedback.step(seconds)
            if record is not None:
                self._feedback_record = record

    def between_steps(self, trainer: TrainerHandle) -> StepAction | None:
        """Return to the plan a work transition left (``leave_plan``; every active rank
        knows it), admit waiting joiners, or leave rerouting when a re-plan now scores
        better: all active ranks agree (one all-reduce) and change layout together."""
        record, self._feedback_record = self._feedback_record, None
        if record is not None:
            trainer.emit(record)
            if trainer.rank == 0:  # every rank has the same record
                logger.info(record)
        if self._left is not None and not work_follows(trainer.args, trainer.iteration):
            return self._transition(trainer, "back", ())  # every rank knows (``_finish``)
        # Rank 0 decides for the world: the queue changes while the ranks read it.
        lead = trainer.rank == 0
        replan = lead and record is not None and self.reroute is not None \
            and self.decider.replan_wins(trainer, self.standing())
        invited = self.joiners.take(self.joiners.waiting()) if lead else ()
        if invited:
            self.joiners.offer(self.generation, invited)
        flags = torch.tensor([int(bool(invited)), int(replan)], dtype=torch.int64,
                             device=reduction_device())
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        replan = bool(flags[1])
        if flags[0] and not lead:
            invited = self.joiners.offered(self.generation)
        if not invited and not replan:
            self.precompute_decisions(trainer)
            return None
        return self._transition(trainer, "join" if invited else "replan", invited)

    def leave_plan(self, trainer: TrainerHandle, work: str) -> StepAction | None:
        """Work after a step that only a megatron layout runs (``work``: Megatron-LM's
        evaluation or checkpoint, which read megatron's parallel state) is due while a plan
        runs: change to the megatron layout the decision center picks; the plan runs again
        from the next step on that is not followed by such work (``between_steps``). Every
        active rank reaches the same work after the same step: no agreement is needed."""
        logger.info("rank %d: the %s after step %d needs a megatron layout", self.me, work,
                    trainer.iteration)
        return self._transition(trainer, "work", ())

    def _transition(self, trainer: TrainerHandle, cause: str,
                    invited: tuple[int, ...]) -> StepAction | None:
        """Every active rank changes layout together between two steps (no failure)."""
        self.decider.cancel()
        logger.info({"event": "transition", "cause": cause, "invited": list(invited),
                     "iteration": trainer.iteration})
        self._completed = trainer.iteration
        if self.shards is not None and self.shards.run.iteration != trainer.iteration:
            self.refresh_shards(trainer)  # everyone is here: no step is rolled back
        held = Held.of(trainer, rng_state(), self.shards)
        self._invite(invited)
        self._cause = cause
        action = self._serve(trainer, held, time.time(), self.detector.timeouts)
        return "stop" if action == "stop" else None

    def _invite(self, invited: tuple[int, ...]) -> None:
        """Tell the next generation to wait for ``invited`` too, and them which it is."""
        # the joiners wait as long as the members will (not their start-up windows)
        expect(self.job, self.generation + 1, set(self.members) | set(invited),
               window_s=windows(self.detector.timeouts, self.longest_recovery_s).rendezvous_s)
        for rank in invited:
            self.joiners.admit(rank, self.generation + 1)
        self._invited = invited

    def join(self, trainer: TrainerHandle) -> StepAction:
        """This process joins the running job: wait to be invited, then recover into the
        generation that admits it (holding nothing); "stop" when the job ends first."""
        generation = self.joiners.wait_for_invitation(self.me, on_wait=self.detector.beat)
        if generation is None:
            failure = self.job.failure()
            if failure is not None:
                raise RecoveryFailed(f"rank {self.me} was not admitted: the job failed "
                                     f"({failure})")
            return "stop"
        self.generation = generation - 1
        self.members = (self.me,)  # the generation's "expected" names the others
        # Failures before the invitation are not this recovery's: counted as new, they
        # would date it from the job's first failure and widen every later window of
        # this rank alone (its peers would give up on it long before it gives up on them).
        self.known_failed = failed_before(self.job, generation)
        self._cause, self._invited = "join", (self.me,)
        timeouts = dataclasses.replace(self.detector.timeouts,
                                       rendezvous_s=expected_window(self.job, generation))
        return self._serve(trainer, Held.nothing(), time.time(), timeouts)

    def _job_failed(self, failed: RecoveryFailed) -> None:
        """Tell the job it cannot go on, so that nobody waits to join it or restarts a worker
        into it (every member raises ``failed``; the first says why)."""
        with contextlib.suppress(dist.DistStoreError, dist.DistNetworkError, RuntimeError):
            if self.job.failure() is None:
                self.job.mark_failed(str(failed))

    def metrics(self) -> dict[str, Any]:
        out = {"generation": self.generation, "estimated_step_s": self.estimated_step_s}
        if self.shards is not None:
            out.update(self.shards.metrics())
        return out

    def close(self, *, finished: bool) -> None:
        # Tearing down can take a group timeout (gloo joins threads still blocked on a dead
        # peer from an abandoned step): a rank leaving normally must not be killed for it.
        self.detector.hold(self.ft.startup_timeout_s)
        if finished:
            self.job.mark_done()
        if self.watcher.running:
            self.watcher.stop()
        self.traffic.stop()
        self.decider.close()

    # ----------------------------------------------------------------------- attempts
    def _recover(self, trainer: TrainerHandle, held: Held, timeouts: Timeouts,
                 abandoned: float) -> bool:
        """Recover under successive generations until one succeeds; True when this rank is
        active in the new layout, False when it is a spare."""
        clock: PhaseClock | None = None
        timeouts = windows(timeouts, self.longest_recovery_s)
        retries = 0
        while True:
            self._free_layout(trainer)  # the old layout, or a failed attempt's new one
            self._window_s = timeouts.rendezvous_s
            self.generation += 1
            # the new generation's groups: only later events, or this attempt's retry
            self.watcher.acknowledge(retry_key(self.generation))
            before = failure_count(self.job)
            try:
                membership = self._join(timeouts)
                if clock is None:
                    clock = PhaseClock(first_failed_at(
                        self.job, membership.failed - self.known_failed, default=abandoned))
                    clock.mark("detect", abandoned)
                self.members = membership.members
                return self._attempt(trainer, held, timeouts, membership, clock)
            except (DeclaredFailed, RecoveryFailed, dist.DistNetworkError):
                raise
            except Exception as exc:  # noqa: BLE001 - any failed attempt is retried (bounded)
                # Every member still in this attempt leaves it, and all meet again under the
                # next generation with longer windows (a slow peer is not a failed one).
                self.job.store.set(retry_key(self.generation), str(self.me))
                self._keepalive()
                self.teardown.leave()  # its groups: the others' watchers abort them
                # what made the attempt fail: waiting for its announcement keeps it out of
                # the next attempt (which it would interrupt)
                if not wait_for_failure(self.job, before, SLOW_PEER_WAIT_S, self._keepalive):
                    retries += 1
                    if retries > self.ft.recovery_retries:
                        raise RecoveryFailed(f"generation {self.generation}: recovery failed "
                                             f"{retries} times with no rank failing "
                                             f"(last: {exc})") from exc
                self.detector.wait_for_events(0.0)  # what interrupted the attempt: handled
                timeouts = widened(timeouts)
                logger.warning({"event": "recovery_retry", "rank": self.me,
                                "failed_generation": self.generation, "error": str(exc),
                                "next_window_s": timeouts.rendezvous_s})

    def _join(self, timeouts: Timeouts) -> Membership:
        """This generation's membership; any failure announced after it (its list left that
        one in) ends the attempt. A member not arrived yet is suspected after the rendezvous
        window, but never before the node window: a host behind a slow link makes each store
        call on its way to the join one round trip late (2 s links missed a 20 s window), and
        a node is not taken for lost before that window anyway."""
        window_s = max(timeouts.rendezvous_s, self.ft.node_timeout_s)
        self._say_wait("join", window_s)
        membership = agree_membership(self.job, self.generation, self.me, self.members,
                                      timeout_s=window_s, on_wait=self._keepalive)
        self._attempt_failures = len(membership.failed)  # failures are counted once each
        self.watcher.covered(self._attempt_failures)
        return membership

    def _free_layout(self, trainer: TrainerHandle) -> None:
        """Let go of the layout this rank trained (the held state's tensors stay)."""
        self.runtime = None
        overlap.free_layout(trainer)

    def _abandoned(self) -> bool:
        """Whether the current attempt is over for everyone: a member asked for a retry,
        or a rank failed since the membership was agreed."""
        return self.job.store.check([retry_key(self.generation)]) or \
            failure_count(self.job) > self._attempt_failures

    def _barrier(self, scope: Any, name: str, members: Sequence[int], seconds: float) -> None:
        """All ``members`` reach ``name`` before a C++ rendezvous (group creation), which
        cannot be left once entered: nobody waits there for a member already gone."""
        barrier(scope, name, self.me, members, timeout_s=seconds, abandoned=self._abandoned,
                on_wait=self._keepalive)

    def _alive(self) -> list[int]:
        return sorted(set(self.members) - failed_ranks(self.job))

    def _speaks(self) -> bool:
        """Whether this rank logs the job's recovery records: the lowest member alive."""
        return self.me == min(self._alive(), default=self.me)

    def _say_wait(self, what: str, seconds: float) -> None:
        """Log a recovery wait's deadline, once for the job."""
        if self._speaks():
            logger.info({"event": "recovery_wait", "generation": self.generation,
                         "waiting_for": what, "members": self._alive(),
                         "deadline_s": round(seconds, 3)})

    def _attempt(self, trainer: TrainerHandle, held: Held, timeouts: Timeouts,
                 membership: Membership, clock: PhaseClock) -> bool:
        scope = self.job.scoped(f"gen/{membership.generation}")
        res = exchange(scope, self.me, held, membership.members, self.shards, self._completed,
                       timeout_s=timeouts.rendezvous_s, abandoned=self._abandoned,
                       on_wait=self._keepalive)
        agreed, self._state_from = res.agreed, res.state_from
        decision = self.decider.shared(trainer, self.standing(), scope, membership, agreed,
                                       timeout_s=timeouts.rendezvous_s,
                                       abandoned=self._abandoned, on_wait=self._keepalive)
        clock.mark("decide")
        self._barrier(scope, "members", membership.members, timeouts.rendezvous_s)
        self._keepalive()
        group = recovery_group(self.job, membership, self.me, timeout_s=timeouts.rendezvous_s)
        active = self.me in decision.active
        if active:
            self._barrier(scope, "world", decision.active, timeouts.rendezvous_s)
            self._keepalive()
            self.runtime = rebuild(trainer, self.job, membership, decision, self.me,
                                   backend=self.backend, timeout_s=timeouts.rendezvous_s,
                                   keepalive=self._keepalive)
        else:
            groups.destroy()
        clock.mark("regroup")
        self.injector.check(agreed.iteration + 1, "recovery")
        moved = move_state(trainer, group, membership, held, res, decision, me=self.me,
                           job=self.job, shards=self.shards, timeout_s=timeouts.rendezvous_s,
                           abandoned=self._abandoned)
        if active and self.shards is not None:  # copies of the new layout's shards
            self.refresh_shards(trainer, decision.active)
        clock.mark("migrate")
        peaks = gather_peaks(group, membership.members, self.me, self._steady_peaks,
                             memory_peak.take())
        self._finish(trainer, membership, decision, clock, moved, active, peaks)
        return active

    def standing(self) -> Standing:
        """What the leader's decisions are computed from, of this controller's state."""
        return Standing(plan=self.plan, reroute=self.reroute, members=self.members,
                        active=self.active, regroup_s=self.last_regroup_s,
                        known_failed=self.known_failed, cause=self._cause, left=self._left)

    def precompute_decisions(self, trainer: TrainerHandle) -> None:
        """At the start and between steps: have the background thread rebuild the decisions
        this rank would make for likely failures when what they are computed from has
        changed (a comparison; the work is the thread's)."""
        self.decider.request(trainer, self.standing())

    # ----------------------------------------------------------------------- the steps
    def _finish(self, trainer: TrainerHandle, membership: Membership, decision: RecoveryDecision,
                clock: PhaseClock, moved: int, active: bool,
                peaks: dict[str, Any]) -> None:
        new = membership.failed - self.known_failed
        failures = [f for f in read_failures(self.job) if f.rank in new]
        self.known_failed = membership.failed
        self.plan, self.active, self.reroute = decision.plan, decision.active, decision.reroute
        self._left = decision.returns_to
        self.estimated_step_s = decision.estimated_step_s
        self.detector.new_layout()
        self.watcher.acknowledge()
        phases = clock.phases()
        self.last_regroup_s = phases["regroup"]
        self.longest_recovery_s = max(self.longest_recovery_s, phases["total"])
        if decision.estimated_step_s:
            self.feedback.start(f"generation {membership.generation}", decision.plan,
                                decision.estimated_step_s, decision.reroute)
            self._feedback_on = True
        if not active:
            logger.info("rank %d waits as a spare (generation %d)", self.me, self.generation)
            return
        groups.set_timeouts(self.detector.timeouts.pg_s)
        record = recovery_record(
            generation=membership.generation, failures=failures, decision=dict(decision.record),
            phases=phases, layout_after=layout_after(decision), spares=decision.spares,
            redo_iteration=trainer.iteration + 1, migrated_bytes=moved,
            fallback=decision.fallback,
            cause="failure" if failures and self._cause not in ("join", "replan") else self._cause,
            joined=set(self._invited) & set(membership.members),
            state_from={"source": "checkpoint"} if decision.fallback
            else self._state_from or {"source": "replicas"}, memory=peaks)
        trainer.emit(record)
        if trainer.rank == 0:
            logger.info(summary(record))

