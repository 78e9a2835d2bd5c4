"""Algorithm 1: the fastest plan of data-parallel pipelines over N interchangeable TP groups.

Search space (the brute force in the tests enumerates exactly this):
* a multiset of pipeline depths in [min_depth, max_depth], between min_pipelines and
  max_pipelines pipelines, using D <= N units (at most max_idle_units idle);
* the global batch (M microbatches) split in proportion to depth, floor(M d_j / D) each,
  the remainder going one each to some pipelines (none may end with zero);
* per pipeline a layer split megatron-core can express without a custom layout:
  first stage a layers, last stage b, the middle stages k each (a, b, k >= 1);
* no stage over device memory (Eq. 14), or, when the profile has a swap bandwidth, none
  that swapping activations cannot fit (its times then include the copies, ``swap_model``).
Objective: the slowest pipeline's longest path + gradient sync + step overhead.

How it stays fast and exact:
* a pipeline's time depends only on (depth, microbatches, its split), so the best split
  is found once per (depth, microbatches), with lower-bound pruning; the sync term couples
  pipelines only through the largest per-rank gradient bytes beta, so each (d, m) keeps
  the Pareto front of (beta, time) and a plan is scored at every beta threshold;
* multisets are enumerated as counts per depth (not ordered partitions), depths in order
  of their best time, with branch-and-bound on max(time) + sync(P, beta) and on the
  busy-time bound M W / D for using D units;
* a deadline stops the search with the best plan so far (``complete=False``).
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from dataclasses import dataclass

import numpy as np

from chameleon_megatron.resilience.decision.perf_model import hop_s, sync_s
from chameleon_megatron.resilience.decision.profile import Profile
from chameleon_megatron.resilience.decision.schedule import (
    Schedule,
    compile_schedule,
    pipeline_lower_bound,
)
from chameleon_megatron.resilience.decision.swap_model import swap_times

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class SearchOptions:
    """Bounds of the plan search."""

    min_depth: int = 1
    max_depth: int | None = None
    """None: the number of layers."""
    min_pipelines: int = 1
    max_pipelines: int | None = None
    max_idle_units: int | None = None
    """Most TP groups left without a slot; None: no limit."""
    uniform: bool = False
    """Only plans megatron runs natively: equal depths, equal splits, equal microbatches."""
    time_limit_s: float | None = None
    """Stop and return the best plan so far after this long; None: search to the end."""

    def __post_init__(self) -> None:
        if self.min_depth < 1:
            raise ValueError(f"min_depth={self.min_depth}: must be >= 1")
        if self.max_depth is not None and self.max_depth < self.min_depth:
            raise ValueError(f"max_depth={self.max_depth}: must be >= min_depth={self.min_depth}")
        if self.min_pipelines < 1:
            raise ValueError(f"min_pipelines={self.min_pipelines}: must be >= 1")
        if self.max_pipelines is not None and self.max_pipelines < self.min_pipelines:
            raise ValueError(
                f"max_pipelines={self.max_pipelines}: must be >= min_pipelines={self.min_pipelines}"
            )
        if self.max_idle_units is not None and self.max_idle_units < 0:
            raise ValueError(f"max_idle_units={self.max_idle_units}: must be >= 0")
        if self.time_limit_s is not None and self.time_limit_s < 0:
            raise ValueError(f"time_limit_s={self.time_limit_s}: must be >= 0")


@dataclass(frozen=True)
class PipelineShape:
    depth: int
    microbatches: int
    layer_counts: tuple[int, ...]
    """Transformer layers of each stage."""


@dataclass(frozen=True)
class SearchResult:
    """Best plan shape found (ranks are assigned by the restorer)."""

    pipelines: tuple[PipelineShape, ...] | None
    t_step_s: float
    """The objective of that shape (inf when none)."""
    complete: bool
    """False when the deadline stopped the search (the shape is the best so far)."""
    reason: str
    elapsed_s: float
    evaluated: int
    """Multisets scored."""


@dataclass(frozen=True)
class _Front:
    """Pareto front of one (depth, microbatches): beta ascending, time descending."""

    betas: tuple[float, ...]
    times: tuple[float, ...]
    splits: tuple[int, ...]

    def best(self, beta: float) -> tuple[float, int]:
        """Fastest (time, split) among splits with gradient bytes <= beta."""
        i = bisect.bisect_right(self.betas, beta) - 1
        return (self.times[i], self.splits[i]) if i >= 0 else (math.inf, -1)


class _Splits:
    """Megatron-expressible layer splits of one depth, with per-stage cost arrays."""

    def __init__(self, profile: Profile, depth: int, uniform: bool) -> None:
        L = profile.num_layers
        counts = _split_counts(L, depth, uniform)
        self.counts = counts
        if not counts:
            return
        cum = _prefix_costs(profile)
        ends = np.cumsum(np.array(counts), axis=1)
        starts = ends - np.array(counts)
        per = {k: cum[k][ends] - cum[k][starts] for k in cum}  # (n, depth) each
        emb, out = profile.embedding, profile.output
        for key, e, o in (("f", emb.forward_s, out.forward_s),
                          ("b", emb.backward_s, out.backward_s),
                          ("static", 2 * emb.param_bytes + emb.optimizer_bytes,
                           2 * out.param_bytes + out.optimizer_bytes),
                          ("act", emb.activation_bytes, out.activation_bytes),
                          ("grad", emb.param_bytes, out.param_bytes)):
            per[key][:, 0] += e
            per[key][:, -1] += o
        self.f, self.b = per["f"], per["b"]
        self.static, self.act = per["static"], per["act"]
        self.beta = per["grad"].max(axis=1)
        self.stage_index = np.arange(depth)


def _prefix_costs(profile: Profile) -> dict[str, np.ndarray]:
    layers = profile.layers
    cols = {
        "f": [c.forward_s for c in layers],
        "b": [c.backward_s for c in layers],
        "static": [2 * c.param_bytes + c.optimizer_bytes for c in layers],
        "act": [c.activation_bytes for c in layers],
        "grad": [c.param_bytes for c in layers],
    }
    return {k: np.concatenate([[0.0], np.cumsum(v)]) for k, v in cols.items()}


def _split_counts(L: int, d: int, uniform: bool) -> list[tuple[int, ...]]:
    """(a, k, ..., k, b) with a, b, k >= 1 summing to L; only the even one if uniform."""
    if d > L:
        return []
    if uniform or d == 1:
        return [(L // d,) * d] if L % d == 0 else []
    if d == 2:
        return [(a, L - a) for a in range(1, L)]
    out = []
    for k in range(1, (L - 2) // (d - 2) + 1):
        rest = L - (d - 2) * k
        out.extend((a,) + (k,) * (d - 2) + (rest - a,) for a in range(1, rest))
    return out


class Planner:
    """Searches plans for one profile and options. Remembers each search and each
    (depth, microbatches) result, so planning for many failure cases shares work."""

    def __init__(self, profile: Profile, options: SearchOptions | None = None) -> None:
        self.profile = profile
        self.options = options or SearchOptions()
        self._hop = hop_s(profile)
        self._splits: dict[int, _Splits] = {}
        self._fronts: dict[tuple[int, int], _Front] = {}
        self._bounds: dict[tuple[int, int], tuple[float, float]] = {}
        self._times: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._schedules: dict[tuple[int, int], Schedule] = {}
        self._results: dict[tuple[int, int], SearchResult] = {}
        # compute of one microbatch through the whole model: M W / D bounds any plan on D units
        self._work = sum(c.forward_s + c.backward_s
                         for c in (*profile.layers, profile.embedding, profile.output))

    # -- per pipeline -------------------------------------------------------------------
    def _split_table(self, d: int) -> _Splits:
        if d not in self._splits:
            self._splits[d] = _Splits(self.profile, d, self.options.uniform)
        return self._splits[d]

    def _stage_times(self, d: int, m: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per split of depth d with m microbatches: each stage's forward/backward time (with
        the copies of a stage that must swap to fit) and whether every stage fits."""
        key = (d, m)
        if key not in self._times:
            sp = self._split_table(d)
            inflight = np.minimum(d - sp.stage_index, m)
            self._times[key] = swap_times(sp.f, sp.b, sp.static, sp.act, inflight,
                                          self.profile.device_memory_bytes,
                                          self.profile.swap_bandwidth_Bps)
        return self._times[key]

    def _feasible_bounds(self, d: int, m: int) -> tuple[np.ndarray, np.ndarray]:
        """Per split of depth d: fits memory with m microbatches; lower bound on its time."""
        f, b, fits = self._stage_times(d, m)
        return fits, pipeline_lower_bound(f, b, m, self._hop)

    def bound(self, d: int, m: int) -> tuple[float, float]:
        """(lower bound on the time, smallest gradient bytes) over the feasible splits of
        (d, m); (inf, inf) when none fits. Cheap: no schedule is timed."""
        key = (d, m)
        if key not in self._bounds:
            sp = self._split_table(d)
            result = (math.inf, math.inf)
            if sp.counts:
                fits, lb = self._feasible_bounds(d, m)
                if fits.any():
                    result = (float(lb[fits].min()), float(sp.beta[fits].min()))
            self._bounds[key] = result
        return self._bounds[key]

    def front(self, d: int, m: int) -> _Front:
        """Pareto front of (gradient bytes, time) over the feasible splits of (d, m)."""
        key = (d, m)
        if key in self._fronts:
            return self._fronts[key]
        sp = self._split_table(d)
        betas: list[float] = []
        times: list[float] = []
        splits: list[int] = []
        if sp.counts:
            fits, lb = self._feasible_bounds(d, m)
            f, b, _ = self._stage_times(d, m)
            if key not in self._schedules:
                self._schedules[key] = compile_schedule(d, 1, m)
            schedule = self._schedules[key]
            for i in np.argsort(lb, kind="stable"):
                if not fits[i]:
                    continue
                beta = float(sp.beta[i])
                right = bisect.bisect_right(betas, beta)
                bound = times[right - 1] if right else math.inf
                if lb[i] >= bound:
                    continue
                t = schedule.time(f[i].tolist(), b[i].tolist(), self._hop)
                if t >= bound:
                    continue
                # insert; drop the points it dominates (beta no smaller, time no smaller)
                left = end = bisect.bisect_left(betas, beta)
                while end < len(betas) and times[end] >= t:
                    end += 1
                betas[left:end], times[left:end], splits[left:end] = [beta], [t], [int(i)]
        front = _Front(tuple(betas), tuple(times), tuple(splits))
        self._fronts[key] = front
        return front

    def split_counts(self, d: int, index: int) -> tuple[int, ...]:
        return self._split_table(d).counts[index]

    # -- whole plan ---------------------------------------------------------------------
    def search(self, num_units: int, global_microbatches: int | None = None) -> SearchResult:
        """Fastest shape over ``num_units`` TP groups for the profile's global batch."""
        if num_units < 1:
            raise ValueError(f"num_units={num_units}: must be >= 1")
        M = global_microbatches or self.profile.global_microbatches
        if (num_units, M) in self._results:
            return self._results[(num_units, M)]
        run = _Search(self, num_units, M)
        run.execute()
        shape = run.best_shape
        elapsed = time.perf_counter() - run.started
        reason = "ok" if shape else (
            "stopped by the time limit before any plan" if run.timed_out else
            f"no plan of {num_units} TP groups fits memory within the depth/pipeline bounds"
        )
        log.debug("plan search N=%d M=%d: %s in %.3fs (%d multisets)",
                  num_units, M, reason, elapsed, run.evaluated)
        result = SearchResult(pipelines=shape, t_step_s=run.best, complete=not run.timed_out,
                              reason=reason, elapsed_s=elapsed, evaluated=run.evaluated)
        self._results[(num_units, M)] = result
        return result


