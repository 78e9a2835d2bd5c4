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
    deep_plans, faults, launch, run_reference, write_profile,
)

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(480), pytest.mark.serial]

MOE = ("--num-experts", "4", "--disable-bias-linear", "--moe-aux-loss-coeff", "0.01")
MOE_BIAS = ("--num-experts", "4", "--disable-bias-linear", "--moe-router-score-function",
            "sigmoid", "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.05")
BF16_RTOL = 1e-3
"""Loss tolerance against the one-process bf16 run (a layout rounds bf16 partial sums
elsewhere; ``tests/training/test_bf16.py`` measured at most 9e-5 between layouts)."""
STATE_RTOL = 0.1
"""Tolerance on the final state's sums of squares. bf16 trajectories drift apart: the
failure-free DP2 x PP2 job ends up to 3.6 % (weights) and 0.6 % (Adam moments) from the
one-process run, this job up to 5 % and 1 % (measured). A state that was not moved shows
in the losses of the redone step and in the Adam step count, which must be exact."""


def recover(tmp_path: Path, flags: tuple[str, ...], rtol: float,
            ft: tuple[str, ...] = (), favour: str = "dp",
            tp: int = 1, job_only: tuple[str, ...] = ()) -> tuple[dict, dict, dict]:
    """The reference with ``flags``, then the 4 x ``tp``-rank job with them (and
    ``job_only``) and one failure; checks the losses. Returns (recovery record, reference
    dump, the job's dumps)."""
    (tmp_path / "reference").mkdir()
    ref_losses, ref_dump = run_reference(tmp_path / "reference", flags=flags)
    job = tmp_path / "job"
    job.mkdir()
    profile = write_profile(job / "profile.json", favour=favour, tp=tp)
    recs, dumps, log = launch(job, 4 * tp, [
        *flags, *job_only, "--pipeline-model-parallel-size", "2",
        "--tensor-model-parallel-size", str(tp), *FT,
        "--chameleon-ft-startup-timeout-s", "120", "--chameleon-ft-profile", str(profile),
        *deep_plans(favour), *ft, *faults("rank=0,iteration=3,phase=backward,kind=exit")],
        timeout_s=300)
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


def test_an_moe_job_recovers_its_expert_bias(tmp_path: Path) -> None:
    """Aux-loss-free load balancing: the router's ``expert_bias`` is a module buffer that
    megatron's ``finalize_model_grads`` updates each step from the global token counts; it
    moves with its layer, so the redone and later steps route as the failure-free run."""
    done, ref_dump, dumps = recover(tmp_path, MOE_BIAS, rtol=1e-4)
    assert done["decision"]["mode"] == "megatron" and done["migrated_bytes"] > 0
    biases = [k for k in ref_dump["sums"] if k.endswith("|mlp.router.expert_bias")]
    assert len(biases) == 4 and any(ref_dump["sums"][k]["param"] > 0 for k in biases)
    assert_every_copy_matches(ref_dump, dumps)  # every copy: weights, Adam state, biases


def test_a_bf16_job_recovers_in_memory(tmp_path: Path) -> None:
    done, ref_dump, dumps = recover(tmp_path, ("--bf16",), rtol=BF16_RTOL)
    decision = done["decision"]
    assert decision["executed"] == decision["choice"] and done["migrated_bytes"] > 0
    assert_same_state(combine([ref_dump]), combine(list(dumps.values())), rtol=STATE_RTOL)


# One strategy per model through the plan runtime, the two alternating over the models
# (each pair took a few minutes of CI): every model, and each strategy, is still covered.
@pytest.mark.parametrize("strategy,mode", [("replan", "hetero")])
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


@pytest.mark.parametrize("strategy,mode", [("reroute", "reroute")])
def test_an_sgd_job_recovers_through_the_plan_runtime(tmp_path: Path, strategy: str,
                                                      mode: str) -> None:
    done, ref_dump, dumps = recover(tmp_path, ("--optimizer", "sgd"), rtol=1e-4,
                                    ft=("--chameleon-ft-strategy", strategy), favour="pp")
    assert done["decision"]["executed"] == strategy and done["layout_after"]["mode"] == mode, \
        done["layout_after"]
    assert_every_copy_matches(ref_dump, dumps)


@pytest.mark.parametrize("strategy,mode", [("adaptive", "megatron"), ("reroute", "reroute")])
def test_a_bf16_tp2_sgd_job_recovers(tmp_path: Path, strategy: str, mode: str) -> None:
    """8 ranks, TP2 x PP2 x DP2, bf16, SGD with momentum (megatron's distributed optimizer
    shards Adam only, so this is the replicated one); rank 0 dies. Each strategy finishes
    every step within the bf16 tolerance, every TP shard of the weights and momentum buffers
    within the bf16 state tolerance of the one-process run. (A TP2 re-plan onto a
    heterogeneous pipeline: the next tests.)"""
    done, ref_dump, dumps = recover(tmp_path, ("--bf16", "--optimizer", "sgd"), rtol=BF16_RTOL,
                                    ft=("--chameleon-ft-strategy", strategy),
                                    favour="dp" if mode == "megatron" else "pp", tp=2)
    lay = done["layout_after"]
    assert lay["mode"] == mode and done["decision"]["executed"] == (
        "replan" if mode == "megatron" else strategy), done
    holders = [r for r, d in dumps.items() if not d.get("spare")]
    replicas = ([[2, 3, 4, 5], [2, 3, 6, 7]] if mode == "reroute" else
                [[r for r in holders if dumps[r]["dp_rank"] == k] for k in (0, 1)])
    for replica in replicas:
        assert_same_state(combine([ref_dump]),
                          combine([{**dumps[r], "dp_rank": 0} for r in replica]),
                          rtol=STATE_RTOL)


