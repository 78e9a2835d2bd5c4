"""``LMLoop``: Megatron-LM's ``train()`` as a trainer handle, re-entered after a recovery.

A stand-in ``megatron.training.training`` whose ``train()`` runs steps and evaluations as
Megatron-LM's does (``args.iteration`` at entry, ``curr_iteration`` per step, consumed
samples counted after each step) and fails where a test says; fake plugins recover. The
real thing, with processes and a real checkout: ``tests/megatron/test_megatron_lm_ft.py``.
"""

from __future__ import annotations

import argparse
import types
from pathlib import Path

import pytest
import torch
from megatron.core.rerun_state_machine import RerunState, get_rerun_state_machine

from chameleon_megatron.training.checkpoint import TRACKER_FILE
from chameleon_megatron.training.lm_loop import Leave, LMLoop, Providers
from chameleon_megatron.training.lm_work import Entry
from chameleon_megatron.training.loop_position import StepNotRedone
from chameleon_megatron.training.plugin import TrainerPlugin

pytestmark = pytest.mark.timeout(60)

BATCH = 8


class PeerLost(RuntimeError):
    """What a step sees when a peer dies."""


class Timer:
    """megatron.core.timers.Timer's bookkeeping (its start/stop also synchronize CUDA)."""

    def __init__(self) -> None:
        self._started = False

    def start(self) -> None:
        assert not self._started, "timer has already been started"
        self._started = True

    def stop(self) -> None:
        assert self._started, "timer is not started"
        self._started = False

    def reset(self) -> None:
        self._started = False


class Timers:
    def __init__(self) -> None:
        self._timers: dict[str, Timer] = {}

    def __call__(self, name: str) -> Timer:
        return self._timers.setdefault(name, Timer())


class Scheduler:
    def __init__(self) -> None:
        self.loaded: list[dict] = []

    def state_dict(self) -> dict:
        return {"num_steps": 0}

    def load_state_dict(self, state: dict) -> None:
        self.loaded.append(state)


class Megatron:
    """megatron.training.training as LMLoop uses it; ``fail`` maps (phase, iteration) to
    the exception raised once there ("step" N: in step N; "eval" N: after step N)."""

    def __init__(self, fail: dict[tuple[str, int], Exception] | None = None) -> None:
        self.args = argparse.Namespace(
            iteration=0, curr_iteration=0, consumed_train_samples=0, consumed_valid_samples=0,
            num_floating_point_operations_so_far=0.0, train_iters=4, eval_interval=2, eval_iters=1,
            do_valid=True, skip_train=False, save=None, save_interval=None, load=None)
        self.fail = dict(fail or {})
        self.timers = Timers()
        self.entries: list[tuple[int, int, object]] = []
        """(args.iteration, consumed samples, train iterator) at each call of train()."""
        self.steps: list[int] = []
        self.evals: list[int] = []
        self.built: list[tuple[int, int, int]] = []
        """(args.iteration, consumed train, consumed valid samples) at each iterator build."""
        self.loop: LMLoop | None = None
        self.load_checkpoint = None
        get_rerun_state_machine().state = RerunState.NOT_RUNNING_YET  # as initialized

    def get_args(self) -> argparse.Namespace:
        return self.args

    def get_timers(self) -> Timers:
        return self.timers

    def get_model_config(self, model: object) -> types.SimpleNamespace:
        return types.SimpleNamespace(no_sync_func=None, grad_sync_func=None,
                                     param_sync_func=None)

    def build_iterators(self, provider: object) -> tuple[object, object, None]:
        a = self.args
        self.built.append((a.iteration, a.consumed_train_samples, a.consumed_valid_samples))
        return object(), object(), None

    def _maybe_fail(self, phase: str, iteration: int) -> None:
        exc = self.fail.pop((phase, iteration), None)
        if exc is not None:
            raise exc

    def evaluate_and_print_results(self, prefix, forward_step_func, data_iterator, model,
                                   iteration, process_non_loss_data_func, config, verbose=False,
                                   write_to_tensorboard=True, non_loss_data_func=None) -> None:
        with self.loop.after_step_phase("eval"):  # as the hook's seam marks it
            self.args.consumed_valid_samples += BATCH
            self._maybe_fail("eval", iteration)
            self.evals.append(iteration)

    def train(self, forward_step_func, model, optimizer, scheduler, train_iterator,
              valid_iterator, process_non_loss_data_func, config, checkpointing_context,
              non_loss_data_func) -> tuple[int, float]:
        a = self.args
        self.timers("interval-time").start()  # megatron refuses a second start
        config.no_sync_func = "set by train()"
        self.entries.append((a.iteration, a.consumed_train_samples, train_iterator))
        iteration = a.iteration
        while iteration < a.train_iters:
            a.curr_iteration = iteration
            self.loop.before_step()
            machine = get_rerun_state_machine()
            assert machine.state == RerunState.NOT_RUNNING_YET  # megatron's step asks it
            machine.state = RerunState.INITIAL_RUN  # inside the step
            self._maybe_fail("step", iteration + 1)
            get_rerun_state_machine().state = RerunState.NOT_RUNNING_YET
            self.loop.step_applied(BATCH, 1.0)
            self.steps.append(iteration + 1)
            iteration += 1
            a.consumed_train_samples += BATCH
            if iteration % a.eval_interval == 0:
                self.evaluate_and_print_results(f"iteration {iteration}", None, valid_iterator,
                                                model, iteration, None, config)
        self.timers("interval-time").stop()
        return iteration, 0.0


