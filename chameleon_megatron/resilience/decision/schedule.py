"""Step time of one pipeline: the longest path through the 1F1B dependency graph (Eq. 11).

Each physical stage runs its operations in megatron's order (1F1B, or interleaved 1F1B
with ``vpp`` model chunks); an operation starts when its stage is free and its input has
arrived: a forward needs the previous virtual stage's forward of the same microbatch, a
backward the next virtual stage's backward (the last virtual stage: its own forward).
Crossing between physical stages costs one p2p ``hop``. With equal stage times and no hop
this reduces to Eq. 9, (N_pp + N_m - 1)(t_f + t_b).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import numpy as np
from numpy.typing import ArrayLike

Op = tuple[bool, int, int]
"""(is_forward, virtual stage, microbatch)."""


def stage_order(pp: int, vpp: int, m: int, s: int) -> list[Op]:
    """Operations of physical stage ``s`` in megatron-core 0.16's execution order."""
    if vpp == 1:
        warmup = min(pp - s - 1, m)
        table = [(j, 0) for j in range(m)]
    else:
        warmup = min((pp - s - 1) * 2 + (vpp - 1) * pp, m * vpp)
        # microbatch groups of pp: every chunk of a group before the next group
        table = [(j, c) for g in range(0, m, pp) for c in range(vpp)
                 for j in range(g, min(g + pp, m))]
    fwd = [(True, c * pp + s, j) for j, c in table]
    bwd = [(False, (vpp - 1 - c) * pp + s, j) for j, c in table]
    steady = len(table) - warmup
    order = fwd[:warmup]
    for i in range(steady):
        order += [fwd[warmup + i], bwd[i]]
    return order + bwd[steady:]


@dataclass(frozen=True)
class Schedule:
    """The operations of one pipeline step in a dependency-respecting order, ready to be
    timed for any stage durations (compile once per (pp, vpp, m), time many splits)."""

    pp: int
    vpp: int
    stage: tuple[int, ...]
    """Physical stage of each operation."""
    duration: tuple[int, ...]
    """Index into fwd + bwd (v for a forward of virtual stage v, nv + v for a backward)."""
    needs: tuple[int, ...]
    """Position of the operation whose output it needs, -1 for none."""
    crosses: tuple[bool, ...]
    """Whether that input comes from another physical stage (one p2p hop)."""

    def time(self, fwd: Sequence[float], bwd: Sequence[float], hop: float) -> float:
        """Longest path: each op starts when its stage is free and its input has arrived."""
        return float(self.times(np.array([fwd], dtype=float), np.array([bwd], dtype=float),
                                hop)[0])

    def times(self, fwd: np.ndarray, bwd: np.ndarray, hop: float) -> np.ndarray:
        """``time`` of many splits at once: rows of ``fwd``/``bwd`` (n, pp * vpp)."""
        nv = self.pp * self.vpp
        if fwd.shape[-1] != nv or bwd.shape[-1] != nv:
            raise ValueError(f"expected {nv} forward and backward times, "
                             f"got {fwd.shape[-1]}/{bwd.shape[-1]}")
        dur = np.concatenate([fwd, bwd], axis=1).T  # (2 nv, n)
        done = np.zeros((len(self.stage) + 1, fwd.shape[0]))  # row -1: "no op", at 0
        for ops, prev, need, hops, d in self._waves:
            done[ops] = np.maximum(done[prev], done[need] + hops * hop) + dur[d]
        return done[:-1].max(axis=0)

    @cached_property
    def _waves(self) -> list[tuple[np.ndarray, ...]]:
        """The ops grouped by depth in the dependency graph (an op waits for the op before
        it on its stage and for its input): each group is timed at once. Per group: the ops,
        the op before each on its stage, its input (-1: none), its hop (0 or 1), duration."""
        prev, last = [], [-1] * self.pp
        level: list[int] = []
        for k, (s, need) in enumerate(zip(self.stage, self.needs)):
            prev.append(last[s])
            last[s] = k
            level.append(1 + max(level[prev[k]] if prev[k] >= 0 else 0,
                                 level[need] if need >= 0 else 0))
        order = np.argsort(level, kind="stable")
        cuts = np.flatnonzero(np.diff(np.array(level)[order])) + 1
        cols = [np.array(c) for c in (prev, self.needs, self.crosses, self.duration)]
        return [(ops, cols[0][ops], cols[1][ops], cols[2][ops][:, None].astype(float),
                 cols[3][ops]) for ops in np.split(order, cuts)]


def compile_schedule(pp: int, vpp: int, m: int) -> Schedule:
    """Order the ops of every stage so that each comes after the op it needs."""
    if pp < 1 or vpp < 1 or m < 1:
        raise ValueError(f"pp={pp}, vpp={vpp}, m={m}: each must be >= 1")
    nv = pp * vpp
    orders = [stage_order(pp, vpp, m, s) for s in range(pp)]
    placed = ([[-1] * m for _ in range(nv)], [[-1] * m for _ in range(nv)])  # backward, forward
    stage: list[int] = []
    duration: list[int] = []
    needs: list[int] = []
    crosses: list[bool] = []
    pos = [0] * pp
    remaining = sum(len(o) for o in orders)
    while remaining:
        before = remaining
        for s in range(pp):
            order = orders[s]
            while pos[s] < len(order):
                is_f, v, j = order[pos[s]]
                if is_f:
                    dep_f, dep_v = True, v - 1
                else:
                    dep_f, dep_v = (True, v) if v == nv - 1 else (False, v + 1)
                need = placed[dep_f][dep_v][j] if dep_v >= 0 else -1
                if dep_v >= 0 and need < 0:
                    break
                placed[is_f][v][j] = len(stage)
                stage.append(s)
                duration.append(v if is_f else nv + v)
                needs.append(need)
                crosses.append(dep_v >= 0 and dep_v % pp != s)
                pos[s] += 1
                remaining -= 1
        if remaining == before:
            raise RuntimeError("schedule deadlock: dependency order is inconsistent")
    return Schedule(pp, vpp, tuple(stage), tuple(duration), tuple(needs), tuple(crosses))


