"""Every contiguous layer split of one pipeline, searched exactly.

A pipeline of depth d with m microbatches may give its stages any d non-empty contiguous
runs of the L layers: C(L-1, d-1) splits, far too many to time one by one at scale. The
search is best-first on a lower bound of the step instead:

* a stage's term of the pipeline bound (``schedule.stage_bounds``) depends only on its index,
  its first and last layer and the compute before and after it, taken as the least that
  any stages before and after can hold (which keeps it a bound); so a dynamic program over
  (stage, first layer) gives, for every prefix of a split, the least bound any completion
  reaches;
* a window of neighbouring stages adds its own term (``schedule.window_bounds``), known
  once its stages are placed: prefixes grow a stage at a time, depth first over chunks in
  order of their bound, and one whose bound reaches the best time found is cut;
* complete splits are timed exactly (Eq. 11, their stages with the copies that make them
  fit, ``swap_model``), a chunk at a time. Rounds under a rising threshold make it
  best-first: once the best time found is within the threshold, it is the optimum over
  every split.

The step time also depends on a split's largest per-rank gradient bytes (beta, through the
sync term), so ``SplitSearch.front`` returns the Pareto front of (beta, time): after each
best split, the search runs again over the splits whose beta is smaller.

Stage i starts at layer ``i + a`` (0 <= a < K = L - d + 1: every stage keeps at least one
layer and leaves one to each later stage) and holds ``j + 1`` layers; the next stage starts
at ``a + j`` in the same terms.
"""

from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from chameleon_megatron.resilience.decision.profile import Profile
from chameleon_megatron.resilience.decision.schedule import Schedule, stage_bounds, window_bounds
from chameleon_megatron.resilience.decision.swap_model import swap_times

_CHUNK = 128
"""Prefixes extended (and splits timed) at once."""
_FIRST_MARGIN = 1e-3
"""The first round times the splits within this fraction of the least bound."""

_TIE = 1e-12
"""Relative difference below which two times are equal: splits that tie the best up to
rounding (with one microbatch every split takes the same time) are not searched."""

Split = tuple[int, ...]
"""Transformer layers of each stage."""


class Deadline(Exception):
    """A split search passed its deadline (what it found is incomplete: not kept)."""


@dataclass(frozen=True)
class Front:
    """Pareto front of one (depth, microbatches): beta ascending, time descending."""

    betas: tuple[float, ...]
    times: tuple[float, ...]
    splits: tuple[Split, ...]

    def best(self, beta: float) -> tuple[float, Split | None]:
        """Fastest (time, split) among splits with gradient bytes <= beta."""
        i = bisect.bisect_right(self.betas, beta) - 1
        return (self.times[i], self.splits[i]) if i >= 0 else (math.inf, None)


def prefix_costs(profile: Profile) -> dict[str, np.ndarray]:
    """Cumulative per-layer costs (index k: layers 0..k-1), and ``run``."""
    layers = profile.layers
    cols = {
        "f": [c.forward_s for c in layers],
        "b": [c.backward_s for c in layers],
        "static": [2 * c.param_bytes + c.optimizer_bytes for c in layers],
        "act": [c.activation_bytes for c in layers],
        "grad": [c.param_bytes for c in layers],
    }
    cum = {k: np.concatenate([[0.0], np.cumsum(v)]) for k, v in cols.items()}
    c = cum["f"] + cum["b"]  # run[n]: the least compute of n consecutive layers
    cum["run"] = np.array([0.0] + [float((c[n:] - c[:-n]).min()) for n in range(1, len(c))])
    return cum


