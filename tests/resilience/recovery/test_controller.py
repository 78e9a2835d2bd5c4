"""The recovery controller's pure parts: the decision the survivors execute (layout, world
order, spares, transfers, checkpoint fallback, RNG donors), the runtime profile, the checks
before training, the recovery fault phase and the spares' waiting rule. Oracles are worked
out by hand on 4-layer models (layer cost: forward 1, backward 2, params 1 B, Adam 2 B)."""

from __future__ import annotations

import argparse
import json
import threading
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from chameleon_megatron.configurable import ConfigError
from chameleon_megatron.resilience.store.announce import FailureRecord, announce, failure_count
from chameleon_megatron.resilience.config import ResilienceConfig
from chameleon_megatron.resilience.recovery.controller import RecoveryController, RecoveryFailed
from chameleon_megatron.resilience.recovery.detector import FailureDetector, StepTimer, Timeouts
from chameleon_megatron.resilience.recovery.held import Held
from chameleon_megatron.resilience.recovery.faults import FaultInjector, InjectedFault
from chameleon_megatron.resilience.store.job_store import JobStore
from chameleon_megatron.resilience.decision.layout import Pipeline, Plan, Stage, UniformLayout
from chameleon_megatron.resilience.decision.perf_model import plan_step
from chameleon_megatron.resilience.recovery.plugin import check_recoverable
from chameleon_megatron.resilience.decision.center import (
    NoRecoveryPlan, RecoveryDecision, decide, keep_layout, recovery_units, rng_donors,
    uniform_plan, world_order,
)
from chameleon_megatron.resilience.decision.placement import NoFreshCopy
from chameleon_megatron.resilience.recovery.regroup import wait_as_spare
from chameleon_megatron.resilience.decision.restorer import Transfer
from chameleon_megatron.resilience.recovery.live_profile import CPU_GLOO, check_profile, runtime_profile
from dc_helpers import make_profile

pytestmark = pytest.mark.timeout(30)

DP2_PP2 = uniform_plan(UniformLayout(tp=1, pp=2, dp=2), [0, 1, 2, 3], 4, 8)
"""Ranks 0, 1 hold stage 0 (layers 0-1 + embedding), ranks 2, 3 stage 1 (layers 2-3 + output)."""
DEEP = make_profile(4, ar_bw=1e-3, memory=16.0)
"""All-reduce is ruinous, and a stage holds at most two layers: one pipeline of depth 2 is
the only layout of two ranks (a recovery takes one pipeline only when nothing replicated
fits)."""
WIDE = make_profile(4, ar_bw=1e12)
"""Free links: as many depth-1 pipelines as divide the batch win."""
UNIFORM = "tp=2: plans execute with tensor parallelism 1 only"
"""A reason the plan runtime cannot run the model: uniform re-plans only, no rerouting."""


def copies(rank: int, units: list) -> list[tuple]:
    return [(rank, rank, u, k) for u in units for k in ("params", "optimizer")]


def moves(transfers) -> list[tuple]:
    return [(t.src, t.dst, t.layer, t.kind) for t in transfers]


def test_a_uniform_layout_over_launch_ranks_and_back() -> None:
    """tp fastest, then dp, then pp: world rank w = tp + 2 (dp + 2 pp) holds active[w]."""
    active = [10, 11, 12, 13, 14, 15, 16, 17]
    plan = uniform_plan(UniformLayout(tp=2, pp=2, dp=2), active, 4, 8)
    assert [[st.ranks for st in p.stages] for p in plan.pipelines] == [
        [(10, 11), (14, 15)], [(12, 13), (16, 17)]]
    assert world_order(plan) == (UniformLayout(tp=2, pp=2, dp=2), tuple(active))


def test_a_layout_megatron_cannot_express_is_refused() -> None:
    uneven = Plan(num_layers=4, pipelines=(Pipeline(
        stages=(Stage(layers=(0, 1, 2), ranks=(0,)), Stage(layers=(3,), ranks=(1,))),
        microbatches=8),))
    with pytest.raises(ValueError, match="not a uniform megatron layout"):
        world_order(uneven)


