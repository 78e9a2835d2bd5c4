"""The leader's decisions precomputed between failures (controller, background thread)."""

from __future__ import annotations

import argparse
import threading
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from chameleon_megatron.resilience.config import ResilienceConfig
from chameleon_megatron.resilience.decision.center import uniform_plan
from chameleon_megatron.resilience.decision.layout import UniformLayout
from chameleon_megatron.resilience.recovery.controller import RecoveryController
from chameleon_megatron.resilience.recovery.detector import FailureDetector
from chameleon_megatron.resilience.recovery.faults import FaultInjector
from chameleon_megatron.resilience.recovery.precompute import Precomputer
from chameleon_megatron.resilience.recovery.regroup import Membership
from chameleon_megatron.resilience.recovery.run_state import Agreed
from chameleon_megatron.resilience.store.job_store import JobStore

pytestmark = pytest.mark.timeout(120)

PP2_DP4 = uniform_plan(UniformLayout(tp=1, pp=2, dp=4), list(range(8)), 4, 8)
ARGS = argparse.Namespace(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32,
                          micro_batch_size=2, global_batch_size=16, padded_vocab_size=128,
                          tensor_model_parallel_size=1, rampup_batch_size=None)
TRAINER = SimpleNamespace(args=ARGS, device=torch.device("cpu"),
                          stage_builder=SimpleNamespace(refusal=None))


def controller(step_s: float = 0.5, plan=PP2_DP4, me: int = 0,
               keep_replicas: bool = True, plans: bool = True) -> RecoveryController:
    job = JobStore(dist.HashStore(), "run")
    ft = ResilienceConfig(timing_steps=1, keep_replicas=keep_replicas, plans=plans)
    c = RecoveryController(job=job, detector=FailureDetector(job, 0, ft),
                           injector=FaultInjector(0), ft=ft, me=me, plan=plan, backend="gloo")
    c.decider.expected_time_to_failure = lambda: 1000.0  # D depends on the clock; fixed here
    steps(c, step_s, 2)
    return c


def steps(c: RecoveryController, seconds: float, n: int) -> None:
    for _ in range(n):
        c.detector._timer.record(seconds)  # the first is warm-up


