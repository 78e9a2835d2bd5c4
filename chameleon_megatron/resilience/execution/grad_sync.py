"""Gradient synchronisation of a plan, and the global gradient norm.

In a plan with pipelines of different depths (or with dead ranks) a layer's copies sit on
different stages of different pipelines, so no single data-parallel group exists. Each state
unit's gradients are all-reduced among exactly the live ranks that hold it, using the
restorer's groups and its DSATUR rounds (no rank in two groups of one round, so the groups of
a round run concurrently and every rank meets its groups in the same order). The tied
embedding's copies (first and last stages) are summed in one more group. Then every
gradient is divided once by the global token count: the loss of a step is the sum of
per-token losses over the whole batch divided once, whichever rank computed each sample.

With ``overlap`` (``--overlap-grad-reduce``), a group's all-reduce starts during the step's
last backward pass, as soon as every one of its parameters has its final gradient (a hook
after megatron DDP's accumulation into the main gradient), instead of after the backward.
Every rank starts its groups in one global order (later layers first, the order backward
finishes them), whatever its own order of readiness, so that no two ranks wait on each
other's groups (NCCL runs a rank's collectives one after another); the token count and the
tied copies follow all of them. The sums are those of the synchronous sync, bit for bit.

The gradient norm for clipping is computed so that every rank gets the same bits: each
unit's squared norm comes from one owner, the vector is summed over the world (one non-zero
term per entry, so exact) and reduced in the same order everywhere.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from chameleon_megatron.resilience.decision.layout import EMBEDDING, OUTPUT, Plan, StateUnit
from chameleon_megatron.resilience.decision.restorer import AllReduceGroup, unit_order
from chameleon_megatron.resilience.model_state import unit_parameters

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SyncSpec:
    """Which live ranks all-reduce what, in which round (plan rank ids). At tp > 1 every
    unit is a shard per TP index, synced among the holders of that index."""

    rounds: tuple[tuple[AllReduceGroup, ...], ...]
    """The restorer's rounds with dead ranks removed; groups left with one rank dropped."""
    tied: tuple[tuple[int, ...], ...]
    """Per TP index, the live ranks holding a copy of the tied embedding (first and last
    stages), if >= 2."""
    owners: Mapping[tuple[StateUnit, int], int]
    """The live rank whose copy of each (unit, TP index) counts in the gradient norm."""


def sync_spec(plan: Plan, groups: Sequence[AllReduceGroup], rounds: Sequence[Sequence[int]], *,
              dead: frozenset[int] = frozenset(), tied: bool) -> SyncSpec:
    """Check the restorer's groups and rounds against ``plan`` and drop the dead ranks.

    Raises ValueError if a rank is in two groups of one round, or if the live holders of some
    unit are not exactly the members of one group (their copies would drift apart)."""
    holders: dict[tuple[StateUnit, int], set[int]] = {}
    index_of: dict[int, int] = {}
    for rank, (i, units) in plan.holdings().items():
        index_of[rank] = i
        if rank not in dead:
            for u in units:
                holders.setdefault((u, i), set()).add(rank)
    live_rounds = []
    covered: dict[tuple[StateUnit, int], int] = {}
    for k, rnd in enumerate(rounds):
        seen: set[int] = set()
        kept = []
        for index in rnd:
            g = groups[index]
            if seen & set(g.ranks):
                raise ValueError(f"round {k}: ranks {sorted(seen & set(g.ranks))} are in two "
                                 "of its groups")
            seen |= set(g.ranks)
            members = tuple(r for r in g.ranks if r not in dead)
            for u in g.layers:
                key = (u, index_of[g.ranks[0]])
                if set(members) != holders.get(key, set()):
                    raise ValueError(f"group {index}: unit {u!r} is held by live ranks "
                                     f"{sorted(holders.get(key, ()))}, the group has {members}")
                covered[key] = covered.get(key, 0) + 1
            if len(members) > 1:
                kept.append(AllReduceGroup(ranks=members, layers=g.layers, bytes=g.bytes))
        live_rounds.append(tuple(kept))
    for (u, _), ranks in holders.items():
        if len(ranks) > 1 and covered.get((u, _)) != 1:
            raise ValueError(f"unit {u!r} is held by live ranks {sorted(ranks)} but is in "
                             f"{covered.get((u, _), 0)} all-reduce groups, not one")
    copies = [sorted(holders.get((EMBEDDING, i), set()) | holders.get((OUTPUT, i), set()))
              for i in range(plan.tp)]
    return SyncSpec(
        rounds=tuple(r for r in live_rounds if r),
        tied=tuple(tuple(c) for c in copies if len(c) > 1) if tied else (),
        owners={key: min(ranks) for key, ranks in holders.items()},
    )