def test_units_are_intact_groups_then_the_other_survivors_in_groups_of_tp() -> None:
    plan = uniform_plan(UniformLayout(tp=2, pp=2, dp=2), list(range(8)), 4, 8)
    assert recovery_units(plan, [0, 1, 2, 3, 4, 6, 7]) == [(0, 1), (2, 3), (6, 7)]
    assert recovery_units(plan, [0, 1, 2, 3, 4, 6, 7, 9]) == [(0, 1), (2, 3), (6, 7), (4, 9)]


def test_rng_comes_from_a_holder_of_the_first_layer_of_the_new_stage() -> None:
    new = Plan(num_layers=4, pipelines=(Pipeline(
        stages=(Stage(layers=(0, 1), ranks=(1,)), Stage(layers=(2, 3), ranks=(0,))),
        microbatches=8),))
    holdings = {0: (0, (0, 1, "embedding")), 1: (0, (0, 1, "embedding")), 2: (0, (2, 3, "output"))}
    assert rng_donors(new, holdings) == {1: 1, 0: 2}


def test_state_stays_in_place_when_the_new_layout_allows_it() -> None:
    """Rank 3 died, rank 1 is stale. DEEP: PP2 x DP1 (54 s) is the only layout that fits
    (PP1 x DP2 would hold four layers per rank); stage 0 goes to rank 0, which holds it,
    stage 1 to rank 2: only local copies from the old model into the rebuilt one."""
    d = decide(DP2_PP2, alive=[0, 1, 2], stale=[1], profile=DEEP, d_s=1e6, plans=UNIFORM)
    assert d.mode == "megatron"
    assert (d.layout, d.active, d.spares) == (UniformLayout(1, 2, 1), (0, 2), (1,))
    assert d.fallback is None
    assert moves(d.transfers) == copies(0, [0, 1, "embedding"]) + copies(2, [2, 3, "output"])
    assert d.estimated_step_s == pytest.approx(54.0)
    assert d.rng_donor == {0: 0, 2: 2}
    assert d.record["executed"] == "replan" and d.record["stale"] == [1]
    assert [c["name"] for c in d.record["candidates"]] == ["reroute", "replan"]


def test_new_slots_receive_what_they_lack_and_stale_ranks_send_nothing() -> None:
    """WIDE: PP1 x DP2 over ranks 0 and 2 (rank 1 is stale: it would need everything); each
    keeps its half and receives the other half from the only fresh holder."""
    d = decide(DP2_PP2, alive=[0, 1, 2], stale=[1], profile=WIDE, d_s=1e6, plans=UNIFORM)
    assert (d.layout, sorted(d.active), d.spares) == (UniformLayout(1, 1, 2), [0, 2], (1,))
    want = copies(0, [0, 1, "embedding"]) + copies(2, [2, 3, "output"]) + [
        (s, r, u, k) for s, r, units in ((2, 0, [2, 3, "output"]), (0, 2, [0, 1, "embedding"]))
        for u in units for k in ("params", "optimizer")]
    assert sorted(moves(d.transfers), key=str) == sorted(want, key=str)
    assert d.record["bytes_planned"] == 2 * 2 * 3.0  # two layers of 3 B each way


def test_a_layer_without_a_surviving_copy_falls_back_to_the_checkpoint() -> None:
    d = decide(DP2_PP2, alive=[0, 1], stale=[], profile=WIDE, d_s=1e6)
    assert d.fallback == "checkpoint" and d.transfers == ()
    assert d.record["lost"] == [2, 3, "output"] and "checkpoint" in d.record["executed_reason"]
    assert sorted(d.active) == [0, 1]


REROUTE_WINS = make_profile(4, ar_bw=1e12, regroup=60.0)
"""D = 100 s; re-plan (a depth-2 pipeline with 5 microbatches and a depth-1 one with 3):
36 s steps, transition 60 s regroup + 6 B at 1 B/s: 8/36 x (100 - 66)/100 = 0.076
< reroute: 54 s steps, no transition: 8/54 = 0.148."""