def ready(c: RecoveryController, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    pre = c.decider.precompute
    while pre.ready() is None or not pre.ready()[0].serves(c.decider.basis(TRAINER, c.standing())):
        assert time.monotonic() < deadline, "the cache was not built in time"
        time.sleep(0.01)
    return pre.ready()[1]


def decision(c: RecoveryController, dead: set[int], stale: tuple[int, ...] = ()) -> dict:
    alive = tuple(r for r in range(8) if r not in dead)
    members, c.members = c.members, alive  # as in a recovery: the survivors decide
    try:
        return c.decider.decide(TRAINER, c.standing(), Membership(2, alive, frozenset(dead)),
                                Agreed(iteration=3, consumed_samples=48, scheduler={},
                                       fresh=tuple(r for r in alive if r not in stale),
                                       stale=stale))
    finally:
        c.members = members


def without_source(d: dict) -> dict:
    """The decision without what differs between a cached and a fresh one: the source and
    the time it took."""
    skip = ("decision_from", "decision_s")
    return {**d, "record": {k: v for k, v in d["record"].items() if k not in skip}}


def test_every_single_failure_the_leader_decides_comes_from_the_cache_and_equals_fresh() -> None:
    c, plain = controller(), controller()
    c.precompute_decisions(TRAINER)
    cache = ready(c)
    assert len(cache.entries) == 7  # every member but the leader itself (no agents: no nodes)
    for dead in range(1, 8):
        served, fresh = decision(c, {dead}), decision(plain, {dead})
        assert served["record"]["decision_from"] == "cache", dead
        assert fresh["record"]["decision_from"] == "fresh"
        assert without_source(served) == without_source(fresh), dead
    c.close(finished=False)
    assert not c.decider.precompute.running


def test_the_replicas_setting_is_part_of_what_a_cached_decision_serves() -> None:
    c, plain = controller(keep_replicas=False), controller(keep_replicas=False)
    assert c.decider.basis(TRAINER, c.standing()).replicated is False
    c.precompute_decisions(TRAINER)
    cache = ready(c)
    assert cache.inputs.replicated is False
    assert cache.lookup(plan=PP2_DP4, alive=range(7), stale=(), plans=None) is None
    served, fresh = decision(c, {7}), decision(plain, {7})
    assert served["record"]["decision_from"] == "cache"
    assert without_source(served) == without_source(fresh)
    c.close(finished=False)
    plain.close(finished=False)


def test_plans_are_refused_when_turned_off_or_when_megatron_core_cannot_run_them(
        monkeypatch) -> None:
    """The decision proposes only megatron layouts with ``ft.plans=false``, and when this
    megatron-core lacks a callable the plan runtime needs (its recovery would fail)."""
    from chameleon_megatron.megatron import plan_seams

    on = controller()
    assert on.decider.basis(TRAINER, on.standing()).plans is None
    assert decision(on, {7})["record"]["mode"] != "megatron"  # plans win here when allowed
    off = controller(plans=False)
    assert off.decider.basis(TRAINER, off.standing()).plans == (
        "ft.plans=false: megatron layouts only")
    needs = dict(plan_seams.NEEDS)
    needs["pipeline_parallel.schedules.backward_step"] += ("grad_scale",)
    monkeypatch.setattr(plan_seams, "NEEDS", needs)
    missing = controller()  # checks its megatron-core once
    assert "backward_step lacks grad_scale" in missing.decider.basis(
        TRAINER, missing.standing()).plans
    for c in (missing, off):
        record = decision(c, {7})["record"]
        assert record["mode"] == "megatron" and record["executed"] != "reroute", record
    for c in (on, off, missing):
        c.close(finished=False)


def test_plans_are_refused_when_the_jobs_model_provider_cannot_build_a_stage() -> None:
    """A pretrain_gpt.py whose ``model_provider`` takes no config and process groups (a plan
    builds its stages through it with both): megatron layouts only, the reason recorded."""
    from chameleon_megatron.training.lm_stage import megatron_lm_stages, provider_refusal

    def own_provider(pre_process=True, post_process=True, vp_stage=None):
        raise AssertionError("not built in this test")

    def takes_both(pre_process=True, post_process=True, config=None, pg_collection=None):
        raise AssertionError("not built in this test")

    assert provider_refusal(takes_both) is None
    assert provider_refusal(lambda *args, **kwargs: None) is None
    builder = megatron_lm_stages(lambda: ARGS, own_provider, forward_step_func=None)
    assert builder.refusal == provider_refusal(own_provider)
    assert "own_provider takes no config or pg_collection keyword" in builder.refusal
    trainer = SimpleNamespace(**{**vars(TRAINER), "stage_builder": builder})
    c = controller()
    assert c.decider.basis(trainer, c.standing()).plans == builder.refusal
    alive = tuple(range(7))
    c.members = alive
    record = c.decider.decide(trainer, c.standing(), Membership(2, alive, frozenset({7})),
                              Agreed(iteration=3, consumed_samples=48, scheduler={},
                                     fresh=alive, stale=()))["record"]
    assert record["mode"] == "megatron", record
    c.close(finished=False)


def test_node_failures_are_precomputed_from_the_agents_beats() -> None:
    c, plain = controller(), controller()
    c.job.store.set("launch", '{"world_size": 8, "nodes": 2}')
    for g, ranks in enumerate([[0, 1, 2, 3], [4, 5, 6, 7]]):
        c.job.store.set(f"agent/{g}", f'{{"seq": 1, "ranks": {ranks}, "finished": false}}')
    c.precompute_decisions(TRAINER)
    assert frozenset(range(4)) in ready(c).entries  # node 1 lost: ranks 0-3 survive
    served, fresh = decision(c, {4, 5, 6, 7}), decision(plain, {4, 5, 6, 7})
    assert served["record"]["decision_from"] == "cache"
    assert without_source(served) == without_source(fresh)
    assert decision(c, {3, 4})["record"]["decision_from"] == "fresh"  # not a node
    c.close(finished=False)


def test_a_rank_that_decides_no_likely_failure_derives_no_profile() -> None:
    c = controller(me=2)  # ranks 0 and 1 decide every single failure
    c.precompute_decisions(TRAINER)
    cache = ready(c)
    assert cache.inputs is None and cache.entries == {}
    assert decision(c, {0})["record"]["decision_from"] == "fresh"
    c.close(finished=False)


def test_a_stale_cache_is_not_served_and_is_rebuilt_when_the_profile_changes() -> None:
    c = controller(step_s=0.5)
    c.precompute_decisions(TRAINER)
    first = ready(c)
    steps(c, 0.51, 1)  # median 0.505: within 5%, the cache stands
    assert decision(c, {5})["record"]["decision_from"] == "cache"
    assert decision(c, {5}, stale=(2,))["record"]["decision_from"] == "fresh"  # 2 missed a step
    steps(c, 0.9, 8)  # the measured step time moved: another profile
    served = decision(c, {5})
    assert served["record"]["decision_from"] == "fresh"
    assert without_source(served) == without_source(decision(controller(step_s=0.9), {5}))
    c.precompute_decisions(TRAINER)  # between steps: rebuilt on the new profile
    second = ready(c)
    assert second is not first and second.inputs.profile != first.inputs.profile
    assert decision(c, {5})["record"]["decision_from"] == "cache"
    c.plan = uniform_plan(UniformLayout(tp=1, pp=1, dp=8), list(range(8)), 4, 8)  # new layout
    c.active = tuple(range(8))
    assert decision(c, {5})["record"]["decision_from"] == "fresh"
    c.precompute_decisions(TRAINER)
    assert ready(c).inputs.plan == c.plan
    assert decision(c, {5})["record"]["decision_from"] == "cache"
    c.close(finished=False)


def test_a_build_in_progress_does_not_hold_up_a_decision_and_the_recovery_stops_it() -> None:
    c, plain = controller(), controller()
    started, seen_cancel = threading.Event(), threading.Event()

    def slow(cancelled):
        started.set()
        while not cancelled():
            time.sleep(0.01)
        seen_cancel.set()
        return None

    c.decider._requested = c.decider.basis(TRAINER, c.standing())
    c.decider.precompute.request(c.decider._requested, slow)
    assert started.wait(10)
    t0 = time.monotonic()
    served = decision(c, {5})
    assert time.monotonic() - t0 < 10 and not seen_cancel.is_set()
    assert served["record"]["decision_from"] == "fresh"
    assert without_source(served) == without_source(decision(plain, {5}))
    c.decider.cancel()  # as a recovery starts
    assert seen_cancel.wait(10) and c.decider.precompute.ready() is None
    assert c.decider._requested is None  # the next step boundary asks again
    c.close(finished=False)
    assert not c.decider.precompute.running


def test_the_latest_request_wins_and_a_failed_build_keeps_the_thread() -> None:
    pre: Precomputer[str, int] = Precomputer()
    gate = threading.Event()

    def held(value):
        def build(cancelled):
            gate.wait(10)
            return None if cancelled() else value
        return build

    pre.request("a", held(1))
    pre.request("b", held(2))  # supersedes a (a, if started, is dropped)
    gate.set()
    deadline = time.monotonic() + 10
    while pre.ready() is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert pre.ready() == ("b", 2)
    pre.request("c", lambda cancelled: 1 / 0)
    pre.request("d", lambda cancelled: 4)
    while pre.ready() != ("d", 4):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    pre.cancel()
    assert pre.ready() == ("d", 4)  # a cancel keeps what is ready
    pre.stop()
    assert not pre.running
    pre.request("e", lambda cancelled: 5)  # after stop: ignored
    assert not pre.running and pre.ready() == ("d", 4)


def test_a_build_pauses_after_each_piece_as_long_as_it_took() -> None:
    """Pure-Python work holds the interpreter: the builder leaves the training thread as
    much time as each piece took (two pieces of 0.1 s: 0.2 s more)."""
    def busy(seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    def build(poll):
        busy(0.1)
        poll()
        busy(0.1)
        poll()
        return time.perf_counter() - start

    pre: Precomputer[str, float] = Precomputer(yield_ratio=1.0)
    start = time.perf_counter()
    pre.request("k", build)
    while pre.ready() is None:
        time.sleep(0.01)
    took = pre.ready()[1]
    pre.stop()
    assert took >= 0.38
    with pytest.raises(ValueError, match="yield_ratio=-1"):
        Precomputer(yield_ratio=-1)