class SplitSearch:
    """Stage costs and bounds of every (stage, first layer, length) of one (depth,
    microbatches) that a split faster than ``below`` may hold; ``bound`` and ``front``
    search the splits they make (a stage busy ``m`` times its compute for at least
    ``below`` is left out: that bounds a stage's length, which keeps the arrays small)."""

    def __init__(self, profile: Profile, cum: dict[str, np.ndarray], depth: int, m: int,
                 hop: float, schedule: Callable[[], Schedule], *, uniform: bool = False,
                 below: float = math.inf) -> None:
        L, d = profile.num_layers, depth
        self.depth, self.K, self.hop, self.schedule = d, L - d + 1, hop, schedule
        K = self.K
        W = _longest(cum["run"], K, below / m)
        if K < 1 or W * d < L or (uniform and L % d):  # some stage would hold over W
            self.term = np.full((d, 0, 0), math.inf)
            return
        # [i, a, j]: stage i starts at layer i + a and holds j + 1 layers
        i = np.arange(d)[:, None, None]
        a, j = np.arange(K)[None, :, None], np.arange(W)[None, None, :]
        start, end = i + a, np.minimum(i + a + j + 1, L)
        first, last = i == 0, i == d - 1
        valid = (a + j < K) & (~first | (a == 0)) & (~last | (a + j == K - 1))
        if uniform:
            valid &= (start == i * (L // d)) & (end - start == L // d)
        emb, out = profile.embedding, profile.output
        ends = {  # what the embedding and the output add to the first and last stage
            "f": (emb.forward_s, out.forward_s), "b": (emb.backward_s, out.backward_s),
            "static": (2 * emb.param_bytes + emb.optimizer_bytes,
                       2 * out.param_bytes + out.optimizer_bytes),
            "act": (emb.activation_bytes, out.activation_bytes),
            "grad": (emb.param_bytes, out.param_bytes)}
        per = {k: cum[k][end] - cum[k][start] + first * e + last * o
               for k, (e, o) in ends.items()}
        f, b, fits = swap_times(per["f"], per["b"], per["static"], per["act"],
                                np.minimum(d - i, m), profile.device_memory_bytes,
                                profile.swap_bandwidth_Bps)
        ok = valid & fits & (m * (f + b) < below)
        self.next = np.minimum(a + j, K - 1)[0]  # (K, W): where the next stage starts
        if profile.swap_bandwidth_Bps > 0:
            before, after = self._least_sums(np.where(ok, f + b, math.inf))
        else:  # no copies: the stages before and after hold exactly their layers' compute
            c = cum["f"] + cum["b"]
            rows, cols = np.arange(d)[:, None], np.arange(K)[None, :]
            before = c[rows + cols] + (rows > 0) * (emb.forward_s + emb.backward_s)
            after = c[L] - c[rows + 1 + cols] + (rows < d - 1) * (out.forward_s + out.backward_s)
        term = stage_bounds(f, b, i, d, m, hop, before[:, :, None], after[:, self.next])
        self.term = np.where(ok, term, math.inf)
        self.f, self.b, self.c, self.grad = f, b, f + b, per["grad"]
        self.m, self.after = m, after

    # -- the dynamic programs ------------------------------------------------------------
    def _least_sums(self, c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """From stage costs c[i][a][j] (inf where not allowed): before[i][a], the least
        total of stages 0..i-1 when stage i starts at layer i + a; after[i][a2], the least
        total of stages i+1.. when stage i+1 starts at layer i + 1 + a2."""
        d, K, W = c.shape
        before = np.full((d, K), math.inf)
        after = np.full((d, K), math.inf)
        before[0][0] = 0.0
        after[d - 1][K - 1] = 0.0
        j = np.arange(W)[None, :]
        prev = np.arange(K)[:, None] - j  # [a2, j]: the stage before started at a2 - j
        cut = prev < 0
        prev = np.maximum(prev, 0)
        for s in range(1, d):
            into = before[s - 1][prev] + c[s - 1][prev, j]
            before[s] = np.where(cut, math.inf, into).min(axis=1)
            after[d - 1 - s] = (c[d - s] + after[d - s][self.next]).min(axis=1)
        return before, after

    def _completions(self, term: np.ndarray) -> np.ndarray:
        """least[i][a]: the least largest term of stages i..d-1 when stage i starts at
        layer i + a (inf where no split completes)."""
        d, K = self.depth, self.K
        least = np.full((d + 1, K), math.inf)
        least[d][K - 1] = 0.0
        for s in range(d - 1, -1, -1):
            least[s] = np.maximum(term[s], least[s + 1][self.next]).min(axis=1)
        return least

    def bound(self) -> tuple[float, float]:
        """(least bound on the time, least gradient bytes) over the splits that fit (and
        may be faster than ``below``); (inf, inf) when none does."""
        if self.term.size == 0:
            return math.inf, math.inf
        lb = float(self._completions(self.term)[0][0])
        if not math.isfinite(lb):
            return math.inf, math.inf
        grad = np.where(np.isfinite(self.term), self.grad, math.inf)
        return lb, float(self._completions(grad)[0][0])

    # -- the search ----------------------------------------------------------------------
    def front(self, below: float = math.inf, deadline: float = math.inf) -> Front:
        """Pareto front of (gradient bytes, time) over the splits that fit and take less
        than ``below``; ``Deadline`` when ``time.perf_counter()`` passes ``deadline``."""
        betas: list[float] = []
        times: list[float] = []
        splits: list[Split] = []
        cap = math.inf
        while self.term.size:
            found = self._fastest(np.where(self.grad < cap, self.term, math.inf), below,
                                  deadline)
            if found is None:
                break
            t, beta, split = found
            if times and t <= times[-1]:  # as fast with less gradient: replaces the last
                betas.pop(), times.pop(), splits.pop()
            betas.append(beta), times.append(t), splits.append(split)
            cap = beta
        return Front(tuple(reversed(betas)), tuple(reversed(times)), tuple(reversed(splits)))

    def _fastest(self, term: np.ndarray, below: float,
                 deadline: float) -> tuple[float, float, Split] | None:
        """Exact fastest split among those with a finite term; (time, beta, split), the
        least beta among the fastest; None when none is finite or none takes less than
        ``below``. Rounds of ``_search`` under a rising threshold: once the fastest split
        found is no slower than the threshold, every faster split was timed."""
        least = self._completions(term)
        lb = float(least[0][0])
        best: tuple[float, float, Split] | None = None
        margin = _FIRST_MARGIN
        while lb < below:
            theta = min(below, best[0] if best else lb * (1 + margin))
            best = self._search(term, least, theta, best, deadline)
            if best is not None and best[0] <= theta or theta >= below:
                break
            margin *= 4
        return best if best is not None and best[0] < below else None

    def _search(self, term: np.ndarray, least: np.ndarray, theta: float,
                best: tuple[float, float, Split] | None,
                deadline: float) -> tuple[float, float, Split] | None:
        """``best`` or a faster split: every split whose bound is below ``theta`` and the
        fastest found is timed. Depth-first over chunks of prefixes, each chunk's children
        in order of their bounds (memory stays a few chunks per stage)."""

        def bar() -> float:  # a split within rounding of the best is no faster
            return min(theta, best[0] * (1 - _TIE)) if best is not None else theta

        def visit(p: _Prefixes, s: int) -> None:
            nonlocal best
            if time.perf_counter() > deadline:
                raise Deadline
            if s == self.depth:
                best = self._timed(best, p.starts)
                return
            rows, key, bound, nxt, c = self._children(p, s, term, least, bar())
            order = np.argsort(bound, kind="stable")
            for lo in range(0, len(order), _CHUNK):
                k = order[lo:lo + _CHUNK]
                k = k[bound[k] < bar()]
                if not len(k):
                    break  # in order of bound: the rest are no faster
                r = rows[k]
                visit(_Prefixes(np.concatenate([p.starts[r], p.at[r, None]], axis=1),
                                np.concatenate([p.comp[r], c[k, None]], axis=1),
                                key[k], nxt[k]), s + 1)

        visit(_Prefixes(np.zeros((1, 0), dtype=int), np.zeros((1, 0)), np.zeros(1),
                        np.zeros(1, dtype=int)), 0)
        return best

    def _children(self, p: "_Prefixes", s: int, term: np.ndarray, least: np.ndarray,
                  bar: float) -> tuple[np.ndarray, ...]:
        """The prefixes one stage longer whose bound is below ``bar``: for each, its parent's
        row in ``p``, the largest term of its stages, the bound of any split completing
        it, where its next stage starts and its stage s's compute. The terms add every
        window of the placed stages that ends at stage s (``window_bounds``): what makes
        neighbouring heavy stages slow."""
        key = np.maximum(p.key[:, None], term[s][p.at])
        nxt = self.next[p.at]
        rows, js = np.nonzero(np.maximum(key, least[s + 1][nxt]) < bar)
        key, nxt, c = key[rows, js], nxt[rows, js], self.c[s][p.at[rows], js]
        if s and len(rows):
            comp = p.comp[rows]
            tail = np.cumsum(comp[:, ::-1], axis=1)[:, ::-1]  # stages first..s-1
            win = window_bounds(comp.sum(axis=1)[:, None] - tail, comp, tail + c[:, None],
                                self.after[s][nxt][:, None], np.arange(s), s, self.depth,
                                self.m, self.hop)
            key = np.maximum(key, win.max(axis=1))
        return rows, key, np.maximum(key, least[s + 1][nxt]), nxt, c

    def _timed(self, best: tuple[float, float, Split] | None,
               starts: np.ndarray) -> tuple[float, float, Split]:
        """``best`` or the fastest of the splits ``starts`` (then the least gradient); stage
        i of a split starts at layer ``i + starts[i]``."""
        lengths = np.diff(np.concatenate([starts, np.full((len(starts), 1), self.K - 1)],
                                         axis=1), axis=1)  # j of each stage
        idx = (np.arange(self.depth)[None, :], starts, lengths)
        times = self.schedule().times(self.f[idx], self.b[idx], self.hop)
        betas = self.grad[idx].max(axis=1)
        k = int(np.lexsort((betas, times))[0])
        if best is not None and (best[0], best[1]) <= (times[k], betas[k]):
            return best
        return float(times[k]), float(betas[k]), tuple((lengths[k] + 1).tolist())


@dataclass(frozen=True)
class _Prefixes:
    """Placed stages of many partial splits."""

    starts: np.ndarray
    """(n, s): stage i starts at layer i + starts[:, i]."""
    comp: np.ndarray
    """(n, s): compute of one microbatch on each placed stage."""
    key: np.ndarray
    """(n,): the largest term of the placed stages."""
    at: np.ndarray
    """(n,): where the next stage starts (layer s + at)."""


def _longest(run: np.ndarray, K: int, limit: float) -> int:
    """Most layers (at most K) a stage may hold while some run of that many layers has
    compute below ``limit`` (``run[n]``: the least compute of n consecutive layers)."""
    if K < 1 or not math.isfinite(limit):
        return max(K, 0)
    return int(np.searchsorted(run[1:K + 1], limit, side="left"))