def test_when_rerouting_wins_the_score_the_kept_layout_reroutes() -> None:
    d = decide(DP2_PP2, alive=[0, 1, 2], stale=[], profile=REROUTE_WINS, d_s=100.0)
    assert d.record["choice"] == "reroute" and d.record["executed"] == "reroute"
    scores = {c["name"]: c["score"] for c in d.record["candidates"]}
    assert scores == pytest.approx({"reroute": 8 / 54, "replan": 8 / 36 * 0.34})
    assert (d.mode, d.plan, d.active, d.spares) == ("reroute", DP2_PP2, (0, 1, 2), ())
    # pipeline 1 lost its last stage: its 4 microbatches go to rank 2 (pipeline 0)
    assert d.reroute.failed_ranks == (3,) and d.reroute.reroutes[0].targets == ((0, 4),)
    assert all(t.src == t.dst for t in d.transfers) and d.record["transfers"] == 0
    assert moves(d.transfers) == (copies(0, [0, 1, "embedding"]) + copies(1, [0, 1, "embedding"])
                                  + copies(2, [2, 3, "output"]))
    # the surviving holders of each layer sum its gradients: {0, 1} for stage 0
    assert [g.ranks for g in d.sync_groups] == [(0, 1), (2, 3)]
    with pytest.raises(ValueError, match="no megatron layout"):
        d.layout


def test_a_kept_layout_refreshes_a_stale_member_from_a_fresh_one() -> None:
    """Rank 3 died in its optimizer step: its pipeline peer 1 never finished the step (the
    norm all-reduce met the dead rank) while 0 and 2 applied it. Keeping the layout, rank 1
    must not train on from its old weights: it receives stage 0 from rank 0. With stage 1's
    only fresh holder stale too, the layout cannot be kept: the re-plan falls back to the
    checkpoint (stage 1 has no copy at the step the job resumes from)."""
    d = decide(DP2_PP2, alive=[0, 1, 2], stale=[1], profile=REROUTE_WINS, d_s=100.0)
    assert d.record["choice"] == d.record["executed"] == "reroute"
    sources = {(t.dst, t.layer, t.kind): t.src for t in d.transfers}
    assert {sources[(1, u, k)] for u in (0, 1, "embedding") for k in ("params", "optimizer")} \
        == {0}
    assert d.record["transfers"] == 6 and d.record["bytes_planned"] > 0
    lost = decide(DP2_PP2, alive=[0, 1, 2], stale=[2], profile=REROUTE_WINS, d_s=100.0)
    assert lost.record["choice"] == "reroute" and lost.record["executed"] == "replan"
    assert lost.fallback == "checkpoint" and lost.record["lost"] == [2, 3, "output"]
    with pytest.raises(NoFreshCopy):
        keep_layout(DP2_PP2, None, alive=[0, 1, 2, 3], stale=[2, 3], profile=REROUTE_WINS,
                    cause="timeout")


def test_at_tp2_rerouting_leaves_the_dead_ranks_partner_a_spare() -> None:
    """TP2 x PP2 x DP2, rank 3 dead (stage 0 of pipeline 1 is ranks 2, 3): rank 2 cannot run
    the stage alone, so it waits as a spare, keeps nothing, and syncs with nobody."""
    plan = uniform_plan(UniformLayout(tp=2, pp=2, dp=2), list(range(8)), 4, 8)
    profile = make_profile(4, ar_bw=1e12, regroup=60.0, tp=2)
    d = decide(plan, alive=[0, 1, 2, 4, 5, 6, 7], stale=[], profile=profile, d_s=100.0,
               strategy="reroute")
    assert d.record["executed"] == "reroute" and d.mode == "reroute"
    assert (d.reroute.failed_ranks, d.reroute.stopped_ranks) == ((3,), (2, 3))
    assert (d.active, d.spares) == ((0, 1, 4, 5, 6, 7), (2,))
    assert {t.src for t in d.transfers} == {0, 1, 4, 5, 6, 7}
    assert d.reroute.reroutes[0].targets == ((0, 4),)


def test_a_model_the_plan_runtime_cannot_run_re_plans_and_says_why() -> None:
    d = decide(DP2_PP2, alive=[0, 1, 2], stale=[], profile=REROUTE_WINS, d_s=100.0,
               plans=UNIFORM)
    assert d.record["choice"] == "reroute" and d.record["executed"] == "replan"
    assert d.mode == "megatron" and "cannot run it (tp=2" in d.record["executed_reason"]