def tied_weight(model: torch.nn.Module) -> torch.nn.Parameter | None:
    """The stage's copy of the tied embedding (first or last stage), if it has one: its
    gradient is summed over every copy apart from its unit's (``SyncSpec.tied``)."""
    if getattr(model, "share_embeddings_and_output_weights", False) and \
            (model.pre_process or model.post_process):
        return model.shared_embedding_or_output_weight()
    return None


def unit_params(units: Mapping[StateUnit, Mapping[str, torch.nn.Parameter]],
                wanted: Sequence[StateUnit],
                tied: torch.nn.Parameter | None) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters of the ``wanted`` units, named ``<unit>.<name within it>``, in one
    order on every holder; the tied copy goes apart."""
    return [(f"{u}.{name}", p) for u in sorted(wanted, key=unit_order)
            for name, p in sorted(units.get(u, {}).items()) if p is not tied]


def _position(unit: StateUnit) -> float:
    """Where a unit runs in the forward pass (the backward pass finishes them in reverse)."""
    return -1 if unit == EMBEDDING else math.inf if unit == OUTPUT else unit


def _launch(params: list[torch.nn.Parameter], group: dist.ProcessGroup) -> tuple:
    """Start summing the parameters' main gradients over ``group``: (work, flat, grads)."""
    grads = [p.main_grad for p in params]  # zeros on a holder that saw no microbatch
    flat = _flatten_dense_tensors(grads)
    return dist.all_reduce(flat, group=group, async_op=True), flat, grads


def _finish(flight: tuple) -> None:
    """Wait for a ``_launch`` and write the sums back."""
    work, flat, grads = flight
    work.wait()
    for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)


