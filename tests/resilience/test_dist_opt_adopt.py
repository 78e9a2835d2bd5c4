"""The distributed optimizer's sink adopts a local unit's old tensors as its staging (one
process, the trainer's model with --use-distributed-optimizer)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from chameleon_megatron.resilience.dist_opt import owned, sink_view

from one_process import SMALL_GPT, one_process_trainer

pytestmark = pytest.mark.timeout(120)

@pytest.fixture
def run():
    """The trainer's model and optimizer (--use-distributed-optimizer) in a world of one."""
    with one_process_trainer([*SMALL_GPT, "--train-iters", "8",
                              "--use-distributed-optimizer"]) as trainer:
        yield trainer


def test_a_shard_sink_stages_adopted_tensors_without_a_copy(run) -> None:
    """The distributed optimizer's sink reads a local unit's old whole tensors in place
    (no staging copy) and keeps its pieces of them at ``commit``; a misfit is staged anew."""
    sink = sink_view(run.model, run.optimizer)
    wanted = {n: t.shape for n, t in sink.tensors(0, "optimizer").items()}
    source = {n: torch.rand(shape) for n, shape in wanted.items()}
    sink = sink_view(run.model, run.optimizer)  # nothing staged yet
    sink.adopt(0, "optimizer", source)
    sink.adopt(1, "optimizer", {n: t[..., :1] if t.dim() else t for n, t in source.items()})
    staged = sink.tensors(0, "optimizer")
    assert all(staged[n] is source[n] for n in wanted)
    assert not any(t.any() for n, t in sink.tensors(1, "optimizer").items()
                   if not n.endswith("/step"))
    for t in sink.tensors(1, "optimizer").values():
        t.fill_(1.0)
    for u in ("embedding", "output"):
        for t in sink.tensors(u, "optimizer").values():
            t.fill_(1.0)
    sink.commit()
    for own in owned(run.model, run.optimizer):
        if own.piece.unit == 0:
            want = source[f"{own.piece.name}/exp_avg"].view(-1)[own.piece.start:own.piece.end]
            assert torch.equal(own.state["exp_avg"], want), own.piece


def test_a_settled_unit_is_kept_at_once_and_its_staging_let_go(run) -> None:
    """A migration settles each unit as it lands: the sink keeps this rank's pieces of it
    at once and drops the whole staged tensors (only the units in flight stay staged);
    ``commit`` then keeps the rest, as a sink committed in one go would."""
    sink = sink_view(run.model, run.optimizer)
    assert {n: tuple(t.shape) for n, t in sink.tensors(0, "optimizer").items()} == {
        n: tuple(shape) for n, (shape, _) in sink.specs(0, "optimizer").items()}
    staged = {n: t.fill_(3.0) for n, t in sink.tensors(0, "optimizer").items()}
    gone = [weakref.ref(t) for n, t in staged.items() if not n.endswith("/step")]
    del staged
    sink.settle(0, "optimizer")
    gc.collect()
    assert gone and all(r() is None for r in gone)
    unit0 = [own for own in owned(run.model, run.optimizer) if own.piece.unit == 0]
    assert unit0 and all(bool((own.state["exp_avg"] == 3.0).all()) for own in unit0)
    for u in (1, "embedding", "output"):
        for t in sink.tensors(u, "optimizer").values():
            t.fill_(5.0)
    sink.commit()
    for own in owned(run.model, run.optimizer):
        want = 3.0 if own.piece.unit == 0 else 5.0
        assert bool((own.state["exp_avg"] == want).all()), own.piece
