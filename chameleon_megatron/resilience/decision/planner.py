"""Algorithm 1: the fastest plan of data-parallel pipelines over N interchangeable TP groups.

Search space (the brute force in the tests enumerates exactly this):
* a multiset of pipeline depths in [min_depth, max_depth], between min_pipelines and
  max_pipelines pipelines, using D <= N units (at most max_idle_units idle);
* the global batch (M microbatches) split in proportion to depth, floor(M d_j / D) each,
  the remainder going one each to some pipelines (none may end with zero);
* per pipeline any split of the layers into contiguous non-empty stages (megatron-core
  expresses each with ``pipeline_model_parallel_layout``);
* no stage over device memory (Eq. 14), or, when the profile has a swap bandwidth, none
  that swapping activations cannot fit (its times then include the copies, ``swap_model``).
Objective: the slowest pipeline's longest path + gradient sync + step overhead.

How it stays fast and exact:
* a pipeline's time depends only on (depth, microbatches, its split), so the best split
  is found once per (depth, microbatches), best-first on a bound (``splits``); the sync term couples
  pipelines only through the largest per-rank gradient bytes beta, so each (d, m) keeps
  the Pareto front of (beta, time) and a plan is scored at every beta threshold;
* multisets are enumerated as counts per depth (not ordered partitions), depths in order
  of their best time, with branch-and-bound on max(time) + sync(P, beta) and on the
  busy-time bound M W / D for using D units;
* a deadline stops the search with the best plan so far (``complete=False``).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable

from chameleon_megatron.resilience.decision.perf_model import hop_s, sync_s
from chameleon_megatron.resilience.decision.profile import Profile
from chameleon_megatron.resilience.decision.schedule import Schedule, compile_schedule
from chameleon_megatron.resilience.decision.splits import (
    Deadline,
    Front,
    SplitSearch,
    prefix_costs,
)

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
    replicated: bool = False
    """Prefer plans of two or more pipelines (every stage's state then has a copy that
    survives the next failure), however much faster one pipeline would be; one pipeline
    only when no such plan fits (a recovery's layout: a single pipeline leaves the job one
    failure from losing its state)."""
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


class Planner:
    """Searches plans for one profile and options. Remembers each search and each
    (depth, microbatches) result, so planning for many failure cases shares work."""

    def __init__(self, profile: Profile, options: SearchOptions | None = None) -> None:
        self.profile = profile
        self.options = options or SearchOptions()
        self._hop = hop_s(profile)
        self._cum = prefix_costs(profile)
        # (d, m): (below, what the splits faster than ``below`` give)
        self._fronts: dict[tuple[int, int], tuple[float, Front]] = {}
        self._bounds: dict[tuple[int, int], tuple[float, tuple[float, float]]] = {}
        self._schedules: dict[tuple[int, int], Schedule] = {}
        self._results: dict[tuple[int, int], SearchResult] = {}
        # compute of one microbatch through the whole model: M W / D bounds any plan on D units
        self._work = sum(c.forward_s + c.backward_s
                         for c in (*profile.layers, profile.embedding, profile.output))

    # -- per pipeline -------------------------------------------------------------------
    def _split_search(self, d: int, m: int, below: float) -> SplitSearch:
        return SplitSearch(self.profile, self._cum, d, m, self._hop,
                           lambda: self._schedule(d, m), uniform=self.options.uniform,
                           below=below)

    def _schedule(self, d: int, m: int) -> Schedule:
        if (d, m) not in self._schedules:
            self._schedules[(d, m)] = compile_schedule(d, 1, m)
        return self._schedules[(d, m)]

    def bound(self, d: int, m: int, below: float = math.inf) -> tuple[float, float]:
        """(lower bound on the time, smallest gradient bytes) over the feasible splits of
        (d, m) that may take less than ``below``; (inf, inf) when none does. Cheaper than
        ``front``: no schedule is timed."""
        return self._remembered(self._bounds, d, m, below, SplitSearch.bound)

    def front(self, d: int, m: int, below: float = math.inf,
              deadline: float = math.inf) -> Front:
        """Pareto front of (gradient bytes, time) over the feasible splits of (d, m) that
        take less than ``below`` (a plan with a slower pipeline cannot win). ``Deadline``
        (nothing remembered) when ``time.perf_counter()`` passes ``deadline`` first."""
        return self._remembered(self._fronts, d, m, below,
                                lambda search: search.front(below, deadline))

    def _remembered(self, memo: dict, d: int, m: int, below: float, compute: Callable) -> Any:
        """``compute`` of (d, m)'s splits faster than ``below``, or what an earlier call
        found for a ``below`` no smaller (it holds every such split too)."""
        known = memo.get((d, m))
        if known is None or known[0] < below:
            known = (below, compute(self._split_search(d, m, below)))
            memo[(d, m)] = known
        return known[1]

    # -- whole plan ---------------------------------------------------------------------
    def search(self, num_units: int, global_microbatches: int | None = None) -> SearchResult:
        """Fastest shape over ``num_units`` TP groups for the profile's global batch."""
        if num_units < 1:
            raise ValueError(f"num_units={num_units}: must be >= 1")
        M = global_microbatches or self.profile.global_microbatches
        if (num_units, M) in self._results:
            return self._results[(num_units, M)]
        fewest = self.options.min_pipelines
        run = _Search(self, num_units, M, max(fewest, 2) if self.options.replicated else fewest)
        run.execute()
        if run.best_shape is None and not run.timed_out and run.min_pipes > fewest:
            run = _Search(self, num_units, M, fewest)  # nothing replicated fits
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

    def __init__(self, planner: Planner, n: int, M: int, min_pipes: int) -> None:
        self.p = planner
        self.n, self.M = n, M
        opts = planner.options
        self.opts = opts
        self.min_pipes = min_pipes
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

    def _below(self) -> float:
        """A pipeline at least this slow cannot be part of a plan faster than the best."""
        return self.best - self.overhead

    def _deadline(self) -> float:
        """When a split search must give up: the deadline once some plan is known."""
        return self.deadline if self.best_shape is not None else math.inf

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
            try:
                self._uniform(D) if self.opts.uniform else self._multisets(D)
            except Deadline:
                self.timed_out = True

    # -- uniform plans ------------------------------------------------------------------
    def _uniform(self, D: int) -> None:
        for d in range(self.opts.min_depth, self.max_depth + 1):
            P = D // d
            if D % d or not self.min_pipes <= P <= self.max_pipes or self.M % P:
                continue
            front = self.p.front(d, self.M // P, self._below(), self._deadline())
            for beta, t, split in zip(front.betas, front.times, front.splits):
                self.evaluated += 1
                total = t + self._sync(P, beta) + self.overhead
                if total < self.best:
                    shape = PipelineShape(d, self.M // P, split)
                    self.best, self.best_shape = total, (shape,) * P

    # -- heterogeneous plans ------------------------------------------------------------
    def _multisets(self, D: int) -> None:
        M = self.M
        usable: list[_Depth] = []
        for d in range(self.opts.min_depth, self.max_depth + 1):
            fl = M * d // D
            lb, beta = self.p.bound(d, max(fl, 1), self._below())
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
                if pipes >= self.min_pipes:
                    self._score([(u, c) for u, c in zip(usable, counts) if c])
                return
            if i == len(usable) or not reach[i][rem]:
                return
            u = usable[i]
            if max(lb_max, u.lb) + self._sync(pipes + 1, beta_max) + self.overhead >= self.best:
                return  # rem > 0 needs a pipeline of usable[i:], whose bounds are no lower
            # past the cheap bound: the exact best time of this depth bounds better
            fastest = min(self.p.front(u.depth, max(u.floor, 1), self._below(),
                                       self._deadline()).times,
                          default=math.inf)
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
        below, deadline = self._below(), self._deadline()
        fronts = [(self.p.front(u.depth, u.floor, below, deadline) if u.floor else None,
                   self.p.front(u.depth, u.floor + 1, below, deadline) if extra else None)
                  for u, _ in used]
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
                    out.extend([PipelineShape(u.depth, m, front.best(beta)[1])] * n)
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
