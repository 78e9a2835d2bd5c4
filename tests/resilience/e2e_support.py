"""Shared by the end-to-end recovery tests: the worker's job under chameleon-run, its
failure-free reference (one process), and comparisons of losses and final state."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from dist_utils import TINY, run_command  # noqa: E402
from rt_support import run_launcher  # noqa: E402

WORKER = Path(__file__).resolve().parent / "recovery_worker.py"
ITERS = 8
COMMON = [*TINY, "--hidden-dropout", "0", "--attention-dropout", "0"]
FT = ["--chameleon-ft", "--chameleon-ft-timing-steps", "1",
      "--chameleon-ft-pg-timeout-factor", "10"]
"""Timeouts from the first measured step, with the default 5 s floor: group timeout 5 s,
heartbeat 10 s, recovery window 20 s (a 2-core machine running 8 ranks stalls a rank for
seconds now and then: a shorter heartbeat kills healthy ranks)."""
SHORT_WINDOW = ["--chameleon-ft-min-pg-timeout-s", "3", "--chameleon-ft-pg-timeout-factor", "1"]
"""Group timeout 3 s, heartbeat 6 s, recovery window 12 s: for tests that outlast a window
(the factor pinned: on a loaded machine 5 x the step time made the window 22 s, longer than
the 16 s stall meant to outlast it)."""


def faults(*specs: str) -> list[str]:
    return [arg for spec in specs for arg in ("--chameleon-inject-fault", spec)]


def write_profile(path: Path, *, favour: str, tp: int, **over: float) -> Path:
    """A profile of the TINY model whose links make the re-plan deterministic:
    favour="dp": slow stage-to-stage hops (pipelines of depth 1); "pp": slow all-reduce
    (one pipeline, as deep as the survivors allow). ``over``: other Hardware figures, and
    micro_batch_size/global_batch_size/seconds_per_flop."""
    from chameleon_megatron.resilience.decision.model_shape import ModelShape
    from chameleon_megatron.resilience.decision.profile import save_profile
    from chameleon_megatron.resilience.decision.shape_profile import Hardware, profile_from_shape

    slow, fast = 1e3, 1e15
    args = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
            "micro_batch_size": int(over.pop("micro_batch_size", 2)),
            "global_batch_size": int(over.pop("global_batch_size", 8)),
            "padded_vocab_size": 128, "tensor_model_parallel_size": tp}
    per_flop = over.pop("seconds_per_flop", 1e-12)
    links = {"p2p_bandwidth_Bps": slow if favour == "dp" else fast,
             "allreduce_bandwidth_Bps": slow if favour == "pp" else fast,
             "transfer_bandwidth_Bps": 1e9}
    hw = Hardware(**{"device_memory_bytes": 1e12, **links, **over})
    profile = profile_from_shape(ModelShape.from_args(args), hw, seconds_per_flop=per_flop,
                                 name=f"favour-{favour}", source="test")
    save_profile(profile, path)
    return path


def deep_plans(favour: str) -> list[str]:
    """Flags that let a re-plan under ``favour="pp"`` take the one deep pipeline that
    profile favours (a recovery keeps two or more pipelines by default)."""
    return ["--no-chameleon-ft-keep-replicas"] if favour == "pp" else []


_REFERENCES: dict[tuple, dict[str, bytes]] = {}
"""The files of each failure-free run this test process made, by (iters, flags): the run is
deterministic, so a second test with the same flags gets a copy instead of a rerun."""


def run_reference(tmp: Path, iters: int = ITERS,
                  flags: tuple[str, ...] = ()) -> tuple[dict[int, float], dict]:
    """Losses and state sums of the failure-free run (one process); its files (dump/,
    metrics.jsonl, log) land in ``tmp``."""
    key = (iters, tuple(flags))
    if key in _REFERENCES:
        for name, data in _REFERENCES[key].items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp / name).write_bytes(data)
    else:
        (tmp / "dump").mkdir()
        run_command([sys.executable, str(WORKER), "--dump", str(tmp / "dump"), "--iters",
                     str(iters), *COMMON, *flags, "--chameleon-metrics-file",
                     str(tmp / "metrics.jsonl")], timeout=120, log=tmp / "log")
        _REFERENCES[key] = {str(f.relative_to(tmp)): f.read_bytes()
                            for f in tmp.rglob("*") if f.is_file()}
    losses = {r["iteration"]: r["loss"] for r in records(tmp / "metrics.jsonl")
              if r["event"] == "iteration"}
    return losses, json.loads((tmp / "dump" / "0.json").read_text())


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


FAILURE_LINES = ("worker failed", "silent for", '"event": "suspected"', '"event": "failure_seen"',
                 '"event": "recovery_retry"', '"event": "timeouts"')


def failure_story(log: str) -> str:
    """The log lines that say who was declared failed, why, and under which deadlines: what
    an assertion about a recovery should print when it fails."""
    return "\n".join(line for line in log.splitlines() if any(k in line for k in FAILURE_LINES))


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
            acc = total.setdefault(key, {"step": v["step"]})
            for k in summed(v):
                acc[k] = acc.get(k, 0.0) + v[k]
    return total


def summed(sums: dict) -> list[str]:
    """The sums of squares in one parameter's entry: the weight and its optimizer state."""
    return [k for k in sums if k not in ("sharded", "step")]