def reduction_device() -> torch.device:
    """Where small global sums live: NCCL reduces device tensors only."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class GradSync:
    """One rank's part of the sync; callable as megatron's ``finalize_model_grads_func``.
    It works on the main gradients of megatron's DDP buffers (``param.main_grad``: fp32,
    accumulated over the microbatches), as megatron's own ``finalize_model_grads`` does.

    ``rounds``: per round, this rank's group and its handle, or None; ``tied``: the handle
    of the tied-embedding group, if this rank holds a copy; ``tp``: the stage's TP group,
    over which the gradients of parameters marked ``sequence_parallel`` (norms and router
    under sequence parallelism: each TP rank saw its part of the sequence) are summed, as
    megatron's ``finalize_model_grads`` sums them. Global reductions use the
    default group, which must be the plan's live ranks. ``overlap``: start each group's
    all-reduce during the last backward pass (the schedule runs the other microbatches'
    backward passes under ``no_sync``; call ``reset`` before each step).
    """

    def __init__(self, model: torch.nn.Module, spec: SyncSpec, me: int,
                 rounds: Sequence[tuple[AllReduceGroup, dist.ProcessGroup] | None],
                 tied: dist.ProcessGroup | None, tp_index: int = 0,
                 overlap: bool = False, tp: dist.ProcessGroup | None = None) -> None:
        self.model, self.spec, self.me, self.tp_index = model, spec, me, tp_index
        self._tied_group = tied
        partial = [p for p in model.parameters() if getattr(p, "sequence_parallel", False)]
        self._sequence_parallel = (partial, tp) if partial and tp is not None else None
        """Parameters whose gradients are partial over the TP group, and that group."""
        self._units = unit_parameters([model])
        self._tied = tied_weight(model)
        mine = [(k, g, h) for k, m in enumerate(rounds) if m is not None for g, h in [m]]
        self._order = sorted(mine, key=lambda x: (-max(map(_position, x[1].layers)), x[0]))
        """This rank's groups as (round, group, handle), in the order all ranks start them."""
        self._launched: list[tuple[int, tuple[int, ...], tuple]] = []
        """(round, plan ranks, ``_launch``'s flight) of each group started this step."""
        self._waiting: list[set[torch.nn.Parameter]] = []
        self._final = True
        """Whether the backward pass running now is the step's last (see ``no_sync``)."""
        self._hooks = self._hook_accumulation() if overlap else []
        self._norm_layout: _NormLayout | None = None
        self.reset()
        self.performed: list[tuple[int, tuple[int, ...]]] = []
        """(round, plan ranks of the group) of each all-reduce of the last call."""
        self.early = 0
        """How many of them started during the backward pass (``overlap``)."""

    def reset(self) -> None:
        """Before a step: no all-reduce started, every parameter waits for its gradient."""
        self._launched = []
        self._waiting = [{p for p in self._params_of(g.layers) if p.requires_grad}
                         for _, g, _ in self._order]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes whose gradients are not yet the step's (megatron's schedules
        enter this for every microbatch but the last, as ``config.no_sync_func``)."""
        self._final = False
        try:
            yield
        finally:
            self._final = True

    def _hook_accumulation(self) -> list[Any]:
        """A hook after DDP's on each parameter's gradient accumulator (hooks run in the
        order they were added: DDP's has added the gradient to ``main_grad``)."""
        hooks = []
        for k, (_, group, _) in enumerate(self._order):
            for p in filter(lambda p: p.requires_grad, self._params_of(group.layers)):
                accumulator = p.expand_as(p).grad_fn.next_functions[0][0]
                hooks.append((accumulator,  # kept alive, or the hook goes with it
                              accumulator.register_hook(self._ready_hook(k, p))))
        return hooks

    def _ready_hook(self, k: int, param: torch.nn.Parameter) -> Any:
        def hook(*_: Any) -> None:
            if self._final:
                self._waiting[k].discard(param)
                while len(self._launched) < len(self._order) and \
                        not self._waiting[len(self._launched)]:
                    self._launch_next()
        return hook

    def _launch_next(self) -> None:
        """Start the next group's all-reduce in the global order."""
        rnd, group, handle = self._order[len(self._launched)]
        self._launched.append((rnd, group.ranks, _launch(self._params_of(group.layers), handle)))

    def __call__(self, model_chunks: list[torch.nn.Module], num_tokens: torch.Tensor | None,
                 **_: Any) -> None:
        """Sum each unit's gradients over its holders, then divide by the global tokens."""
        if num_tokens is None:
            raise ValueError("plans need calculate_per_token_loss=True (got no token count)")
        self.early = len(self._launched)
        while len(self._launched) < len(self._order):
            self._launch_next()
            if not self._hooks:  # one at a time: one flat copy alive
                _finish(self._launched[-1][2])
        for *_, flight in self._launched if self._hooks else ():
            _finish(flight)
        self.performed = sorted((rnd, ranks) for rnd, ranks, *_ in self._launched)
        self.reset()
        tokens = num_tokens.detach().to(reduction_device(), torch.float64).reshape(1)
        if self.tp_index:  # every rank of a TP group saw the same tokens: count them once
            tokens.zero_()
        dist.all_reduce(tokens)
        if self._tied_group is not None:
            _finish(_launch([self._tied], self._tied_group))
        if self._sequence_parallel is not None:
            _finish(_launch(*self._sequence_parallel))
        # on the device, no host read: fp32(1 / tokens) times each (fp32) main gradient, the
        # bits a host float gave; one dtype, so CUDA's fused path takes it
        torch._foreach_mul_([p.main_grad for p in self.model.parameters()],
                            tokens.reciprocal().to(torch.float32).squeeze())
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug({"event": "grad_sync", "rank": self.me, "tokens": tokens.item(),
                          "rounds": self.performed, "tied": self._tied_group is not None})

    def _params_of(self, units: Sequence[StateUnit]) -> list[torch.nn.Parameter]:
        return [p for _, p in unit_params(self._units, units, self._tied)]

    def grad_norm(self) -> float:
        """L2 norm of the global gradient: each unit's shard at each TP index once (a
        parameter replicated over the TP group, not sharded, counts at index 0 only), the
        tied weight once. One fused norm over this rank's counted gradients (fp64 sums, on
        the device), one all-reduce, one host read."""
        layout = self._norm_layout or self._lay_out_norm()
        squares = torch.zeros(layout.entries, dtype=torch.float64, device=reduction_device())
        if layout.params:
            grads = [p.main_grad for p in layout.params]
            per = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float64)).square()
            # a row per unit, summed: no atomics, so the same bits every run
            table = per.new_zeros(layout.entries, layout.width)
            table[layout.rows, layout.cols] = per
            squares = table.sum(dim=1)
        dist.all_reduce(squares)
        return math.sqrt(float(squares.sum()))

    def _lay_out_norm(self) -> "_NormLayout":
        """Which gradients this rank counts, and where (fixed for the sync's life)."""
        order = sorted(self.spec.owners, key=lambda key: (unit_order(key[0]), key[1]))
        rows: list[int] = []
        cols: list[int] = []
        counted: list[torch.nn.Parameter] = []
        for k, (u, i) in enumerate(order):
            if self.spec.owners[(u, i)] != self.me:
                continue
            params = self._params_of([u])
            if u == EMBEDDING and self._tied is not None and self.model.pre_process:
                params.append(self._tied)
            mine = [p for p in params if i == 0 or getattr(p, "tensor_model_parallel", False)]
            rows += [k] * len(mine)
            cols += range(len(mine))
            counted += mine
        device = reduction_device()
        self._norm_layout = _NormLayout(
            entries=len(order), params=counted, width=max(cols, default=0) + 1,
            rows=torch.tensor(rows, dtype=torch.long, device=device),
            cols=torch.tensor(cols, dtype=torch.long, device=device))
        return self._norm_layout


@dataclass(frozen=True)
class _NormLayout:
    """The gradients a rank counts in the norm: parameter n's squared norm goes to entry
    ``rows[n]`` of the vector summed over the world (``entries`` long), at ``cols[n]``."""

    entries: int
    params: list[torch.nn.Parameter]
    width: int
    rows: torch.Tensor
    cols: torch.Tensor
