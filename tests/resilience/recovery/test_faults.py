"""Fault injection: the flag syntax, the injector, and where each phase fires."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest
import torch

import argparse

from chameleon_megatron.config import add_chameleon_args, build_config, config_from_args
from chameleon_megatron.configurable import ConfigError
from chameleon_megatron.resilience.recovery.fault_hooks import install_fault_hooks
from chameleon_megatron.resilience.recovery.faults import (
    INJECTED_EXIT_CODE, FaultInjector, FaultSpec, InjectedFault, check_end_of_job_faults,
    parse_fault,
)

pytestmark = pytest.mark.timeout(30)


def test_parse_accepts_any_key_order_and_spaces() -> None:
    assert parse_fault("kind=hang, phase=optimizer ,iteration=12,rank=3") == FaultSpec(
        rank=3, iteration=12, phase="optimizer", kind="hang")


@pytest.mark.parametrize("text, message", [
    ("rank=1,iteration=2,phase=forward", "missing kind"),
    ("rank=1,iteration=2,phase=forward,kind=exit,when=now", "unknown key 'when'"),
    ("rank=1,iteration=two,phase=forward,kind=exit", "iteration='two' is not an integer"),
    ("rank=1,iteration=0,phase=forward,kind=exit", "iteration=0: must be >= 1"),
    ("rank=-1,iteration=1,phase=forward,kind=exit", "rank=-1: must be >= 0"),
    ("rank=1,iteration=1,phase=loss,kind=exit", "phase='loss': must be one of"),
    ("rank=1,iteration=1,phase=forward,kind=segfault", "kind='segfault': must be one of"),
    ("rank=1,rank=2,iteration=1,phase=forward,kind=exit", "rank given twice"),
    ("rank=1,iteration,phase=forward,kind=exit", "'iteration' is not key=value"),
])
def test_parse_errors_name_the_problem(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_fault(text)


def test_the_flag_is_repeatable_and_checked_when_the_config_is_built() -> None:
    parser = add_chameleon_args(argparse.ArgumentParser())
    ns = parser.parse_args(["--chameleon-ft",
                            "--chameleon-inject-fault", "rank=1,iteration=2,phase=forward,kind=exit",
                            "--chameleon-inject-fault", "rank=0,iteration=5,phase=backward,kind=hang"])
    assert len(config_from_args(ns).ft.inject_fault) == 2
    with pytest.raises(ConfigError, match="ft.inject_fault='rank=1'"):
        build_config({"ft": {"enabled": True, "inject_fault": ["rank=1"]}})


@pytest.mark.parametrize("train_iters, megatron_lm, message", [
    (6, True, None),
    (8, True, "phase=final-test needs iteration=8 (--train-iters, the last step)"),
    (None, True, "phase=final-test needs --train-iters"),
    (6, False, "phase=final-test fires in the work Megatron-LM's pretrain() does"),
])
def test_end_of_job_faults_must_name_the_last_step_of_megatron_lms_pretrain(
        train_iters, megatron_lm, message) -> None:
    texts = ["rank=1,iteration=6,phase=eval,kind=exit",
             "rank=0,iteration=6,phase=final-test,kind=exit"]
    if message is None:
        check_end_of_job_faults(texts, train_iters, megatron_lm=megatron_lm)
        return
    with pytest.raises(ValueError, match=re.escape(message)):
        check_end_of_job_faults(texts, train_iters, megatron_lm=megatron_lm)
    check_end_of_job_faults(texts[:1], train_iters, megatron_lm=megatron_lm)  # others pass


def test_injector_fires_only_its_own_rank_once_at_the_planned_step_and_phase() -> None:
    injector = FaultInjector.from_strings(1, ["rank=1,iteration=3,phase=backward,kind=exception",
                                              "rank=0,iteration=1,phase=forward,kind=exit"])
    injector.fail_at(2, 1)  # another rank's fault is ignored
    assert [str(s) for s in injector.planned] == ["rank=1,iteration=3,phase=backward,kind=exception"]
    injector.check(3, "forward")
    injector.check(2, "backward")
    with pytest.raises(InjectedFault):
        injector.check(3, "backward")
    injector.check(3, "backward")  # fired already: a redone step does not fail again


class _MegatronLike:
    """megatron's optimizer as the hooks see it: ``step`` starts with ``prepare_grads`` (the
    gradients are all-reduced by then), then the norm, then the torch optimizer's step."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.optimizer = inner

    def prepare_grads(self) -> bool:
        return False

    def step(self) -> None:
        self.prepare_grads()
        self.optimizer.step()


@pytest.mark.parametrize("phase", ["forward", "backward", "grads", "optimizer"])
def test_hooks_fire_in_the_planned_phase_of_the_planned_iteration(phase: str) -> None:
    model = torch.nn.Linear(3, 1)
    optimizer = _MegatronLike(torch.optim.AdamW(model.parameters()))
    injector = FaultInjector(0).fail_at(0, iteration=2, phase=phase, kind="exception")
    iteration = 0
    reached = []
    remove = install_fault_hooks(injector, [model], optimizer, lambda: iteration)

    def step() -> None:
        loss = model(torch.ones(2, 3)).sum()
        reached.append("forward")
        loss.backward()
        reached.append("backward")
        optimizer.step()
        reached.append("optimizer")

    iteration = 1
    step()
    iteration = 2
    reached.clear()
    weight = model.weight.detach().clone()
    with pytest.raises(InjectedFault):
        step()
    before = {"forward": [], "backward": ["forward"], "grads": ["forward", "backward"],
              "optimizer": ["forward", "backward"]}
    assert reached == before[phase]
    assert torch.equal(model.weight, weight), "the faulty step must not update the weights"
    remove()
    injector.fail_at(0, iteration=2, phase=phase, kind="exception")
    step()  # hooks removed: nothing fires


def _run_injected(kind: str) -> subprocess.Popen:
    code = ("from chameleon_megatron.resilience.recovery.faults import FaultInjector;"
            f"FaultInjector(0).fail_at(0, 1, 'forward', {kind!r}).check(1, 'forward')")
    return subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)


def test_exit_kind_ends_the_process_with_the_injected_status() -> None:
    proc = _run_injected("exit")
    assert proc.wait(timeout=20) == INJECTED_EXIT_CODE
    assert "injecting fault rank=0,iteration=1,phase=forward,kind=exit" in proc.stderr.read()


def test_hang_kind_blocks_until_killed() -> None:
    proc = _run_injected("hang")
    try:
        assert "injecting fault" in proc.stderr.readline()
        time.sleep(1)
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()