class _Search:
    """One search: state of the branch-and-bound (kept out of Planner so it is reentrant)."""

    def __init__(self, planner: Planner, n: int, M: int) -> None:
        self.p = planner
        self.n, self.M = n, M
        opts = planner.options
        self.opts = opts
        self.max_depth = min(opts.max_depth or planner.profile.num_layers, n)
        self.max_pipes = min(opts.max_pipelines or n, M)
        self.best = math.inf
        self.best_shape: tuple[PipelineShape, ...] | None = None
        self.evaluated = 0
        self.started = time.perf_counter()
        self.deadline = math.inf if opts.time_limit_s is None else self.started + opts.time_limit_s
        self.timed_out = False
        self.overhead = planner.profile.step_overhead_s

    def _sync(self, pipes: int, beta: float) -> float:
        return sync_s(self.p.profile, pipes, beta)

    def _out_of_time(self) -> bool:
        if self.best_shape is not None and time.perf_counter() > self.deadline:
            self.timed_out = True
        return self.timed_out

    def execute(self) -> None:
        idle = self.opts.max_idle_units
        fewest = 1 if idle is None else max(1, self.n - idle)
        for D in range(self.n, fewest - 1, -1):
            if self.M * self.p._work / D + self.overhead >= self.best or self._out_of_time():
                break
            if self.opts.uniform:
                self._uniform(D)
            else:
                self._multisets(D)

    # -- uniform plans ------------------------------------------------------------------
    def _uniform(self, D: int) -> None:
        for d in range(self.opts.min_depth, self.max_depth + 1):
            P = D // d
            if D % d or not self.opts.min_pipelines <= P <= self.max_pipes or self.M % P:
                continue
            front = self.p.front(d, self.M // P)
            for beta, t, split in zip(front.betas, front.times, front.splits):
                self.evaluated += 1
                total = t + self._sync(P, beta) + self.overhead
                if total < self.best:
                    shape = PipelineShape(d, self.M // P, self.p.split_counts(d, split))
                    self.best, self.best_shape = total, (shape,) * P

    # -- heterogeneous plans ------------------------------------------------------------
    def _multisets(self, D: int) -> None:
        M = self.M
        usable: list[_Depth] = []
        for d in range(self.opts.min_depth, self.max_depth + 1):
            fl = M * d // D
            lb, beta = self.p.bound(d, max(fl, 1))
            if math.isfinite(lb):
                usable.append(_Depth(d, fl, lb, beta))
        usable.sort(key=lambda u: (u.lb, u.depth))
        if not usable:
            return
        # reach[i][r]: r is a sum of depths of usable[i:]
        reach = [[False] * (D + 1) for _ in range(len(usable) + 1)]
        reach[-1][0] = True
        for i in range(len(usable) - 1, -1, -1):
            row, nxt, d = reach[i], reach[i + 1], usable[i].depth
            for r in range(D + 1):
                row[r] = nxt[r] or (r >= d and row[r - d])
        counts = [0] * len(usable)

        def dfs(i: int, rem: int, pipes: int, lb_max: float, beta_max: float) -> None:
            if self._out_of_time():
                return
            if rem == 0:
                if pipes >= self.opts.min_pipelines:
                    self._score([(u, c) for u, c in zip(usable, counts) if c])
                return
            if i == len(usable) or not reach[i][rem]:
                return
            u = usable[i]
            if max(lb_max, u.lb) + self._sync(pipes + 1, beta_max) + self.overhead >= self.best:
                return  # rem > 0 needs a pipeline of usable[i:], whose bounds are no lower
            # past the cheap bound: the exact best time of this depth bounds better
            fastest = min(self.p.front(u.depth, max(u.floor, 1)).times)
            new_lb, new_beta = max(lb_max, fastest), max(beta_max, u.beta)
            # the bound grows with the count (sync grows with P): test one pipeline first
            k_max = min(rem // u.depth, self.max_pipes - pipes)
            if new_lb + self._sync(pipes + 1, new_beta) + self.overhead >= self.best:
                k_max = 0
            for k in range(k_max, -1, -1):
                if k and new_lb + self._sync(pipes + k, new_beta) + self.overhead >= self.best:
                    continue
                if not reach[i + 1][rem - k * u.depth]:
                    continue
                counts[i] = k
                dfs(i + 1, rem - k * u.depth, pipes + k, new_lb if k else lb_max,
                    new_beta if k else beta_max)
                counts[i] = 0
                if self.timed_out:
                    return

        dfs(0, D, 0, 0.0, 0.0)

    def _score(self, used: list[tuple["_Depth", int]]) -> None:
        """Best objective of one multiset over beta thresholds; keeps it if it wins."""
        self.evaluated += 1
        pipes = sum(c for _, c in used)
        extra = self.M - sum(u.floor * c for u, c in used)
        forced = sum(c for u, c in used if u.floor == 0)
        if extra < forced:
            return
        fronts = [(self.p.front(u.depth, u.floor) if u.floor else None,
                   self.p.front(u.depth, u.floor + 1) if extra else None) for u, _ in used]
        betas = sorted({b for pair in fronts for f in pair if f is not None for b in f.betas})
        for beta in betas:
            worst, incs = _max_time(used, fronts, beta, extra - forced)
            total = worst + self._sync(pipes, beta) + self.overhead
            if total < self.best:
                self.best = total
                self.best_shape = self._shape(used, fronts, beta, incs)

    def _shape(self, used: list[tuple["_Depth", int]], fronts: list, beta: float,
               incs: list[int]) -> tuple[PipelineShape, ...]:
        out: list[PipelineShape] = []
        for (u, c), (f0, f1), plus in zip(used, fronts, incs):
            for m, n, front in ((u.floor + 1, plus, f1), (u.floor, c - plus, f0)):
                if n:
                    counts = self.p.split_counts(u.depth, front.best(beta)[1])
                    out.extend([PipelineShape(u.depth, m, counts)] * n)
        return tuple(sorted(out, key=lambda s: (-s.depth, -s.microbatches)))


@dataclass(frozen=True)
class _Depth:
    """A depth usable with D units: floor(M d / D) microbatches, bounds of its time."""

    depth: int
    floor: int
    lb: float
    beta: float


def _max_time(used: list[tuple[_Depth, int]], fronts: list, beta: float,
              extra: int) -> tuple[float, list[int]]:
    """Slowest pipeline when pipelines with no floor share take one more microbatch and
    ``extra`` others do too, chosen where the time grows least (optimal for a max)."""
    worst = 0.0
    grow: list[tuple[float, int]] = []
    incs = [0] * len(used)
    for k, ((u, c), (f0, f1)) in enumerate(zip(used, fronts)):
        if u.floor == 0:
            worst = max(worst, f1.best(beta)[0])
            incs[k] = c
            continue
        worst = max(worst, f0.best(beta)[0])
        if extra:
            grow.extend([(f1.best(beta)[0], k)] * min(c, extra))
    if len(grow) < extra:
        return math.inf, incs
    grow.sort()
    for t1, k in grow[:extra]:
        worst = max(worst, t1)
        incs[k] += 1
    return worst, incs