class Resume(TrainerPlugin):
    """Recovers every failure by resuming at the step (and phase) the loop stands at."""

    def __init__(self, answer: str | None = "redo") -> None:
        self.answer = answer
        self.seen: list[tuple[int, int, str]] = []

    def on_step_failed(self, exc, trainer):
        if not isinstance(exc, PeerLost):  # a bug of the test: not for recovery
            return None
        self.seen.append((trainer.iteration, trainer.consumed_samples, trainer.after_step))
        if self.answer == "redo":
            trainer.resume_at(iteration=trainer.iteration,
                              consumed_samples=trainer.consumed_samples,
                              scheduler_state=trainer.scheduler_state(),
                              after_step=trainer.after_step,
                              valid_samples=trainer.valid_samples)
        return self.answer


def run(fake: Megatron, plugins: list[TrainerPlugin]) -> tuple[int, float]:
    loop = LMLoop(fake, plugins, Providers("datasets", "model", "type", "forward"), setup=None,
                  build_iterators=fake.build_iterators, announce=lambda ctx: None,
                  emit=lambda rec: None, new_world=lambda rank: None)
    fake.loop = loop
    loop.built(["model"], "optimizer", Scheduler())
    first = fake.build_iterators("datasets")
    loop.iterators_built(first)
    return loop.train(fake.train, "forward_step", ["model"], "optimizer", loop.scheduler,
                      first[0], first[1], None, loop.config, {}, None)


def test_a_failed_step_is_redone_in_a_new_entry_of_train_at_its_sample():
    fake = Megatron({("step", 3): PeerLost("peer 1 gone")})
    plugin = Resume()
    assert run(fake, [plugin]) == (4, 0.0)
    assert plugin.seen == [(2, 16, "")]  # steps 1 and 2 applied when step 3 failed
    assert fake.steps == [1, 2, 3, 4]  # every step once
    first, second = fake.entries
    assert first[:2] == (0, 0) and second[:2] == (2, 16)
    assert second[2] is not first[2]  # fresh data iterators, at sample 16
    assert fake.built[-1] == (2, 16, 8)  # one evaluation (after step 2) consumed 8 samples
    assert fake.loop.scheduler.loaded == [{"num_steps": 0}]


def test_a_failed_evaluation_is_redone_from_the_samples_it_started_at():
    fake = Megatron({("eval", 2): PeerLost("peer 1 gone")})
    plugin = Resume()
    run(fake, [plugin])
    assert plugin.seen == [(2, 16, "eval")]  # the recovery agrees on the phase
    # Steps 2 and 4 evaluate (eval_interval 2); then pretrain()'s final validation at 4.
    assert fake.evals == [2, 4, 4] and fake.steps == [1, 2, 3, 4]
    # Megatron-LM would derive 8 validation samples from "iteration 2, none consumed":
    # the iterators are built as at step 0, from the 0 samples the evaluation started at.
    assert fake.built[-1] == (0, 16, 0) and fake.args.iteration == 2


