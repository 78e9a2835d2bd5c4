"""In-memory recovery of the configurations users run, under chameleon-run (CPU, gloo),
against the failure-free run of one process: --bf16, MoE and SGD jobs.

4 ranks, DP2 x PP2, rank 0 dies in backward at step 3. The survivors re-plan, move weights
(bf16: with their fp32 master copies) and optimizer state from the surviving replicas, and
redo step 3: every step once, every loss within tolerance of the reference, and the final
state as in the reference. A bf16 job and an MoE job recover as the decision center
chooses under the profile that favours data parallelism, and run through the plan runtime
when forced to reroute or to re-plan under the one that favours depth (MoE with the
load-balancing loss, ``--moe-aux-loss-coeff 0.01``: dropping it in the plan puts step 8
2.4e-4 off); so does an SGD job (momentum 0.9).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from e2e_support import (  # noqa: E402
    FT, ITERS, assert_every_copy_matches, assert_losses_match, assert_same_state, combine,
    faults, launch, run_reference, write_profile,
)

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(480), pytest.mark.serial]

BF16_RTOL = 1e-3
"""Loss tolerance against the one-process bf16 run (a layout rounds bf16 partial sums
elsewhere; ``tests/training/test_bf16.py`` measured at most 9e-5 between layouts)."""
STATE_RTOL = 0.1
"""Tolerance on the final state's sums of squares. bf16 trajectories drift apart: the
failure-free DP2 x PP2 job ends up to 3.6 % (weights) and 0.6 % (Adam moments) from the
one-process run, this job up to 5 % and 1 % (measured). A state that was not moved shows
in the losses of the redone step and in the Adam step count, which must be exact."""


def recover(tmp_path: Path, flags: tuple[str, ...], rtol: float,
            ft: tuple[str, ...] = (), favour: str = "dp") -> tuple[dict, dict, dict]:
    """The reference with ``flags``, then the 4-rank job with them and one failure; checks
    the losses. Returns (recovery record, reference dump, the job's dumps)."""
    (tmp_path / "reference").mkdir()
    ref_losses, ref_dump = run_reference(tmp_path / "reference", flags=flags)
    job = tmp_path / "job"
    job.mkdir()
    profile = write_profile(job / "profile.json", favour=favour, tp=1)
    recs, dumps, log = launch(job, 4, [
        *flags, "--pipeline-model-parallel-size", "2", *FT,
        "--chameleon-ft-startup-timeout-s", "120", "--chameleon-ft-profile", str(profile),
        *ft, *faults("rank=0,iteration=3,phase=backward,kind=exit")], timeout_s=300)
    assert assert_losses_match(recs, ref_losses, rtol=rtol) == list(range(1, ITERS + 1)), \
        log[-4000:]
    (done,) = [r for r in recs if r["event"] == "recovery"]
    assert (done["failed_ranks"], done["redo_iteration"], done["fallback"]) == ([0], 3, None)
    return done, ref_dump, dumps


def test_an_moe_job_recovers_in_memory(tmp_path: Path) -> None:
    done, ref_dump, dumps = recover(tmp_path, ("--num-experts", "4", "--disable-bias-linear"),
                                    rtol=1e-4)
    assert done["decision"]["mode"] == "megatron" and done["migrated_bytes"] > 0
    assert_same_state(combine([ref_dump]), combine(list(dumps.values())))


def test_a_bf16_job_recovers_in_memory(tmp_path: Path) -> None:
    done, ref_dump, dumps = recover(tmp_path, ("--bf16",), rtol=BF16_RTOL)
    decision = done["decision"]
    assert decision["executed"] == decision["choice"] and done["migrated_bytes"] > 0
    assert_same_state(combine([ref_dump]), combine(list(dumps.values())), rtol=STATE_RTOL)


@pytest.mark.parametrize("strategy,mode", [("reroute", "reroute"), ("replan", "hetero")])
def test_a_bf16_job_recovers_through_the_plan_runtime(tmp_path: Path, strategy: str,
                                                      mode: str) -> None:
    """The plan's stages train as the trainer's do: bf16 parameters in ``Float16Module``,
    fp32 main gradients in megatron's DDP buffers, megatron's optimizer with fp32 main
    parameters (moved with the weights)."""
    done, ref_dump, dumps = recover(tmp_path, ("--bf16",), rtol=BF16_RTOL,
                                    ft=("--chameleon-ft-strategy", strategy), favour="pp")
    assert done["decision"]["executed"] == strategy and done["layout_after"]["mode"] == mode, \
        done["layout_after"]
    assert_every_copy_matches(ref_dump, dumps, rtol=STATE_RTOL)


@pytest.mark.parametrize("strategy,mode", [("reroute", "reroute"), ("replan", "hetero")])
def test_an_sgd_job_recovers_through_the_plan_runtime(tmp_path: Path, strategy: str,
                                                      mode: str) -> None:
    done, ref_dump, dumps = recover(tmp_path, ("--optimizer", "sgd"), rtol=1e-4,
                                    ft=("--chameleon-ft-strategy", strategy), favour="pp")
    assert done["decision"]["executed"] == strategy and done["layout_after"]["mode"] == mode, \
        done["layout_after"]
    assert_every_copy_matches(ref_dump, dumps)


@pytest.mark.parametrize("strategy,mode", [("reroute", "reroute"), ("replan", "hetero")])
def test_an_moe_job_recovers_through_the_plan_runtime(tmp_path: Path, strategy: str,
                                                      mode: str) -> None:
    done, ref_dump, dumps = recover(tmp_path, ("--num-experts", "4", "--disable-bias-linear",
                                               "--moe-aux-loss-coeff", "0.01"),
                                    rtol=1e-4, ft=("--chameleon-ft-strategy", strategy),
                                    favour="pp")
    assert done["decision"]["executed"] == strategy and done["layout_after"]["mode"] == mode, \
        done["layout_after"]
    assert_every_copy_matches(ref_dump, dumps)
