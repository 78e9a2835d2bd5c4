"""Frozen execution plans: which ranks compute which layers of how many microbatches.

A ``Plan`` is a list of data-parallel pipelines, possibly of different depths; each stage
is one tensor-parallel group (``ranks``, one per TP index) holding a set of transformer
layers. The first stage of a pipeline also holds the embedding, the last one the output
layer. A uniform Megatron layout (TP x PP x DP, VPP) is one special case and is built by
``UniformLayout.to_plan`` in megatron-core's default rank order "tp-cp-ep-dp-pp".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

EMBEDDING = "embedding"
OUTPUT = "output"
StateUnit = int | str
"""A piece of model state that moves as one: a transformer layer index, EMBEDDING or OUTPUT."""


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: a TP group and the transformer layers it holds."""

    layers: tuple[int, ...]
    """Global layer indices, ascending (interleaved chunks when the plan has vpp > 1)."""
    ranks: tuple[int, ...]
    """Global rank of each TP index."""


@dataclass(frozen=True)
class Pipeline:
    """One data-parallel replica of the model, split into stages."""

    stages: tuple[Stage, ...]
    microbatches: int
    """This pipeline's share of the global batch, in microbatches."""

    @property
    def depth(self) -> int:
        return len(self.stages)

    def stage_units(self, s: int) -> tuple[StateUnit, ...]:
        """State held by stage ``s``: its layers, plus embedding/output on the end stages."""
        extra: list[StateUnit] = []
        if s == 0:
            extra.append(EMBEDDING)
        if s == self.depth - 1:
            extra.append(OUTPUT)
        return (*self.stages[s].layers, *extra)


@dataclass(frozen=True)
class Plan:
    """Data-parallel pipelines over TP groups; validated on construction."""

    num_layers: int
    pipelines: tuple[Pipeline, ...]
    vpp: int = 1
    """Virtual pipeline stages per rank (interleaved 1F1B); only for uniform plans."""

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def tp(self) -> int:
        return len(self.pipelines[0].stages[0].ranks)

    @property
    def depths(self) -> tuple[int, ...]:
        return tuple(p.depth for p in self.pipelines)

    @property
    def microbatches(self) -> int:
        """Global batch in microbatches (sum over pipelines)."""
        return sum(p.microbatches for p in self.pipelines)

    @property
    def is_uniform(self) -> bool:
        """Same depth, layer split and microbatches in every pipeline (Megatron-native)."""
        first = self.pipelines[0]
        return all(
            p.microbatches == first.microbatches
            and [s.layers for s in p.stages] == [s.layers for s in first.stages]
            for p in self.pipelines
        )

    def slots(self) -> Iterator[tuple[int, int, int, int]]:
        """(pipeline, stage, tp_index, rank) for every rank of the plan."""
        for j, pipe in enumerate(self.pipelines):
            for s, stage in enumerate(pipe.stages):
                for i, rank in enumerate(stage.ranks):
                    yield j, s, i, rank

    def ranks(self) -> tuple[int, ...]:
        return tuple(rank for *_, rank in self.slots())

    def holdings(self) -> dict[int, tuple[int, tuple[StateUnit, ...]]]:
        """rank -> (tp_index, state units whose shard at that TP index the rank holds)."""
        return {
            rank: (i, self.pipelines[j].stage_units(s)) for j, s, i, rank in self.slots()
        }

    def describe(self) -> str:
        """Compact text, e.g. '3x(d8,m16) + 1x(d7,m14), tp1'."""
        groups: dict[tuple[int, int], int] = {}
        for p in self.pipelines:
            groups[(p.depth, p.microbatches)] = groups.get((p.depth, p.microbatches), 0) + 1
        body = " + ".join(f"{n}x(d{d},m{m})" for (d, m), n in groups.items())
        return f"{body}, tp{self.tp}" + (f", vpp{self.vpp}" if self.vpp > 1 else "")

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_layers": self.num_layers,
            "vpp": self.vpp,
            "pipelines": [
                {
                    "microbatches": p.microbatches,
                    "stages": [{"layers": list(s.layers), "ranks": list(s.ranks)}
                               for s in p.stages],
                }
                for p in self.pipelines
            ],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Plan":
        pipes = tuple(
            Pipeline(
                stages=tuple(
                    Stage(layers=tuple(int(x) for x in s["layers"]),
                          ranks=tuple(int(r) for r in s["ranks"]))
                    for s in p["stages"]
                ),
                microbatches=int(p["microbatches"]),
            )
            for p in data["pipelines"]
        )
        return cls(num_layers=int(data["num_layers"]), pipelines=pipes, vpp=int(data.get("vpp", 1)))


def _validate(plan: Plan) -> None:
    if plan.num_layers < 1:
        raise ValueError(f"num_layers={plan.num_layers}: must be >= 1")
    if not plan.pipelines:
        raise ValueError("a plan needs at least one pipeline")
    if plan.vpp < 1:
        raise ValueError(f"vpp={plan.vpp}: must be >= 1")
    tp = len(plan.pipelines[0].stages[0].ranks) if plan.pipelines[0].stages else 0
    if tp < 1:
        raise ValueError("every stage needs at least one rank")
    seen: set[int] = set()
    for j, pipe in enumerate(plan.pipelines):
        if pipe.microbatches < 1:
            raise ValueError(f"pipeline {j}: microbatches={pipe.microbatches}: must be >= 1")
        if not pipe.stages:
            raise ValueError(f"pipeline {j} has no stage")
        for s, stage in enumerate(pipe.stages):
            if len(stage.ranks) != tp:
                raise ValueError(
                    f"pipeline {j} stage {s}: {len(stage.ranks)} ranks, expected tp={tp}")
            for r in stage.ranks:
                if r < 0 or r in seen:
                    raise ValueError(f"rank {r} is negative or appears in two slots")
                seen.add(r)
        _validate_layers(plan, j, pipe)


