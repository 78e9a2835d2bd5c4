"""The guarded seams into torch's and megatron-core's private parts: each works on the
installed releases and refuses, naming what is missing, one that lacks what it needs."""

from __future__ import annotations

import datetime
import re

import pytest
import torch
import torch.distributed as dist

from chameleon_megatron.megatron import groups, plan_seams, torch_seams
from chameleon_megatron.megatron.platform import cpu_platform


def test_the_elastic_agent_hooks_fit_this_torch_and_a_missing_one_is_named() -> None:
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    torch_seams.check_agent_hooks(LocalElasticAgent)

    class Moved(LocalElasticAgent):
        _monitor_workers = None  # as if a release had renamed it

    with pytest.raises(torch_seams.TorchSeamError,
                       match=re.escape(f"torch {torch.__version__}: Moved._monitor_workers")):
        torch_seams.check_agent_hooks(Moved)

    class Changed(LocalElasticAgent):
        def _shutdown(self, sig, grace):  # type: ignore[override]
            pass

    with pytest.raises(torch_seams.TorchSeamError, match=r"_shutdown\(death_sig, timeout\)"):
        torch_seams.check_agent_hooks(Changed)


def test_the_agent_class_is_swapped_only_inside_the_block() -> None:
    import torch.distributed.launcher.api as launcher_api

    original = launcher_api.LocalElasticAgent
    with pytest.raises(KeyError):
        with torch_seams.torchrun_agent(dict):
            assert launcher_api.LocalElasticAgent is dict
            raise KeyError("fails inside")
    assert launcher_api.LocalElasticAgent is original


def test_groups_are_listed_and_their_timeouts_read_back() -> None:
    with cpu_platform():
        groups.init_from_launcher(rank=0, world_size=1, backend="gloo", timeout_s=20)
        try:
            extra = dist.new_group([0])
            assert len(torch_seams.registered_groups()) == 2
            assert groups.set_timeouts(3.5) == 2
            assert torch_seams.group_timeout(extra) == datetime.timedelta(seconds=3.5)
            assert groups.current_timeout() == datetime.timedelta(seconds=3.5)
        finally:
            groups.destroy()
    assert torch_seams.registered_groups() == []


def test_plan_seams_fit_this_megatron_core_and_a_changed_signature_is_refused(monkeypatch) -> None:
    with cpu_platform():
        plan_seams.check_plan_seams()
        needs = dict(plan_seams.NEEDS)
        needs["pipeline_parallel.schedules.backward_step"] += ("grad_scale",)
        monkeypatch.setattr(plan_seams, "NEEDS", needs)
        with pytest.raises(RuntimeError, match="schedules.backward_step lacks grad_scale"):
            plan_seams.check_plan_seams()


class _Backend:
    def __init__(self, log: list) -> None:
        self.log = log

    def _group_start(self) -> None:
        self.log.append("start")

    def _group_end(self) -> None:
        self.log.append("end")


class _Group:
    def __init__(self, name: str, log: list, fails: bool = False) -> None:
        self.name, self.log, self.fails = name, log, fails

    def _get_backend(self, device):
        return _Backend(self.log)

    def abort(self) -> None:
        self.log.append(f"abort {self.name}")
        if self.fails:
            raise RuntimeError("already aborted by the watchdog")


def test_nccl_aborts_happen_together_inside_one_group_call() -> None:
    """Aborted one at a time, one communicator's abort can wait behind another's hung
    kernel: all of them go between one ncclGroupStart and ncclGroupEnd, newest first, and a
    failing abort neither stops the others nor skips the group end."""
    log: list[str] = []
    groups_ = [_Group("world", log), _Group("tp", log, fails=True), _Group("dp", log)]
    assert torch_seams.abort_together(groups_) == 2
    assert log == ["start", "abort dp", "abort tp", "abort world", "end"]
    assert torch_seams.abort_together([]) == 0