def test_a_heterogeneous_re_plan_uses_every_survivor() -> None:
    """Three survivors of DP2 x PP2, free links: a depth-2 pipeline (ranks 0, 2: they keep
    their stages) with 5 microbatches and a depth-1 one (rank 1) with 3: 36 s, where the
    best uniform layout (two depth-1 pipelines) takes 48 s."""
    d = decide(DP2_PP2, alive=[0, 1, 2], stale=[], profile=WIDE, d_s=1e6, strategy="replan")
    assert (d.mode, d.active, d.spares) == ("hetero", (0, 1, 2), ())
    assert [([st.ranks for st in p.stages], p.microbatches) for p in d.plan.pipelines] == [
        ([(0,), (2,)], 5), ([(1,)], 3)]
    assert d.estimated_step_s == pytest.approx(36.0)
    assert sorted((m for m in moves(d.transfers) if m[0] != m[1]), key=str) == sorted(
        ((2, 1, u, k) for u in (2, 3, "output") for k in ("params", "optimizer")), key=str)
    assert d.record["executed"] == "replan" and d.record["mode"] == "hetero"
    # layers 0-1 are held by ranks 0 and 1, layers 2-3 by 2 and 1: two rounds (rank 1 in both)
    assert len(d.sync_rounds) == 2


def test_no_intact_tensor_parallel_group_means_no_plan() -> None:
    plan = uniform_plan(UniformLayout(tp=2, pp=1, dp=1), [0, 1], 4, 8)
    with pytest.raises(NoRecoveryPlan, match="no intact TP group"):
        decide(plan, alive=[0], stale=[], profile=make_profile(4, tp=2), d_s=1e6)


def test_a_decision_survives_the_job_store() -> None:
    plan = uniform_plan(UniformLayout(2, 2, 1), (4, 5, 0, 1), 4, 8)
    d = RecoveryDecision(mode="megatron", plan=plan, active=(4, 5, 0, 1), spares=(7,),
                         transfers=(Transfer(0, 4, "output", "params", 8.0),
                                    Transfer(1, 5, 3, "optimizer", 16.0)),
                         fallback=None, estimated_step_s=0.5, rng_donor={4: 0, 5: 1},
                         record={"choice": "replan", "D_s": 10.0})
    assert RecoveryDecision.from_dict(json.loads(json.dumps(d.to_dict()))) == d
    assert d.layout == UniformLayout(2, 2, 1)
    rerouted = decide(DP2_PP2, alive=[0, 1, 2], stale=[], profile=REROUTE_WINS, d_s=100.0)
    assert RecoveryDecision.from_dict(json.loads(json.dumps(rerouted.to_dict()))) == rerouted


def tiny_args(**over) -> argparse.Namespace:
    base = dict(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32,
                micro_batch_size=2, global_batch_size=8, padded_vocab_size=128,
                tensor_model_parallel_size=1, rampup_batch_size=None)
    return argparse.Namespace(**{**base, **over})


def test_the_derived_profile_reproduces_the_measured_step_time() -> None:
    plan = uniform_plan(UniformLayout(tp=1, pp=2, dp=2), [0, 1, 2, 3], 4, 4)
    profile = runtime_profile(tiny_args(), path=None, hardware=CPU_GLOO, plan=plan,
                              step_time_s=0.25, regroup_s=0.7)
    assert plan_step(plan, profile).t_step_s == pytest.approx(0.25, rel=1e-6)
    assert profile.regroup_s == 0.7 and profile.global_batch_size == 8


def test_a_user_profile_must_describe_the_run() -> None:
    with pytest.raises(ValueError, match="global_batch_size=16, but this run has 8"):
        check_profile(make_profile(4, gbs=16, tp=1), tiny_args(micro_batch_size=1))


@pytest.mark.parametrize("over, message", [
    (dict(vpp_size=2), "interleaved pipelines"),
    (dict(args=tiny_args(rampup_batch_size=[4, 4, 64])), "--rampup-batch-size"),
])
def test_what_recovery_cannot_do_is_refused_before_training(over, message) -> None:
    ctx = SimpleNamespace(**{"vpp_size": 1, "args": tiny_args(), **over})
    with pytest.raises(ConfigError, match=message):
        check_recoverable(ctx, SimpleNamespace(profile=None))