def _validate_layers(plan: Plan, j: int, pipe: Pipeline) -> None:
    if plan.vpp == 1:
        flat = [layer for stage in pipe.stages for layer in stage.layers]
        if flat != list(range(plan.num_layers)) or any(not st.layers for st in pipe.stages):
            raise ValueError(
                f"pipeline {j}: stages must hold contiguous, non-empty layer ranges covering "
                f"0..{plan.num_layers - 1} in order"
            )
        return
    expected = interleaved_layers(plan.num_layers, pipe.depth, plan.vpp)
    if pipe.depth < 2 or [st.layers for st in pipe.stages] != list(expected):
        raise ValueError(
            f"pipeline {j}: with vpp={plan.vpp} the stages must hold megatron's interleaved "
            f"chunks of {plan.num_layers} layers over depth {pipe.depth} >= 2"
        )
    if pipe.microbatches % pipe.depth:
        raise ValueError(
            f"pipeline {j}: microbatches={pipe.microbatches} must be a multiple of depth "
            f"{pipe.depth} with vpp={plan.vpp}"
        )


def interleaved_layers(num_layers: int, pp: int, vpp: int) -> tuple[tuple[int, ...], ...]:
    """Layers of each pipeline rank with ``vpp`` model chunks: chunk c of rank s is
    virtual stage c*pp + s (megatron's interleaved assignment)."""
    if num_layers % (pp * vpp):
        raise ValueError(f"num_layers={num_layers} is not divisible by pp*vpp={pp * vpp}")
    per_chunk = num_layers // (pp * vpp)
    return tuple(
        tuple(
            layer
            for c in range(vpp)
            for layer in range((c * pp + s) * per_chunk, (c * pp + s + 1) * per_chunk)
        )
        for s in range(pp)
    )


def contiguous_layers(counts: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """Consecutive layer ranges of the given sizes."""
    out, start = [], 0
    for n in counts:
        out.append(tuple(range(start, start + n)))
        start += n
    return tuple(out)


def megatron_split(num_layers: int, depth: int, first: int | None = None,
                   last: int | None = None) -> tuple[int, ...]:
    """Layers per stage as megatron-core assigns them with
    ``num_layers_in_first/last_pipeline_stage``: the middle stages share the rest evenly."""
    counts = [0] * depth
    rest, middle = num_layers, depth
    if first is not None:
        counts[0], rest, middle = first, rest - first, middle - 1
    if last is not None and depth > 1:
        counts[-1], rest, middle = last, rest - last, middle - 1
    if middle:
        if rest % middle or rest <= 0:
            raise ValueError(
                f"{rest} layers left for {middle} middle stages: must divide evenly and be > 0"
            )
        lo = 1 if first is not None else 0
        for s in range(lo, lo + middle):
            counts[s] = rest // middle
    if sum(counts) != num_layers or min(counts) < 1:
        raise ValueError(f"split {counts} of {num_layers} layers: every stage needs >= 1 layer")
    return tuple(counts)


@dataclass(frozen=True)
class UniformLayout:
    """A Megatron layout: TP x PP x DP ranks (VPP chunks per rank), rank order tp-dp-pp."""

    tp: int
    pp: int
    dp: int
    vpp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "vpp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.vpp > 1 and self.pp < 2:
            raise ValueError(f"vpp={self.vpp} needs pp >= 2, got pp={self.pp}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def rank(self, tp_rank: int, dp_rank: int, pp_rank: int) -> int:
        """Global rank of a slot: tp fastest, then dp, then pp."""
        return tp_rank + self.tp * (dp_rank + self.dp * pp_rank)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(tp_rank, dp_rank, pp_rank) of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank}: must be in [0, {self.world_size})")
        return rank % self.tp, rank // self.tp % self.dp, rank // (self.tp * self.dp)

    def tp_groups(self) -> tuple[tuple[int, ...], ...]:
        """Every TP group (the unit a stage is made of), in rank order."""
        return tuple(tuple(range(g * self.tp, (g + 1) * self.tp))
                     for g in range(self.world_size // self.tp))

    def to_plan(self, num_layers: int, global_microbatches: int) -> Plan:
        """This layout as a Plan; each pipeline gets global_microbatches / dp microbatches."""
        if global_microbatches % self.dp:
            raise ValueError(
                f"global_microbatches={global_microbatches} is not divisible by dp={self.dp}"
            )
        if self.vpp > 1:
            layers = interleaved_layers(num_layers, self.pp, self.vpp)
        else:
            layers = contiguous_layers(megatron_split(num_layers, self.pp))
        pipes = tuple(
            Pipeline(
                stages=tuple(
                    Stage(layers=layers[s], ranks=tuple(self.rank(t, d, s) for t in range(self.tp)))
                    for s in range(self.pp)
                ),
                microbatches=global_microbatches // self.dp,
            )
            for d in range(self.dp)
        )
        return Plan(num_layers=num_layers, pipelines=pipes, vpp=self.vpp)