def test_a_spare_made_active_takes_the_survivors_validation_position():
    """A spare never evaluated (0 validation samples consumed); made active at step 2 it
    must read the validation batches the survivors would read next, not the first ones."""
    fake = Megatron({("step", 3): PeerLost("peer 1 gone")})

    class Promote(Resume):
        def on_step_failed(self, exc, trainer):
            fake.args.consumed_valid_samples = 0  # what the spare's own arguments say
            trainer.resume_at(iteration=2, consumed_samples=16,
                              scheduler_state=trainer.scheduler_state(),
                              valid_samples=8)
            return "redo"

    run(fake, [Promote()])
    assert fake.built[-1] == (2, 16, 8)
    assert fake.args.consumed_valid_samples == 8 + 8 + 8  # evaluations after steps 4, end


def test_a_stop_leaves_pretrain_and_an_unhandled_failure_propagates():
    with pytest.raises(Leave):
        run(Megatron({("step", 2): PeerLost("gone")}), [Resume(answer="stop")])
    with pytest.raises(PeerLost):
        run(Megatron({("step", 2): PeerLost("gone")}), [Resume(answer=None)])


class Admit(TrainerPlugin):
    """A joiner's admission as the resilience plugin makes it in ``on_train_start``: the
    recovery builds the layout's model and moves the survivors' position in (after step 2,
    16 samples, one evaluation of 8 validation samples); "stop": the job ended first."""

    def __init__(self, answer: str | None = None) -> None:
        self.answer = answer

    def on_train_start(self, trainer):
        if self.answer == "stop":
            return "stop"
        trainer.built(["model"], "optimizer", Scheduler())
        trainer.resume_at(iteration=2, consumed_samples=16,
                          scheduler_state={"num_steps": 2}, valid_samples=8)
        return None


def join(fake: Megatron, plugins: list[TrainerPlugin]) -> tuple[int, float]:
    loop = LMLoop(fake, plugins, Providers("datasets", "model", "type", "forward"), setup=None,
                  build_iterators=fake.build_iterators, announce=lambda ctx: None,
                  emit=lambda rec: None, new_world=lambda rank: None)
    fake.loop = loop
    return loop.join(fake.train, Entry("forward_step", None, {}, None))


def test_a_joiner_enters_train_once_at_the_survivors_position():
    """Its pretrain() built nothing: the data iterators are built once (Megatron-LM's build
    is a collective of every member), at the agreed samples, and train() runs the steps
    after the agreed one, then the end-of-job work."""
    fake = Megatron()
    assert join(fake, [Admit()]) == (4, 0.0)
    assert fake.built == [(2, 16, 8)]
    assert [entry[:2] for entry in fake.entries] == [(2, 16)]
    assert fake.steps == [3, 4] and fake.evals == [4, 4]  # after step 4; the final one
    assert fake.loop.scheduler.loaded == [{"num_steps": 2}]


def test_a_joiner_the_job_ended_before_leaves_without_building_anything():
    fake = Megatron()
    with pytest.raises(Leave):
        join(fake, [Admit("stop")])
    assert fake.built == [] and fake.entries == []


def test_a_checkpoint_loaded_between_steps_unwinds_and_re_enters_train(tmp_path: Path):
    (tmp_path / TRACKER_FILE).write_text("3")
    fake = Megatron()

    def load_checkpoint(model, optimizer, scheduler, checkpointing_context=None):
        assert fake.args.load == str(tmp_path)
        fake.args.consumed_train_samples = 3 * BATCH
        return 3, 3.0

    fake.load_checkpoint = load_checkpoint

    class LoadOnce(TrainerPlugin):
        def between_steps(self, trainer):
            if trainer.iteration == 1 and len(fake.entries) == 1:
                assert trainer.load(str(tmp_path)) is True

    run(fake, [LoadOnce()])
    assert [e[:2] for e in fake.entries] == [(0, 0), (3, 24)]
    assert fake.steps == [1, 4]  # step 2's between-steps work loaded step 3's checkpoint


def _layout_args(fake: Megatron, **layout: int) -> None:
    fake.args.__dict__.update(num_layers=4, rampup_batch_size=None, global_batch_size=16,
                              micro_batch_size=2, decrease_batch_size_if_needed=False,
                              pretrained_checkpoint=None, **layout)