def test_a_recovery_fault_fires_in_the_recovery_of_its_iteration_only() -> None:
    injector = FaultInjector.from_strings(2, ["rank=2,iteration=3,phase=recovery,kind=exception"])
    injector.check(3, "forward")
    injector.check(2, "recovery")
    with pytest.raises(InjectedFault, match="phase=recovery"):
        injector.check(3, "recovery")


def _spare_waiting(active: tuple[int, ...]) -> tuple[JobStore, threading.Thread, list[str]]:
    """A spare of generation 1 waiting on a thread; its answer lands in the list."""
    job = JobStore(dist.HashStore(), "run")
    result: list[str] = []
    spare = threading.Thread(target=lambda: result.append(
        wait_as_spare(job, 1, active=active, on_wait=lambda: None, poll_s=0.01)))
    spare.start()
    return job, spare, result


def test_a_spare_rejoins_when_the_next_generation_opens_not_on_a_failure_alone() -> None:
    """A spare's death is noticed by no active member: rejoining on it would wait forever."""
    job, spare, result = _spare_waiting(active=(0, 1))
    announce(job, FailureRecord(rank=5, time=time.time(), reason="exit", exitcode=1))
    time.sleep(0.2)
    assert not result
    job.scoped("gen/2").set("opened", "1")
    spare.join(timeout=5)
    assert result == ["rejoin"]
    job.mark_done()
    assert wait_as_spare(job, 2, active=(0, 1), on_wait=lambda: None) == "done"


def test_spares_rejoin_when_every_active_member_failed() -> None:
    """With every active member gone nobody opens the next generation: the spares must
    (soak seed 611463 re-planned onto one rank with six spares; that rank's death stalled
    the job)."""
    job, spare, result = _spare_waiting(active=(0, 1))
    announce(job, FailureRecord(rank=0, time=time.time(), reason="exit", exitcode=1))
    time.sleep(0.2)
    assert not result  # rank 1 still trains, and opens the next generation when it notices
    announce(job, FailureRecord(rank=1, time=time.time(), reason="exit", exitcode=1))
    spare.join(timeout=5)
    assert result == ["rejoin"]


def test_timeouts_take_the_worst_measured_step_the_estimator_the_median() -> None:
    timer = StepTimer(steps=2)
    assert (timer.step_time, timer.typical) == (None, None)
    timer.record(9.0)  # warm-up: until another step is measured, it is the typical one
    assert (timer.step_time, timer.typical) == (None, 9.0)
    for seconds in (1.0, 3.0, 1.2, 1.1):  # the window, then more
        timer.record(seconds)
    assert (timer.step_time, timer.typical) == (3.0, 1.15)
    timer.reset()
    assert (timer.step_time, timer.typical) == (None, None)


def test_a_redone_step_starts_from_the_rng_state_its_first_attempt_started_from() -> None:
    job = JobStore(dist.HashStore(), "run")
    ft = ResilienceConfig()
    controller = RecoveryController(job=job, detector=FailureDetector(job, 0, ft),
                                    injector=FaultInjector(0), ft=ft, me=0,
                                    plan=uniform_plan(UniformLayout(1, 1, 1), [0], 4, 8),
                                    backend="gloo")
    torch.manual_seed(7)
    controller.step_started(5)
    first = torch.rand(3)  # the failed attempt of step 5 consumed the stream
    torch.set_rng_state(controller.rng_for_redo(applied=4)["torch"])
    assert torch.equal(torch.rand(3), first)
    after = torch.get_rng_state()
    assert torch.equal(controller.rng_for_redo(applied=5)["torch"], after)  # step 5 was applied


