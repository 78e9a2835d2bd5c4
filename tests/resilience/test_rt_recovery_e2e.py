"""Recovery end to end under chameleon-run (CPU, gloo), against a failure-free run.

Two jobs, each with several failures, and one failure-free reference (one process; losses and
initial weights do not depend on the layout, so every layout must reproduce its numbers):

* 4 ranks, DP2 x PP2: rank 0 dies in backward; rank 2 dies during that recovery (the
  survivors retry from the state they held); rank 3 hangs later and is found by its heartbeat.
  Everything recovers in memory: every step once, every loss and, at the end, every weight and
  Adam moment as in the reference.
* 8 ranks, TP2 x PP2 x DP2: rank 5 dies in its optimizer step (the others have applied that
  step: it is kept, not redone); spares wait; later both ranks holding stage 1 die: no copy is
  left, the survivors (a spare among them) load the last checkpoint into the new layout.

The re-plan is made deterministic by a profile whose links favour depth-1 pipelines (4 ranks)
or one deep pipeline (8 ranks). The worker is ``recovery_worker.py``.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
from dist_utils import TINY, run_command  # noqa: E402
from test_rt_support import run_launcher  # noqa: E402

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(480)]

WORKER = Path(__file__).with_name("recovery_worker.py")
ITERS = 8
COMMON = [*TINY, "--hidden-dropout", "0", "--attention-dropout", "0"]
FT = ["--chameleon-ft", "--chameleon-ft-timing-steps", "1", "--chameleon-ft-min-pg-timeout-s", "3",
      "--chameleon-ft-pg-timeout-factor", "10"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, float], dict]:
    return run_reference(tmp_path_factory.mktemp("reference"))


def faults(*specs: str) -> list[str]:
    return [arg for spec in specs for arg in ("--chameleon-inject-fault", spec)]


def test_four_ranks_recover_in_memory_from_three_failures(reference, tmp_path: Path) -> None:
    ref_losses, ref_dump = reference
    profile = write_profile(tmp_path / "profile.json", favour="dp", tp=1)
    recs, dumps, log = launch(tmp_path, 4, [
        "--pipeline-model-parallel-size", "2", *FT, "--chameleon-ft-startup-timeout-s", "120",
        "--chameleon-ft-profile", str(profile),
        *faults("rank=0,iteration=3,phase=backward,kind=exit",
                "rank=2,iteration=3,phase=recovery,kind=exit",
                "rank=3,iteration=6,phase=forward,kind=hang")], timeout_s=300)
    assert assert_losses_match(recs, ref_losses) == list(range(1, ITERS + 1)), log[-4000:]
    first, second = [r for r in recs if r["event"] == "recovery"]
    # generation 1 failed when rank 2 died in it; generation 2 recovered from the old state
    assert (first["generation"], first["failed_ranks"], first["redo_iteration"]) == (2, [0, 2], 3)
    assert first["fallback"] is None and first["migrated_bytes"] > 0
    lay = first["layout_after"]
    assert (lay["tp"], lay["pp"], lay["dp"], sorted(lay["ranks"])) == (1, 1, 2, [1, 3])
    decision = first["decision"]
    assert [c["name"] for c in decision["candidates"]] == ["reroute", "replan"]
    assert decision["D_s"] > 0 and decision["choice"] in ("reroute", "replan")
    assert decision["executed"] == "replan" and decision["transfers"] > 0
    assert set(first["phases_s"]) == {"detect", "decide", "regroup", "migrate", "total"}
    assert first["phases_s"]["total"] >= max(first["phases_s"][p] for p in ("decide", "regroup"))
    assert (second["failed_ranks"], second["redo_iteration"]) == ([3], 6)
    assert second["failures"][0]["reason"] == "heartbeat"
    assert second["layout_after"]["ranks"] == [1] and second["spares"] == []
    assert sorted(dumps) == [1]
    assert_same_state(combine([ref_dump]), combine([dumps[1]]))


def test_eight_ranks_keep_an_applied_step_and_fall_back_to_the_checkpoint(
        reference, tmp_path: Path) -> None:
    ref_losses, ref_dump = reference
    profile = write_profile(tmp_path / "profile.json", favour="pp", tp=2)
    recs, dumps, log = launch(tmp_path, 8, [
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--save", str(tmp_path / "ckpt"), "--save-interval", "4",
        *FT, "--chameleon-ft-startup-timeout-s", "200", "--chameleon-ft-profile", str(profile),
        *faults("rank=5,iteration=3,phase=optimizer,kind=exception",
                "rank=6,iteration=6,phase=forward,kind=exit",
                "rank=7,iteration=6,phase=forward,kind=exit")], timeout_s=420)
    # step 3 was applied by every survivor before its loss was summed: kept, never redone;
    # after the fallback to the checkpoint of step 4, step 5 runs again
    assert assert_losses_match(recs, ref_losses) == [1, 2, 4, 5, 5, 6, 7, 8], log[-4000:]
    first, second = [r for r in recs if r["event"] == "recovery"]
    assert (first["failed_ranks"], first["redo_iteration"], first["fallback"]) == ([5], 4, None)
    lay = first["layout_after"]
    assert (lay["tp"], lay["pp"], lay["dp"], len(first["spares"])) == (2, 2, 1, 3)
    assert (second["failed_ranks"], second["redo_iteration"]) == ([6, 7], 5)
    assert second["fallback"] == "checkpoint" and second["decision"]["lost"] == [2, 3, "output"]
    assert set(second["layout_after"]["ranks"]) & set(first["spares"]), "no spare rejoined"
    assert second["spares"] == [4] and dumps[4] == {"spare": True}
    assert sorted(dumps) == [0, 1, 2, 3, 4]
    assert_same_state(combine([ref_dump]), combine([dumps[r] for r in range(4)]))


# ----------------------------------------------------------------------------- helpers
def write_profile(path: Path, *, favour: str, tp: int, **over: float) -> Path:
    """A profile of the TINY model whose links make the re-plan deterministic:
    favour="dp": slow stage-to-stage hops (pipelines of depth 1); "pp": slow all-reduce
    (one pipeline, as deep as the survivors allow). ``over``: other Hardware figures, and
    micro_batch_size/global_batch_size/seconds_per_flop."""
    from chameleon_megatron.resilience.model_shape import ModelShape
    from chameleon_megatron.resilience.profile import save_profile
    from chameleon_megatron.resilience.profile_derive import Hardware, profile_from_shape

    slow, fast = 1e3, 1e15
    args = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
            "micro_batch_size": int(over.pop("micro_batch_size", 2)),
            "global_batch_size": int(over.pop("global_batch_size", 8)),
            "padded_vocab_size": 128, "tensor_model_parallel_size": tp}
    per_flop = over.pop("seconds_per_flop", 1e-12)
    links = {"p2p_bandwidth_Bps": slow if favour == "dp" else fast,
             "allreduce_bandwidth_Bps": slow if favour == "pp" else fast,
             "transfer_bandwidth_Bps": 1e9}
    hw = Hardware(device_memory_bytes=1e12, **{**links, **over})
    profile = profile_from_shape(ModelShape.from_args(args), hw, seconds_per_flop=per_flop,
                                 name=f"favour-{favour}", source="test")
    save_profile(profile, path)
    return path


def run_reference(tmp: Path, iters: int = ITERS,
                  flags: tuple[str, ...] = ()) -> tuple[dict[int, float], dict]:
    """Losses and state sums of the failure-free run (one process)."""
    dump = tmp / "dump"
    dump.mkdir()
    metrics = tmp / "metrics.jsonl"
    run_command([sys.executable, str(WORKER), "--dump", str(dump), "--iters", str(iters), *COMMON,
                 *flags, "--chameleon-metrics-file", str(metrics)], timeout=120, log=tmp / "log")
    losses = {r["iteration"]: r["loss"] for r in records(metrics) if r["event"] == "iteration"}
    return losses, json.loads((dump / "0.json").read_text())


def launch(tmp: Path, nproc: int, flags: list[str], timeout_s: float,
           iters: int = ITERS) -> tuple[list, dict, str]:
    """A chameleon-run job of this worker: (metrics records, dumps by launch rank, log)."""
    code, _ = run_launcher(["--standalone", *job_args(tmp, nproc, flags, iters)], tmp / "log",
                           timeout_s=timeout_s)
    log = (tmp / "log").read_text()
    assert code == 0, log[-6000:]
    return outcome(tmp)


def job_args(tmp: Path, nproc: int, flags: list[str], iters: int = ITERS) -> list[str]:
    """chameleon-run's arguments (rendezvous options aside) for a job of this worker that
    dumps into ``tmp/dump`` and writes ``tmp/metrics.jsonl``."""
    (tmp / "dump").mkdir(exist_ok=True)
    return [f"--nproc-per-node={nproc}", "--monitor-interval=0.1", str(WORKER),
            "--dump", str(tmp / "dump"), "--iters", str(iters), *COMMON, *flags,
            "--chameleon-metrics-file", str(tmp / "metrics.jsonl")]


def outcome(tmp: Path) -> tuple[list, dict, str]:
    """(metrics records, dumps by launch rank, log) of a finished job; no process left."""
    assert not leftover(tmp), f"processes left behind: {leftover(tmp)}"
    dumps = {int(p.stem): json.loads(p.read_text()) for p in (tmp / "dump").glob("*.json")}
    return records(tmp / "metrics.jsonl"), dumps, (tmp / "log").read_text()


def records(metrics: Path) -> list[dict]:
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def leftover(tmp: Path, wait_s: float = 10.0) -> list[int]:
    """Processes whose command line names ``tmp`` (workers outliving their launcher)."""
    deadline = time.monotonic() + wait_s
    while True:
        found = []
        for proc in Path("/proc").iterdir():
            try:
                if proc.name.isdigit() and str(tmp) in (proc / "cmdline").read_text():
                    found.append(int(proc.name))
            except OSError:
                continue
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def combine(dumps: list[dict]) -> dict[str, dict[str, float]]:
    """Whole-model sums from the ranks of one data-parallel replica: a tensor-parallel shard
    adds its sums of squares, a replicated tensor counts once."""
    total: dict[str, dict[str, float]] = {}
    for d in dumps:
        if d.get("spare") or d["dp_rank"] != 0:
            continue
        for key, v in d["sums"].items():
            if not v["sharded"] and d["tp_rank"] != 0:
                continue
            acc = total.setdefault(key, {"param": 0.0, "exp_avg": 0.0, "exp_avg_sq": 0.0,
                                         "step": v["step"]})
            for k in ("param", "exp_avg", "exp_avg_sq"):
                acc[k] += v[k]
    return total


def assert_same_state(want: dict, got: dict, rtol: float = 1e-4, iters: int = ITERS) -> None:
    """Every parameter of the reference: same weights and Adam moments, ``iters`` Adam steps."""
    missing = sorted(set(want) - set(got))
    assert not missing, f"parameters missing after recovery: {missing}"
    for key, w in want.items():
        g = got[key]
        assert g["step"] == iters, (key, g["step"])
        for k in ("param", "exp_avg", "exp_avg_sq"):
            assert math.isclose(g[k], w[k], rel_tol=rtol, abs_tol=1e-30), (key, k, w[k], g[k])


def assert_losses_match(recs: list[dict], ref: dict[int, float], rtol: float = 1e-4) -> list[int]:
    """Each iteration record's loss equals the reference's; returns the iterations seen."""
    seen = []
    for r in recs:
        if r["event"] == "iteration":
            want = ref[r["iteration"]]
            assert abs(r["loss"] - want) <= rtol * abs(want), (r["iteration"], r["loss"], want)
            seen.append(r["iteration"])
    return seen
