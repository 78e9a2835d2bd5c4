"""The transitions around Megatron-LM's evaluations and checkpoints while a plan runs
(``RecoveryController.leave_plan``): the decision that leaves the plan for a megatron layout
and remembers it, and the way back to it (``plan_return.return_to``). Oracles by hand on
the 4-layer PP2 x DP2 plan of ``test_controller`` with rank 3 dead."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from chameleon_megatron.resilience.config import ResilienceConfig
from chameleon_megatron.resilience.decision.center import (
    NoRecoveryPlan,
    RecoveryDecision,
    uniform_plan,
)
from chameleon_megatron.resilience.decision.layout import UniformLayout
from chameleon_megatron.resilience.decision.plan_return import return_to
from chameleon_megatron.resilience.decision.profile import save_profile
from chameleon_megatron.resilience.decision.reroute import plan_reroute
from chameleon_megatron.resilience.recovery.controller import RecoveryController
from chameleon_megatron.resilience.recovery.detector import FailureDetector
from chameleon_megatron.resilience.recovery.faults import FaultInjector
from chameleon_megatron.resilience.recovery.regroup import Membership
from chameleon_megatron.resilience.recovery.run_state import Agreed
from chameleon_megatron.resilience.store.job_store import JobStore
from test_controller import DP2_PP2, REROUTE_WINS, copies, moves, tiny_args

pytestmark = pytest.mark.timeout(30)

REROUTED = plan_reroute(DP2_PP2, [3], REROUTE_WINS)
"""Rank 3 (stage 1 of pipeline 1) dead: rank 2 runs its microbatches."""
WORK_LAYOUT = uniform_plan(UniformLayout(tp=1, pp=2, dp=1), [0, 2], 4, 8)
"""The megatron layout the work ran in: ranks 0 and 2, rank 1 a spare (stale)."""


def test_the_way_back_moves_the_plans_state_in_from_the_layout_the_work_ran_in() -> None:
    """Ranks 0 and 2 keep their stages; spare 1 receives stage 0 from rank 0; nothing goes
    to dead rank 3, whose microbatches rank 2 runs again."""
    d = return_to(WORK_LAYOUT, DP2_PP2, REROUTED, alive=[0, 1, 2], stale=[1],
                  profile=REROUTE_WINS)
    assert (d.mode, d.plan, d.reroute, d.active, d.spares) == (
        "reroute", DP2_PP2, REROUTED, (0, 1, 2), ())
    got = sorted(moves(d.transfers), key=str)
    want = copies(0, [0, 1, "embedding"]) + copies(2, [2, 3, "output"]) + [
        (0, 1, u, k) for u in (0, 1, "embedding") for k in ("params", "optimizer")]
    assert got == sorted(want, key=str)
    assert d.record["cause"] == "back" and d.record["transfers"] == 6
    assert d.rng_donor[1] == 0  # stage 0's streams, from its holder


def test_the_way_back_needs_every_live_rank_of_the_plan() -> None:
    with pytest.raises(NoRecoveryPlan, match=r"ranks \[1\] of the plan left are gone"):
        return_to(WORK_LAYOUT, DP2_PP2, REROUTED, alive=[0, 2], stale=[],
                  profile=REROUTE_WINS)


def test_a_decision_remembers_the_plan_it_leaves_through_the_job_store() -> None:
    left = dataclasses.replace(
        return_to(WORK_LAYOUT, DP2_PP2, REROUTED, alive=[0, 1, 2], stale=[1],
                  profile=REROUTE_WINS), returns_to=(DP2_PP2, REROUTED))
    assert RecoveryDecision.from_dict(json.loads(json.dumps(left.to_dict()))) == left


@pytest.fixture
def rerouting(tmp_path):
    """A controller rerouting around rank 3 (the next failure soon: rerouting scores best)
    and its trainer."""
    save_profile(REROUTE_WINS, tmp_path / "p.json")
    job = JobStore(dist.HashStore(), "run")
    ft = ResilienceConfig(profile=str(tmp_path / "p.json"), mtbf_prior_s=1.0)
    controller = RecoveryController(job=job, detector=FailureDetector(job, 0, ft),
                                    injector=FaultInjector(0), ft=ft, me=0, plan=DP2_PP2,
                                    backend="gloo")
    controller.reroute, controller.members = REROUTED, (0, 1, 2)
    controller.known_failed = frozenset({3})
    args = tiny_args(micro_batch_size=1, bf16=False, optimizer="adam",
                     use_distributed_optimizer=False, num_experts=None, moe_aux_loss_coeff=0.0,
                     sequence_parallel=False)
    return controller, SimpleNamespace(args=args, iteration=5, device=torch.device("cpu"),
                                       stage_builder=SimpleNamespace(refusal=None))


def test_work_leaves_the_plan_for_a_megatron_layout_and_the_plan_comes_back(rerouting) -> None:
    """Cause "work": the center's best megatron layout though rerouting scores best, the
    rerouting remembered; cause "back" (from that layout) returns to it."""
    controller, trainer = rerouting
    members = Membership(1, (0, 1, 2), frozenset({3}))
    agreed = Agreed(iteration=5, consumed_samples=0, scheduler={}, fresh=(0, 1, 2), stale=())
    standing = dataclasses.replace(controller.standing(), cause="work")
    work = RecoveryDecision.from_dict(controller.decider.decide(trainer, standing, members,
                                                                agreed))
    assert work.mode == "megatron" and work.record["choice"] == "reroute"
    assert "the work due runs in a megatron layout" in work.record["executed_reason"]
    assert work.returns_to == (DP2_PP2, REROUTED)
    spare = tuple(sorted({0, 1, 2} - set(work.active)))
    back = dataclasses.replace(
        controller.standing(), plan=work.plan, reroute=None, active=work.active,
        cause="back", left=work.returns_to)
    home = RecoveryDecision.from_dict(controller.decider.decide(
        trainer, back, members, dataclasses.replace(agreed, fresh=work.active, stale=spare)))
    assert (home.mode, home.plan, home.reroute, home.returns_to) == (
        "reroute", DP2_PP2, REROUTED, None)
    assert home.record["executed"] == "return"
