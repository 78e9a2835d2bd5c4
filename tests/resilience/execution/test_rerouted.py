"""Data rerouting trains exactly what the failure-free run trains.

The layout is DP2 x PP2 (pipeline 0 = ranks 0, 2; pipeline 1 = ranks 1, 3; 5 microbatches
each). The survivors keep their stages and run the dead stage's microbatches on its
same-stage peer:

* last stage dead: the four ranks train step 1 with the trainer (megatron DDP); then rank 3
  leaves, and the survivors switch to the plan runtime with their own state (the restorer's
  executor, copies in place) and scheduler, and train step 2 rerouted (rank 1 sends
  activations to rank 2 and gets gradients back);
* first stage dead (rank 1), from the start: rank 0 runs pipeline 1's first stage and talks
  to rank 3; the world renumbers the survivors 0, 2, 3 as 0, 1, 2.

After two steps the losses, gradient norms, gradients, parameters and Adam state match the
trainer in one process over the same 10 microbatches. With --overlap-grad-reduce (first
stage dead) every number is the same, bit for bit, as without; so it is with
--use-distributed-optimizer, whose shards of the last stage are split between its two
holders.

Run as a script, this file is the worker program of the test (both cases in turn, in the
same four processes).
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

DEAD = {"last_stage_dead": 3, "first_stage_dead": 1}
TRAINER_STEPS = {"last_stage_dead": 1, "first_stage_dead": 0}


def make_plan():
    from chameleon_megatron.resilience.decision.layout import UniformLayout

    return UniformLayout(tp=1, pp=2, dp=2).to_plan(4, 10)


def reroute_plan(dead: int):
    from chameleon_megatron.resilience.decision.reroute import plan_reroute
    from dc_helpers import make_profile

    return plan_reroute(make_plan(), [dead], make_profile(4, gbs=10))


def scenarios() -> list[Scenario]:
    from chameleon_megatron.resilience.execution.rerouted import run_reroute_step

    return [*(Scenario(name, make_plan(), run_reroute_step, reroute=reroute_plan(dead),
                       trainer_steps=TRAINER_STEPS[name]) for name, dead in DEAD.items()),
            Scenario("overlap", make_plan(), run_reroute_step, reroute=reroute_plan(1),
                     overlap=True),
            Scenario("distopt", make_plan(), run_reroute_step, reroute=reroute_plan(1),
                     distributed=True)]


def test_rerouted_microbatches_match_the_failure_free_run(tmp_path: Path) -> None:
    import torch

    launch(__file__, 4, tmp_path, timeout_s=170)
    want = torch.load(tmp_path / "reference.pt")
    assert want["loss"][1] < want["loss"][0]
    for name, dead in DEAD.items():
        peer = reroute_plan(dead).reroutes[0]
        assert (peer.pipeline, peer.targets) == (1, ((0, 5),))  # all 5 go to pipeline 0
        for r in sorted({0, 1, 2, 3} - {dead}):
            got = torch.load(tmp_path / name / f"rank{r}.pt")
            for key in ("loss", "grad_norm"):
                for w, g in zip(want[key], got[key]):
                    assert abs(g - w) <= TOL * abs(w), (name, r, key, want[key], got[key])
            assert_same_state(got, want, f"{name}, rank {r}")
            # the surviving stage of pipeline 1 and its peer sum its gradients; the peer's
            # own group lost its other member
            pair = (0, 1) if dead == 3 else (2, 3)
            rerouted_steps = 2 - TRAINER_STEPS[name]
            expected = [[(0, pair)] if r in pair else []] * rerouted_steps
            assert got["rounds"] == expected, (name, r, got["rounds"])
    # --overlap-grad-reduce: the group of ranks 2 and 3 starts in their last backward pass;
    # the same bits as the synchronous reduce
    for r in (0, 2, 3):
        sync, overlap = (torch.load(tmp_path / name / f"rank{r}.pt")
                         for name in ("first_stage_dead", "overlap"))
        assert (overlap["loss"], overlap["grad_norm"]) == (sync["loss"], sync["grad_norm"])
        assert overlap["early"] == ([1, 1] if r in (2, 3) else [0, 0]), (r, overlap["early"])
        for unit, tensors in sync["params"].items():
            for name, want_param in tensors.items():
                assert torch.equal(overlap["params"][unit][name], want_param), (r, unit, name)
    # --use-distributed-optimizer: ranks 2 and 3 (the last stage's holders) each keep half
    # of its optimizer state, rank 0 all of the first stage's; the same bits
    for r in (0, 2, 3):
        whole, sharded = (torch.load(tmp_path / name / f"rank{r}.pt")
                          for name in ("first_stage_dead", "distopt"))
        assert (sharded["loss"], sharded["grad_norm"]) == (whole["loss"], whole["grad_norm"])
        for unit, tensors in whole["params"].items():
            for name, want_param in tensors.items():
                assert torch.equal(sharded["params"][unit][name], want_param), (r, unit, name)
        kept = 0
        for (unit, name, start, end, _), piece in sharded["adam"].items():
            want_m = whole["adam"][unit][f"{name}/exp_avg_sq"].reshape(-1)[start:end]
            assert torch.equal(piece["exp_avg_sq"], want_m), (r, unit, name)
            kept += end - start
        held = sum(t.numel() for ts in whole["params"].values() for t in ts.values())
        assert (kept == held) if r == 0 else (0.3 * held < kept < 0.7 * held), (r, kept, held)


if __name__ == "__main__":
    sys.exit(plan_worker(Path(sys.argv[1]), scenarios))
