"""The layout a recovery chooses on Megatron-LM's pretrain_gpt.py (a plan through
``training/lm_plan.py``) against the megatron layout that path took before plans ran there
(``--no-chameleon-ft-plans``): the same job, PP2 x DP4 on 8 CPU ranks, rank 5 killed in
step 2. Per job: the layout after the recovery and its mean step time (the steps after the
first one in it), and the ratio of the two, measured in the same run. A third job runs the
chosen plan with an evaluation every ``--eval-every`` steps: each takes the job to a megatron
layout and back (the "work" and "back" transitions), whose mean durations it prints.

    python scripts/bench_lm_plans.py                      # ../shared/megatron-lm (0.16)
    python scripts/bench_lm_plans.py --hidden 256 --iters 16
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHECKOUT = REPO.parent / "shared" / "megatron-lm"
KILL = "rank=5,iteration=2,phase=forward,kind=exit"


def patched_copy(source: Path, dest: Path) -> Path:
    """A writable copy of the checkout with patches/apply.py applied (the original is read-only)."""
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns(".git", "__pycache__"))
    for path in [dest, *dest.rglob("*")]:
        path.chmod(path.stat().st_mode | 0o200)
    spec = importlib.util.spec_from_file_location("chameleon_patch", REPO / "patches" / "apply.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.apply(dest)
    return dest


def job_flags(a: argparse.Namespace) -> list[str]:
    return [str(x) for x in (
        "--num-layers", a.layers, "--hidden-size", a.hidden, "--num-attention-heads", 4,
        "--seq-length", 64, "--max-position-embeddings", 64, "--micro-batch-size", 1,
        "--global-batch-size", 8, "--train-iters", a.iters, "--lr", "1e-4", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", 1024, "--log-interval", 1,
        "--eval-interval", 1000, "--eval-iters", 1, "--pipeline-model-parallel-size", 2)]


def run(ckpt: Path, out: Path, a: argparse.Namespace, *extra: str) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ckpt), str(REPO)])}
    cmd = [sys.executable, "-m", "chameleon_megatron.run", "--standalone", "--nproc-per-node",
           "8", "pretrain_gpt.py", *job_flags(a), "--chameleon-ft",
           "--chameleon-inject-fault", KILL, "--chameleon-metrics-file", str(out), *extra]
    done = subprocess.run(cmd, env=env, cwd=ckpt, capture_output=True, text=True,
                          timeout=a.timeout_s)
    if done.returncode != 0:
        raise SystemExit(f"the job failed ({done.returncode}): {done.stdout[-3000:]}")
    return [json.loads(line) for line in out.read_text().splitlines()]


def summary(records: list[dict]) -> dict:
    """The layout after the recovery and the mean step time after its first step."""
    (recovery,) = [r for r in records if r["event"] == "recovery" and r["cause"] == "failure"]
    steps = [r for r in records if r["event"] == "iteration" and r["world_size"] < 8]
    times = [r["step_time_s"] for r in steps[1:]]
    lay = recovery["layout_after"]
    return {"mode": lay["mode"], "layout": lay.get("plan"), "ranks": len(lay["ranks"]),
            "step_s": statistics.mean(times), "steps": len(times)}


def around_work(records: list[dict]) -> dict:
    """Per cause ("work", "back"): how many transitions, and the mean seconds of each of
    their phases ("total" included)."""
    out = {}
    for cause in ("work", "back"):
        took = [r["phases_s"] for r in records
                if r["event"] == "recovery" and r["cause"] == cause]
        out[cause] = {"n": len(took), "mean_s": {
            phase: statistics.mean(t[phase] for t in took) for phase in took[0]} if took else {}}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkout", type=Path, default=CHECKOUT)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--eval-every", type=int, default=4)
    p.add_argument("--timeout-s", type=float, default=900)
    a = p.parse_args()
    if a.iters < 5:
        raise SystemExit(f"--iters {a.iters}: needs >= 5 (two steps measured after step 2)")
    if not 2 < a.eval_every < a.iters - 1:
        raise SystemExit(f"--eval-every {a.eval_every}: needs 3 to {a.iters - 2} (inside the "
                         "plan, a step without an evaluation after it before the end)")
    if not (a.checkout / "pretrain_gpt.py").is_file():
        raise SystemExit(f"--checkout {a.checkout}: no pretrain_gpt.py there")
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = patched_copy(a.checkout, Path(tmp) / "Megatron-LM")
        plan = summary(run(ckpt, Path(tmp) / "plan.jsonl", a))
        uniform = summary(run(ckpt, Path(tmp) / "uniform.jsonl", a, "--no-chameleon-ft-plans"))
        work = around_work(run(ckpt, Path(tmp) / "work.jsonl", a,
                               "--eval-interval", str(a.eval_every)))
    for name, s in (("chosen", plan), ("megatron only", uniform)):
        print(f"{name:>14}: {s['mode']:8} {str(s['layout']):32} on {s['ranks']} ranks: "
              f"{s['step_s'] * 1e3:8.1f} ms/step over {s['steps']} steps")
    print(f"step time, chosen / megatron only: {plan['step_s'] / uniform['step_s']:.2f}")
    for cause, t in work.items():
        phases = ", ".join(f"{k} {v:.2f} s" for k, v in t["mean_s"].items())
        print(f"{cause:>14}: {t['n']} transitions, mean {phases or '-'}")
    print(json.dumps({"chosen": plan, "megatron_only": uniform, "around_work": work}))


if __name__ == "__main__":
    main()