@pytest.mark.parametrize("setup_fails", [False, True])
def test_a_rebuild_states_the_new_layout_only_once_it_has_succeeded(setup_fails: bool):
    """setup_model_and_optimizer reads the global arguments, so a copy stating the new
    layout is installed while it runs; the arguments pretrain() holds take its values only
    once it succeeded. A rebuild that fails there (say, out of memory) leaves them, and the
    microbatch count, as the layout that still stands states them."""
    from megatron.core.num_microbatches_calculator import (
        get_num_microbatches, init_num_microbatches_calculator,
        unset_num_microbatches_calculator,
    )

    fake = Megatron()
    standing = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=2,
                    transformer_pipeline_model_parallel_size=2, world_size=8, rank=5,
                    data_parallel_size=4)
    _layout_args(fake, **standing)
    held = fake.args  # what pretrain() holds
    seen = []

    def setup(model_provider, model_type):
        a = fake.args
        seen.append((a.tensor_model_parallel_size, a.pipeline_model_parallel_size,
                     a.data_parallel_size, get_num_microbatches(), a.load))
        assert a is not held and {name: getattr(held, name) for name in standing} == standing
        if setup_fails:
            raise torch.OutOfMemoryError("no room for the new layout")
        return [model], "optimizer", Scheduler()

    model = torch.nn.Linear(2, 2)
    fake.args.load = "/ckpt"
    fake.mpu = types.SimpleNamespace(**{f"get_{what}": lambda: 0 for what in (
        "tensor_model_parallel_rank", "pipeline_model_parallel_rank",
        "pipeline_model_parallel_world_size", "data_parallel_rank",
        "pipeline_model_parallel_group")})
    fake.args.virtual_pipeline_model_parallel_size = None
    loop = LMLoop(fake, [], Providers("datasets", "model", "type", "forward"), setup=setup,
                  build_iterators=fake.build_iterators, announce=lambda ctx: None,
                  emit=lambda rec: None, new_world=lambda rank: None,
                  set_args=lambda args: setattr(fake, "args", args))
    init_num_microbatches_calculator(5, None, 16, 2, 4, False)
    try:
        if setup_fails:
            with pytest.raises(torch.OutOfMemoryError):
                loop.rebuild(tp=1, pp=2, rank=3, world_size=4)
        else:
            loop.rebuild(tp=1, pp=2, rank=3, world_size=4)
        assert seen == [(1, 2, 2, 4, None)]  # the new layout, nothing loaded from --load
        assert fake.args is held
        now = {name: getattr(held, name) for name in standing}
        if setup_fails:
            assert now == standing and get_num_microbatches() == 2
        else:
            assert now == {**standing, "world_size": 4, "rank": 3, "data_parallel_size": 2}
            assert get_num_microbatches() == 4 and loop.model == [model]
        assert fake.args.load == "/ckpt"
    finally:
        unset_num_microbatches_calculator()


class Abandon(TrainerPlugin):
    """A swap plugin after an out-of-memory step: this rank could redo it."""

    def on_step_failed(self, exc, trainer):
        return "abandon" if isinstance(exc, torch.OutOfMemoryError) else None


def test_an_abandoned_step_is_redone_alone_and_refused_when_peers_cannot_agree(monkeypatch):
    """The failure dispatch both loops share: alone, an abandoned step is redone; with peers
    and no plugin to make them abandon it too, the job ends saying why."""
    fake = Megatron({("step", 3): torch.OutOfMemoryError("no room")})
    assert run(fake, [Abandon()]) == (4, 0.0) and fake.steps == [1, 2, 3, 4]
    monkeypatch.setattr(LMLoop, "world_size", property(lambda self: 2))
    with pytest.raises(StepNotRedone, match=r"rank 0: step 3 failed \(OutOfMemoryError: no "
                                            r"room\) and redoing it needs every rank"):
        run(Megatron({("step", 3): torch.OutOfMemoryError("no room")}), [Abandon()])


def test_the_timers_a_failure_left_running_are_stopped_and_a_changed_timers_is_refused():
    from megatron.core.timers import Timers as MegatronTimers

    from chameleon_megatron.training.lm_globals import reset_timers

    timers = MegatronTimers(0, "max")
    timers("interval-time").start()
    reset_timers(timers)
    timers("interval-time").start()  # megatron's own Timer refuses a second start
    for changed in (types.SimpleNamespace(), types.SimpleNamespace(_timers={"t": object()})):
        with pytest.raises(RuntimeError, match="keeps no _timers of Timer objects"):
            reset_timers(changed)
    fake = Megatron()
    fake.timers = types.SimpleNamespace()  # a release whose Timers moved its state
    with pytest.raises(RuntimeError, match="keeps no _timers"):
        run(fake, [Resume()])
    assert fake.steps == []  # refused before the first step
