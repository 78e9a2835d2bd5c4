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
from megatron.core.rerun_state_machine import RerunState, get_rerun_state_machine

from chameleon_megatron.training.checkpoint import TRACKER_FILE
from chameleon_megatron.training.lm_loop import Leave, LMLoop, Providers
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
    loop = LMLoop(fake, plugins, Providers("datasets", "model", "type"), setup=None,
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
