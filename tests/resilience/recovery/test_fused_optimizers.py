"""In-memory recovery with Transformer Engine's and apex's fused optimizers (chameleon-run,
CPU gloo), through their CPU stand-ins (``fused_standins``, installed where megatron-core
looks for them): the fused Adams keep the step count in the param group, not per parameter.

One job per stand-in, 4 ranks, DP2 x PP2, rank 0 dies in backward; each against the
failure-free run of one process with the same stand-in, as the torch-optimizer jobs of
``test_dist_opt_e2e`` and ``test_configs_e2e`` are: every loss, the final weights and
optimizer state (the Adam step count exactly). Three more run megatron's
``--use-precision-aware-optimizer`` over Transformer Engine's (bf16 moments, fp32 master
weights in the optimizer's state, whole or as int16 remainders of the bf16 parameters; fp16
moments with their per-tensor scales; the worker's ``--precision-aware``: the trainer has
no such flag).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from e2e_support import (  # noqa: E402
    FT, ITERS, assert_every_copy_matches, assert_losses_match, assert_same_state, combine,
    faults, launch, run_reference,
)
from test_configs_e2e import BF16_RTOL, STATE_RTOL  # noqa: E402
from test_configs_e2e import recover as recover_replicated  # noqa: E402
from test_dist_opt_e2e import recover as recover_sharded  # noqa: E402

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(480), pytest.mark.serial]


def built(tmp_path: Path) -> set[str]:
    """The optimizer classes the reference and every rank of the job trained with."""
    dumps = [*(tmp_path / "reference" / "dump").glob("*.json"),
             *(tmp_path / "job" / "dump").glob("*.json")]
    return {json.loads(p.read_text()).get("optimizer", "spare") for p in dumps} - {"spare"}


def test_te_fused_adam_recovers_from_shard_copies_of_an_older_step(tmp_path: Path) -> None:
    """The distributed optimizer over Transformer Engine's FusedAdam; shard copies every 4
    steps, so the job rolls back from step 6 to the copies of step 4 and redoes 5 and 6:
    the param groups' step counts go back with the state."""
    done = recover_sharded(tmp_path, 4, ("--fused", "te"), rtol=1e-4, state_rtol=1e-4)
    # (to step 0's copies when step 4's were still being exchanged: one is in flight at most)
    assert done["state_from"]["rolled_back_steps"] in (2, 6), done
    assert built(tmp_path) == {"TEFusedAdam"}


def test_apex_fused_adam_bf16_recovers_in_memory(tmp_path: Path) -> None:
    """apex's FusedAdam under megatron's mixed-precision optimizer (fp32 main copies)."""
    done, ref_dump, dumps = recover_replicated(tmp_path, ("--fused", "apex", "--bf16"),
                                               rtol=BF16_RTOL)
    assert done["migrated_bytes"] > 0, done
    assert built(tmp_path) == {"ApexFusedAdam"}
    assert_same_state(combine([ref_dump]), combine(list(dumps.values())), rtol=STATE_RTOL)


@pytest.mark.parametrize("family,strategy,mode", [("te", "reroute", "reroute"),
                                                  ("apex", "adaptive", "megatron")])
def test_fused_sgd_recovers_in_memory(tmp_path: Path, family: str, strategy: str,
                                      mode: str) -> None:
    """FusedSGD (momentum 0.9), Transformer Engine's through the plan runtime of a rerouted
    job, apex's re-planned onto a megatron layout."""
    done, ref_dump, dumps = recover_replicated(
        tmp_path, ("--fused", family, "--optimizer", "sgd"), rtol=1e-4,
        ft=("--chameleon-ft-strategy", strategy), favour="pp" if mode == "reroute" else "dp")
    assert done["layout_after"]["mode"] == mode, done["layout_after"]
    assert built(tmp_path) == {"FusedSGD" if family == "te" else "ApexFusedSGD"}
    assert_every_copy_matches(ref_dump, dumps)


@pytest.mark.parametrize("layout,strategy,mode", [("bf16", "adaptive", "megatron"),
                                                  ("bf16-remainders", "reroute", "reroute"),
                                                  ("fp16", "adaptive", "megatron")])
def test_te_precision_aware_adam_recovers_from_shard_copies(tmp_path: Path, layout: str,
                                                            strategy: str, mode: str) -> None:
    """bf16 or fp16 moments (fp16 stored divided by a per-tensor scale) and the master
    weights travel unscaled in fp32 and are stored back in the optimizer's layout;
    rerouted, the plan runtime shards each part over its holders (and clips the gradients
    the optimizer reads, ``decoupled_grad``)."""
    done = recover_sharded(tmp_path, 1, ("--precision-aware", layout, "--bf16"),
                           rtol=BF16_RTOL, state_rtol=STATE_RTOL, strategy=strategy, mode=mode,
                           favour="dp" if mode == "megatron" else "pp")
    assert built(tmp_path) == {"TEFusedAdam"}
    ref = json.loads((tmp_path / "reference" / "dump" / "0.json").read_text())
    assert all("master_param" in v for v in ref["sums"].values()), ref
    assert ref["moments"] == f"torch.{'float16' if layout == 'fp16' else 'bfloat16'}", ref


def test_te_fused_adam_falls_back_to_the_checkpoint(tmp_path: Path) -> None:
    """DP2 x PP2 with Transformer Engine's FusedAdam, checkpoints every 2 steps; ranks 2 and
    3, the whole last stage, die in step 5: its layers have no copy left, so the survivors
    load the checkpoint of step 4 (the param groups' step counts with it) on a megatron
    layout (PP2 x DP1) and redo step 5. Every loss and the final state are the failure-free
    run's."""
    flags = ("--fused", "te")
    (tmp_path / "reference").mkdir()
    ref_losses, ref_dump = run_reference(tmp_path / "reference", flags=flags)
    job = tmp_path / "job"
    job.mkdir()
    recs, dumps, log = launch(job, 4, [
        *flags, "--pipeline-model-parallel-size", "2", "--save", str(tmp_path / "ckpt"),
        "--save-interval", "2", *FT, "--chameleon-ft-startup-timeout-s", "120",
        *faults("rank=2,iteration=5,phase=forward,kind=exit",
                "rank=3,iteration=5,phase=forward,kind=exit")], timeout_s=400)
    assert assert_losses_match(recs, ref_losses) == list(range(1, ITERS + 1)), \
        log[-4000:]
    (done,) = [r for r in recs if r["event"] == "recovery"]
    assert (sorted(done["failed_ranks"]), done["fallback"]) == ([2, 3], "checkpoint"), done
    assert done["state_from"] == {"source": "checkpoint"}, done
    assert built(tmp_path) == {"TEFusedAdam"}
    assert_same_state(combine([ref_dump]), combine([dumps[r] for r in sorted(dumps)]))