def test_a_lost_job_store_ends_the_job_with_the_way_to_restart_it() -> None:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    job = JobStore.connect("127.0.0.1", server.port, "run", timeout_s=5)
    ft = ResilienceConfig()
    controller = RecoveryController(job=job, detector=FailureDetector(job, 0, ft),
                                    injector=FaultInjector(0), ft=ft, me=0,
                                    plan=uniform_plan(UniformLayout(1, 1, 1), [0], 4, 8),
                                    backend="gloo")
    del server  # the agent hosting the store is gone
    emitted: list[dict] = []
    trainer = SimpleNamespace(args=SimpleNamespace(save="/ckpt", load=None), emit=emitted.append)
    with pytest.raises(RecoveryFailed, match="restart the job with --load /ckpt"):
        controller.handle(RuntimeError("Connection closed by peer"), trainer)
    assert [r["fallback"] for r in emitted] == ["restart"]


@pytest.mark.parametrize("prior_s, replan", [(1.0, False), (1e9, True)])
def test_a_rerouting_job_asks_again_whether_to_re_plan(tmp_path, prior_s, replan) -> None:
    """After rerouting around rank 3 the controller asks the decision center again (with
    what it measured since): while the next failure is expected soon, the re-plan's 66 s
    transition does not pay; with a long MTBF it does (REROUTE_WINS: 8/36 x (D - 66)/D
    beats 8/54 for D > 198 s)."""
    from chameleon_megatron.resilience.decision.profile import save_profile
    from chameleon_megatron.resilience.decision.reroute import plan_reroute

    save_profile(REROUTE_WINS, tmp_path / "p.json")
    job = JobStore(dist.HashStore(), "run")
    ft = ResilienceConfig(profile=str(tmp_path / "p.json"), mtbf_prior_s=prior_s)
    controller = RecoveryController(job=job, detector=FailureDetector(job, 0, ft),
                                    injector=FaultInjector(0), ft=ft, me=0, plan=DP2_PP2,
                                    backend="gloo")
    controller.reroute = plan_reroute(DP2_PP2, [3], REROUTE_WINS)
    controller.members = (0, 1, 2)
    args = tiny_args(micro_batch_size=1, bf16=False, optimizer="adam",
                     use_distributed_optimizer=False, num_experts=None, moe_aux_loss_coeff=0.0,
                     sequence_parallel=False)
    trainer = SimpleNamespace(args=args, iteration=5, device=torch.device("cpu"),
                              stage_builder=SimpleNamespace(refusal=None))
    assert controller.decider.replan_wins(trainer, controller.standing()) is replan


def test_a_joiner_offered_when_keeping_the_layout_scores_better_waits_as_a_spare() -> None:
    """No rank failed; rank 4 (a restarted worker, holding nothing) is offered. With the next
    failure expected soon, the 60 s regroup of any re-plan does not pay: the megatron layout
    stays as it is (state copied in place) and rank 4 is a spare."""
    d = decide(DP2_PP2, alive=[0, 1, 2, 3, 4], stale=[4], profile=REROUTE_WINS, d_s=100.0)
    assert d.record["choice"] == "reroute" and d.record["executed"] == "reroute"
    assert (d.mode, d.reroute, d.plan, d.spares) == ("megatron", None, DP2_PP2, (4,))
    assert d.layout == UniformLayout(1, 2, 2) and d.active == (0, 1, 2, 3)
    assert all(t.src == t.dst for t in d.transfers) and "lost" not in d.record
    grown = decide(DP2_PP2, alive=[0, 1, 2, 3, 4], stale=[4], profile=REROUTE_WINS, d_s=1e6)
    assert grown.record["choice"] == "replan" and 4 in grown.active


def test_a_joiner_knows_the_failures_before_its_invitation() -> None:
    """Counted as its own, the job's first failure (minutes before it joined) would date a
    joiner's recovery and widen its windows far past its peers' (a seed of the soak)."""
    job = JobStore(dist.HashStore(), "run")
    ft = ResilienceConfig()
    controller = RecoveryController(job=job, detector=FailureDetector(job, 9, ft),
                                    injector=FaultInjector(9), ft=ft, me=9, plan=None,
                                    backend="gloo")
    job.scoped("gen/3").set("members", json.dumps({"members": [0, 1], "failed": [2, 7]}))
    announce(job, FailureRecord(rank=2, time=time.time() - 300, reason="exit", exitcode=1))
    announce(job, FailureRecord(rank=7, time=time.time() - 200, reason="exit", exitcode=1))
    controller.joiners.admit(9, 4)
    job.scoped("gen/4").set("window_s", "20")
    served: list = []
    controller._serve = lambda trainer, held, now, timeouts: served.append(
        (controller.known_failed, timeouts.rendezvous_s))
    controller.join(SimpleNamespace())
    assert served == [(frozenset({2, 7}), 20.0)]


