"""The leader's decision at a failure, fresh against precomputed (the decision cache), on
8-rank layouts of the tests' tiny model with the derived profile (calibrated to a measured
step time), in one process: the controller's ``Decider.decide`` for every single failure the
leader decides, without and with a cache built beforehand (its build time too).

    .venv/bin/python scripts/bench_decision_cache.py [--repeat 5]

The recovery record's ``decide`` phase also holds the survivors' rendezvous and run-state
agreement; this is the rest of it (the record's ``decision.decision_s``).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

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
from chameleon_megatron.resilience.store.heartbeat import Heartbeat
from chameleon_megatron.resilience.store.job_store import JobStore

ARGS = dict(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32,
            micro_batch_size=1, global_batch_size=16, padded_vocab_size=128,
            rampup_batch_size=None)


def controller(layout: UniformLayout, beats: Path) -> tuple[RecoveryController, SimpleNamespace]:
    """``beats``: a folder for the detector's heartbeats (no agent reads them here)."""
    job = JobStore(dist.HashStore(), "bench")
    ft = ResilienceConfig(timing_steps=1)
    plan = uniform_plan(layout, list(range(layout.world_size)), 4, 16)
    c = RecoveryController(job=job, detector=FailureDetector(job, 0, ft, Heartbeat(beats, 0)),
                           injector=FaultInjector(0), ft=ft, me=0, plan=plan, backend="gloo")
    for _ in range(3):
        c.detector._timer.record(0.2)
    args = SimpleNamespace(**ARGS, tensor_model_parallel_size=layout.tp)
    return c, SimpleNamespace(args=args, device=torch.device("cpu"))


def decide_all(c: RecoveryController, trainer, world: int) -> list[tuple[float, str]]:
    out = []
    for dead in range(1, world):
        alive = tuple(r for r in range(world) if r != dead)
        agreed = Agreed(iteration=12, consumed_samples=192, scheduler={}, fresh=alive, stale=())
        start = time.perf_counter()
        rec = c.decider.decide(trainer, c.standing(), Membership(2, alive, frozenset([dead])),
                               agreed)["record"]
        out.append((time.perf_counter() - start, rec["decision_from"]))
    return out


def boundary_check_s(c: RecoveryController, trainer, n: int = 200) -> float:
    """The training thread's cost per step once the cache is ready: the basis compared."""
    start = time.perf_counter()
    for _ in range(n):
        c.precompute_decisions(trainer)
    return (time.perf_counter() - start) / n


def torch_work(n: int = 40) -> float:
    """A stand-in for a step's work: small matmuls driven from Python."""
    a = torch.randn(192, 192)
    start = time.perf_counter()
    for _ in range(n):
        a = torch.tanh(a @ a)
    return time.perf_counter() - start


def work_beside_a_build(layout: UniformLayout, beats: Path,
                        rounds: int = 5) -> dict[str, float]:
    """Median of the stand-in alone, beside a paced build (the default) and beside an
    unpaced one, interleaved round by round (the host's load drifts)."""
    times: dict[str, list[float]] = {"alone": [], "paced": [], "unpaced": []}
    for _ in range(rounds):
        times["alone"] += [torch_work() for _ in range(5)]
        for name, ratio in (("paced", 1.0), ("unpaced", 0.0)):
            c, trainer = controller(layout, beats)
            c.decider.precompute = Precomputer("decision-cache", yield_ratio=ratio)
            c.precompute_decisions(trainer)
            while c.decider.precompute.ready() is None:
                times[name].append(torch_work())
            c.close(finished=False)
    return {k: statistics.median(v) for k, v in times.items() if v}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-beats-") as beats:
        run(args.repeat, Path(beats))


def run(repeat: int, beats: Path) -> None:
    for layout in (UniformLayout(tp=1, pp=2, dp=4), UniformLayout(tp=2, pp=2, dp=2)):
        fresh, cached, builds = [], [], []
        for _ in range(repeat):
            c, trainer = controller(layout, beats)
            fresh += decide_all(c, trainer, layout.world_size)
            start = time.perf_counter()
            c.precompute_decisions(trainer)
            while c.decider.precompute.ready() is None:
                time.sleep(0.001)
            builds.append(time.perf_counter() - start)
            cached += decide_all(c, trainer, layout.world_size)
            c.close(finished=False)
        assert {s for _, s in fresh} == {"fresh"} and {s for _, s in cached} == {"cache"}
        f = statistics.median(t for t, _ in fresh)
        k = statistics.median(t for t, _ in cached)
        print(f"tp{layout.tp} pp{layout.pp} dp{layout.dp} ({layout.world_size} ranks), "
              f"{len(fresh)} failures: fresh median {f * 1e3:.1f} ms "
              f"(max {max(t for t, _ in fresh) * 1e3:.1f}), cached median {k * 1e3:.1f} ms "
              f"(max {max(t for t, _ in cached) * 1e3:.1f}), ratio {f / k:.1f}x; "
              f"cache build (background) median {statistics.median(builds) * 1e3:.0f} ms")
    c, trainer = controller(UniformLayout(tp=1, pp=2, dp=4), beats)
    c.precompute_decisions(trainer)
    while c.decider.precompute.ready() is None:
        time.sleep(0.001)
    print(f"step-boundary check with the cache ready: {boundary_check_s(c, trainer) * 1e6:.0f} us")
    c.close(finished=False)
    work = work_beside_a_build(UniformLayout(tp=1, pp=2, dp=4), beats)
    print("torch work on the training thread (median): " + ", ".join(
        f"{k} {v * 1e3:.1f} ms ({v / work['alone']:.2f}x)" for k, v in work.items()))


if __name__ == "__main__":
    main()