@pytest.mark.parametrize("strategy,mode", [("replan", "hetero")])
def test_an_moe_job_recovers_through_the_plan_runtime(tmp_path: Path, strategy: str,
                                                      mode: str) -> None:
    done, ref_dump, dumps = recover(tmp_path, MOE, rtol=1e-4,
                                    ft=("--chameleon-ft-strategy", strategy), favour="pp")
    assert done["decision"]["executed"] == strategy and done["layout_after"]["mode"] == mode, \
        done["layout_after"]
    assert_every_copy_matches(ref_dump, dumps)


def test_a_tp2_job_re_plans_onto_a_heterogeneous_pipeline(tmp_path: Path) -> None:
    """8 ranks, TP2 x PP2 x DP2; rank 0 dies, its TP group with it: the three intact TP
    groups form one pipeline of depth 3 (the plan runtime at tp = 2: a TP group per stage,
    each TP index synced apart, logits gathered over the stage's TP group for the loss).
    bf16 at TP2 onto such a pipeline: test_dist_opt_e2e.py's MoE job."""
    done, ref_dump, dumps = recover(tmp_path, (), rtol=1e-4,
                                    ft=("--chameleon-ft-strategy", "replan"), favour="pp", tp=2)
    lay = done["layout_after"]
    assert done["decision"]["executed"] == "replan" and lay["mode"] == "hetero", lay
    assert [len(p["stages"]) for p in lay["pipelines"]] == [3], lay
    assert all(len(st) == 2 for st in lay["pipelines"][0]["stages"]), lay
    assert_same_state(combine([ref_dump]), combine(list(dumps.values())), rtol=1e-4)


def test_a_tp2_job_reroutes_around_a_dead_tensor_parallel_group(tmp_path: Path) -> None:
    """8 ranks, TP2 x PP2 x DP2, stages (0, 1) (2, 3) | (4, 5) (6, 7); rank 0 dies: its
    partner 1 waits as a spare, pipeline 0's microbatches run their first stage on (2, 3),
    each TP index sending to the same index of the next stage; nothing moves. With
    --overlap-grad-reduce (megatron's DDP before the failure, the plan's sync after)."""
    done, ref_dump, dumps = recover(tmp_path, ("--overlap-grad-reduce",), rtol=1e-4,
                                    ft=("--chameleon-ft-strategy", "reroute"), favour="pp",
                                    tp=2)
    lay = done["layout_after"]
    assert (lay["mode"], lay["rerouted"], lay["ranks"]) == ("reroute", [0], [2, 3, 4, 5, 6, 7])
    assert done["spares"] == [1] and done["migrated_bytes"] == 0, done
    assert dumps[1].get("spare"), dumps[1]
    for replica in ([2, 3, 4, 5], [2, 3, 6, 7]):  # every TP shard of every stage that trained
        assert_same_state(combine([ref_dump]),
                          combine([{**dumps[r], "dp_rank": 0} for r in replica]))


def test_a_tp2_moe_job_reroutes_through_the_plan_runtime(tmp_path: Path) -> None:
    """8 ranks, TP2 x PP2 x DP2, MoE (4 experts) with sequence parallelism, which
    megatron-core's MoE at TP > 1 needs (on torch's norms: ``megatron.sp_norm``); rank 0
    dies. The plan splits the experts over each stage's TP group and sums the norms' and
    router's partial gradients over it; forced rerouting matches the one-process MoE run
    (a re-plan onto one pipeline of three TP2 stages: test_dist_opt_e2e.py). Without the
    load-balancing loss: megatron-core computes it per sequence part under sequence
    parallelism, so even the failure-free TP2 job drifts from one process by up to 2.2e-4
    in 6 steps (measured)."""
    done, ref_dump, dumps = recover(tmp_path, MOE[:3], rtol=1e-4,
                                    ft=("--chameleon-ft-strategy", "reroute"), favour="pp",
                                    tp=2, job_only=("--sequence-parallel",))
    lay = done["layout_after"]
    assert done["decision"]["executed"] == "reroute" and lay["mode"] == "reroute", lay
    for replica in ([2, 3, 4, 5], [2, 3, 6, 7]):
        assert_same_state(combine([ref_dump]),
                          combine([{**dumps[r], "dp_rank": 0} for r in replica
                                   if not dumps[r].get("spare")]))