def test_a_failed_recovery_ends_the_job_for_joiners_and_restarts() -> None:
    """Every survivor raises RecoveryFailed (here: state with no surviving copy and no
    checkpoint); the job says so, and a restarted worker waiting to join leaves with the
    reason instead of waiting for an invitation nobody will send (the 8-rank vs-restart
    bench hung on two such joiners)."""
    job = JobStore(dist.HashStore(), "run")
    ft = ResilienceConfig()
    survivor = RecoveryController(job=job, detector=FailureDetector(job, 0, ft),
                                  injector=FaultInjector(0), ft=ft, me=0, plan=DP2_PP2,
                                  backend="gloo")

    def lost(*_):
        raise RecoveryFailed("some state has no surviving copy")

    survivor._recover = lost
    with pytest.raises(RecoveryFailed):
        survivor._serve(SimpleNamespace(), Held.nothing(), time.time(),
                        Timeouts(pg_s=1.0, heartbeat_s=1.0, rendezvous_s=1.0))
    assert job.failure() == "some state has no surviving copy"
    joiner = RecoveryController(job=job, detector=FailureDetector(job, 9, ft),
                                injector=FaultInjector(9), ft=ft, me=9, plan=None,
                                backend="gloo")
    with pytest.raises(RecoveryFailed, match="rank 9 was not admitted: the job failed "
                                             r"\(some state has no surviving copy\)"):
        joiner.join(SimpleNamespace())


def test_a_rank_suspected_in_the_regroup_leaves_the_attempt_uninterrupted() -> None:
    """Rank 0 suspects rank 2 while they regroup: the membership leaves it out, and neither
    the attempt's own check nor the abort watcher (ticking late, on a loaded machine) takes
    that suspicion for a failure during the attempt. A failure after it does end the
    attempt."""
    job = JobStore(dist.HashStore(), "run")
    ft = ResilienceConfig(node_timeout_s=0.1)
    interrupted: list[int] = []
    teardown = SimpleNamespace(interrupt=lambda: interrupted.append(1) or 1)
    controller = RecoveryController(job=job, detector=FailureDetector(job, 0, ft),
                                    injector=FaultInjector(0), ft=ft, me=0, plan=DP2_PP2,
                                    backend="gloo", teardown=teardown)
    controller.members = (0, 1, 2)
    controller.generation = 1
    controller.watcher.acknowledge("gen/1/retry")
    job.scoped("gen/1").set("join/1", "1")
    membership = controller._join(Timeouts(pg_s=0.1, heartbeat_s=0.2, rendezvous_s=0.1))
    assert membership.members == (0, 1)
    controller.watcher._tick()
    assert interrupted == [] and not controller._abandoned()
    announce(job, FailureRecord(rank=1, time=time.time(), reason="exit", exitcode=1))
    controller.watcher._tick()
    assert interrupted == [1] and controller._abandoned()


def test_a_member_behind_a_slow_link_joins_within_the_node_window() -> None:
    """Rank 1 reaches the join 0.5 s late, past the 0.1 s rendezvous window but inside the
    1 s node window (a host whose every store call is a round trip late): it is waited for,
    not suspected."""
    job = JobStore(dist.HashStore(), "run")
    ft = ResilienceConfig(node_timeout_s=1.0)
    controller = RecoveryController(job=job, detector=FailureDetector(job, 0, ft),
                                    injector=FaultInjector(0), ft=ft, me=0, plan=DP2_PP2,
                                    backend="gloo")
    controller.members = (0, 1)
    controller.generation = 1
    late = threading.Timer(0.5, lambda: job.scoped("gen/1").set("join/1", "1"))
    late.start()
    try:
        membership = controller._join(Timeouts(pg_s=0.1, heartbeat_s=0.2, rendezvous_s=0.1))
    finally:
        late.join()
    assert membership.members == (0, 1) and failure_count(job) == 0