def pipeline_time(fwd: Sequence[float], bwd: Sequence[float], m: int, hop: float,
                  vpp: int = 1) -> float:
    """Time from the first forward to the last backward of one step of one pipeline.

    ``fwd[v]``/``bwd[v]``: time of one microbatch on virtual stage v (v = chunk * pp + s);
    ``m`` microbatches; ``hop``: p2p time between physical stages.
    """
    if len(fwd) % vpp:
        raise ValueError(f"{len(fwd)} virtual stage times are not a multiple of vpp={vpp}")
    return compile_schedule(len(fwd) // vpp, vpp, m).time(fwd, bwd, hop)


def pipeline_lower_bound(fwd: ArrayLike, bwd: ArrayLike, m: int, hop: float) -> np.ndarray:
    """A lower bound on ``pipeline_time`` (vpp=1); exact for equal stages without hop (and
    with hop when m - 1 is a multiple of the depth). ``fwd``/``bwd`` hold stage times on
    their last axis, so many layer splits can be bounded at once: the largest of the
    stages' ``stage_bounds`` and of every window's ``window_bounds``."""
    f, b = np.asarray(fwd, dtype=float), np.asarray(bwd, dtype=float)
    d = f.shape[-1]
    c = f + b
    cum = np.concatenate([np.zeros_like(c[..., :1]), np.cumsum(c, -1)], -1)
    before = cum[..., :-1]
    after = cum[..., -1:] - cum[..., 1:]
    bound = stage_bounds(f, b, np.arange(d), d, m, hop, before, after).max(-1)
    for first in range(d):
        for last in range(first + 1, d):
            window = cum[..., last + 1] - cum[..., first]
            bound = np.maximum(bound, window_bounds(before[..., first], c[..., first], window,
                                                    after[..., last], first, last, d, m, hop))
    return bound


def stage_bounds(f: np.ndarray, b: np.ndarray, stage: np.ndarray, depth: int, m: int,
                 hop: float, before: np.ndarray, after: np.ndarray) -> np.ndarray:
    """Each stage's bound on its pipeline's step (elementwise): the step lasts at least
    this long whatever the other stages hold, given ``before``/``after``, the compute of one
    microbatch on the stages before and after it (a lower bound of them keeps it a bound).

    Stage s runs 1F1B with w = min(d-s-1, m) warm-up forwards, so right after its backward
    of microbatch j it runs the forward of j+w+1, whose backward returns only after a round
    trip through stages s..d-1: C_s = sum_{s'>=s}(f+b) + 2(d-1-s) hop. Chaining these from
    microbatch 0 (which arrives after A_s = sum_{s'<s} f + s hop), then the stage's
    remaining work, then draining the last backward through the stages before it
    (Z_s = sum_{s'<s} b + s hop), bounds the step; so does the stage's busy time m(f+b);
    so does its first round trip (microbatch 0's forward through the later stages and
    back) followed by every backward and the forwards it could not run while waiting; and
    so does ``window_bounds`` of the stage alone.
    """
    w = np.minimum(depth - stage - 1, m)
    q = (m - 1) // (w + 1)
    back = m - 1 - q * (w + 1)
    fwd_left = np.maximum(0, back - w)
    c = f + b
    trip = after + 2 * (depth - 1 - stage) * hop
    chained = (q + 1) * (c + trip) + back * b + fwd_left * f
    first_trip = trip + (m - np.minimum(w, m - 1)) * f + m * b
    alone = window_bounds(before, c, c, after, stage, stage, depth, m, hop)
    return np.maximum(before + 2 * stage * hop + np.maximum(np.maximum(chained, m * c),
                                                            first_trip), alone)


def window_bounds(before: np.ndarray, c: np.ndarray, window: np.ndarray, after: np.ndarray,
                  first: ArrayLike, last: ArrayLike, depth: int, m: int,
                  hop: float) -> np.ndarray:
    """The bound that a window of stages ``first..last`` (k of them) sets (elementwise;
    -inf where it does not apply): ``c`` is the compute of one microbatch on stage
    ``first``, ``window`` on the whole window, ``before``/``after`` on the stages before
    and after it (lower bounds of them keep it a bound).

    After its backward of microbatch j, stage ``first`` (w warm-up forwards) runs the
    forward of j+w+1, which stage ``last`` runs right before its backward of j+k; that
    backward returns to stage ``first`` as its backward of j+k: a chain of the window's
    compute and 2(k-1) hops per k microbatches (k=1: the stage's own forward and backward).
    The step holds microbatch 0's round trip from stage ``first`` to the last stage and
    back, the chain from its backward of 0 to that of m-2-w, the last forward's round trip,
    and the drains into and out of the stages before."""
    first, last = np.asarray(first), np.asarray(last)
    w = np.minimum(depth - first - 1, m)
    steps = m - 2 - w
    k = last - first + 1
    q, r = np.divmod(np.maximum(steps, 0), k)
    trip = window + after + 2 * (depth - 1 - first) * hop
    bound = before + 2 * first * hop + 2 * trip + q * (window + 2 * (k - 1) * hop) + r * c
    return np.where(steps >= 0, bound, -np.inf)