def assert_same_state(want: dict, got: dict, rtol: float = 1e-4, iters: int = ITERS) -> None:
    """Every parameter of the reference: same weights and optimizer state (Adam's moments,
    SGD's momentum), ``iters`` Adam steps."""
    missing = sorted(set(want) - set(got))
    assert not missing, f"parameters missing after recovery: {missing}"
    for key, w in want.items():
        g = got[key]
        assert g["step"] == (iters if w["step"] is not None else None), (key, g["step"])
        assert sorted(summed(g)) == sorted(summed(w)), (key, g, w)
        for k in summed(w):
            assert math.isclose(g[k], w[k], rel_tol=rtol, abs_tol=1e-30), (key, k, w[k], g[k])


TIED = {"output|output_layer.weight": "embedding|word_embeddings.weight"}
"""A last stage's copy of the tied word embeddings (one process has none)."""


def assert_every_copy_matches(ref_dump: dict, dumps: dict, rtol: float = 1e-4) -> None:
    """TP 1: every copy of every parameter on a rank that holds state equals the one-process
    reference (weight and optimizer state), and the copies cover the whole model."""
    holders = {r: d for r, d in dumps.items() if not d.get("spare")}
    assert holders, dumps
    want = ref_dump["sums"]
    covered: set[str] = set()
    for rank, dump in holders.items():
        for key, got in dump["sums"].items():
            w = want[TIED.get(key, key)]
            assert got["step"] == w["step"], (rank, key, got["step"], w["step"])
            assert sorted(summed(got)) == sorted(summed(w)), (rank, key, got, w)
            for k in summed(w):
                assert math.isclose(got[k], w[k], rel_tol=rtol, abs_tol=1e-30), (rank, key, k)
            covered.add(TIED.get(key, key))
    assert covered >= set(want), sorted(set(want) - covered)


def assert_losses_match(recs: list[dict], ref: dict[int, float], rtol: float = 1e-4) -> list[int]:
    """Each iteration record's loss equals the reference's; returns the iterations seen."""
    seen = []
    for r in recs:
        if r["event"] == "iteration":
            want = ref[r["iteration"]]
            assert abs(r["loss"] - want) <= rtol * abs(want), (r["iteration"], r["loss"], want)
            seen.append(r["iteration"])
    return seen


def assert_resumed_from_copies(done: dict, *, newest: int, interval: int, failed: int,
                               fail_at: int) -> int:
    """The recovery record ``done`` resumed from committed shard copies: the newest step's
    (``newest``), or the one before it when that copy was still being exchanged off the
    step (one copy is in flight at most, so the copy before it is committed). Returns the
    step resumed from."""
    resumed = done["state_from"].get("iteration")
    assert resumed in (newest, newest - interval), done
    assert done["redo_iteration"] == resumed + 1 and done["state_from"] == {
        "source": "shard copies", "iteration": resumed,
        "rolled_back_steps": fail_at - 1 - resumed, "replicas_of": [failed]}, done
    return resumed
