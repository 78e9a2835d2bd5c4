"""A heterogeneous plan trains exactly what the failure-free run trains.

Five ranks, five layers: pipeline 0 has depth 4 with a split whose middle stages differ
(layer 0 | layers 1-2 | layer 3 | layer 4, which no first/middle/last form expresses) and 5
microbatches; pipelines 1 and 2 have depth 1 with 3 and 2 microbatches. After two steps the
losses, the gradient norms, the (clipped) gradients of step 1 and the parameters match the
trainer in one process over the same global batch of 10 microbatches. Unequal shares make
an average of per-pipeline averages differ from the sample-weighted loss, so that error, a
wrong token count, a missed or doubled all-reduce (or tied-embedding sum) would all show.

Run as a script, this file is the worker program of the test.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hetero_support import (  # noqa: E402
    TOL, Scenario, assert_same_state, launch, plan_worker,
)

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(180)]

def make_plan():
    from chameleon_megatron.resilience.decision.layout import Pipeline, Plan, Stage

    return Plan(num_layers=5, pipelines=(
        Pipeline(stages=(Stage((0,), (0,)), Stage((1, 2), (1,)), Stage((3,), (2,)),
                         Stage((4,), (3,))), microbatches=5),
        Pipeline(stages=(Stage(tuple(range(5)), (4,)),), microbatches=3),
        Pipeline(stages=(Stage(tuple(range(5)), (5,)),), microbatches=2),
    ))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One job: the reference, the plan, the plan with the overlapped reduce, the plan with
    the distributed optimizer."""
    out = tmp_path_factory.mktemp("hetero")
    launch(__file__, 6, out, timeout_s=170)
    return out


def test_unequal_shares_match_the_failure_free_run(runs: Path) -> None:
    import torch

    from chameleon_megatron.resilience.decision.restorer import allreduce_groups, allreduce_rounds
    from dc_helpers import make_profile

    want = torch.load(runs / "reference.pt")
    ranks = {r: torch.load(runs / "hetero" / f"rank{r}.pt") for r in range(6)}
    for r, got in ranks.items():
        for w, g in zip(want["loss"], got["loss"]):
            assert abs(g - w) <= TOL * abs(w), (r, want["loss"], got["loss"])
        for w, g in zip(want["grad_norm"], got["grad_norm"]):
            assert abs(g - w) <= TOL * w, (r, want["grad_norm"], got["grad_norm"])
        assert_same_state(got, want, f"rank {r}")
    assert want["loss"][1] < want["loss"][0]  # the reference did learn: the check has teeth
    # Every unit of the model was checked on some rank.
    assert set().union(*(g["params"] for g in ranks.values())) == set(want["params"])
    # Each rank all-reduced exactly its groups of the restorer's DSATUR rounds, in order.
    plan, profile = make_plan(), make_profile(5, gbs=10)
    groups, rounds = allreduce_groups(plan, profile), allreduce_rounds(plan, profile)
    assert len(rounds) == 4  # every group holds ranks 4 and 5: one group per round
    for r, got in ranks.items():
        expected = [(k, groups[i].ranks) for k, rnd in enumerate(rounds) for i in rnd
                    if r in groups[i].ranks]
        assert got["rounds"] == [expected] * 2, (r, got["rounds"], expected)


def test_an_overlapped_reduce_computes_the_same_bits(runs: Path) -> None:
    """--overlap-grad-reduce: each group's all-reduce starts in the last backward pass, as
    soon as its gradients are final (on every rank, some before the backward ends); the sums
    are the same as after the backward, bit for bit."""
    import torch

    for r in range(6):
        sync, overlap = (torch.load(runs / name / f"rank{r}.pt")
                         for name in ("hetero", "overlap"))
        assert sync["early"] == [0, 0] and all(n >= 1 for n in overlap["early"]), (
            r, overlap["early"])
        assert overlap["loss"] == sync["loss"] and overlap["grad_norm"] == sync["grad_norm"]
        assert overlap["rounds"] == sync["rounds"], r
        for what in ("grads", "params"):
            for unit, tensors in sync[what].items():
                for name, want in tensors.items():
                    assert torch.equal(overlap[what][unit][name], want), (r, what, unit, name)


def test_the_distributed_optimizer_shards_each_part_over_its_holders(runs: Path) -> None:
    """--use-distributed-optimizer: every part of a stage is sharded over the ranks holding
    it (ranks 4 and 5 hold every layer, so each keeps about half of its state); the losses,
    gradient norms and parameters are those of the plan without it, bit for bit, and each
    piece's Adam state is the matching slice of the whole state there."""
    import torch

    for r in range(6):
        whole, sharded = (torch.load(runs / name / f"rank{r}.pt")
                          for name in ("hetero", "distopt"))
        assert sharded["loss"] == whole["loss"] and sharded["grad_norm"] == whole["grad_norm"]
        for unit, tensors in whole["params"].items():  # (the clipped gradients are shards)
            for name, want in tensors.items():
                assert torch.equal(sharded["params"][unit][name], want), (r, unit, name)
        kept = 0
        for (unit, name, start, end, numel), piece in sharded["adam"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                want = whole["adam"][unit][f"{name}/{key}"].reshape(-1)[start:end]
                assert torch.equal(piece[key], want), (r, unit, name, key)
            assert piece["step"] == whole["adam"][unit][f"{name}/step"]
            kept += end - start
        held = sum(t.numel() for ts in whole["params"].values() for t in ts.values())
        if r in (4, 5):  # every layer is held by both: about half each
            assert 0.3 * held < kept < 0.7 * held, (r, kept, held)


def scenarios() -> list[Scenario]:
    from chameleon_megatron.resilience.execution.runtime import run_hetero_step

    return [Scenario("hetero", make_plan(), run_hetero_step),
            Scenario("overlap", make_plan(), run_hetero_step, overlap=True),
            Scenario("distopt", make_plan(), run_hetero_step, distributed=True)]


if __name__ == "__main__":
    sys.exit(plan_worker(Path(sys.argv[1]), scenarios))
