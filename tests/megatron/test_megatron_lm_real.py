"""patches/apply.py and Megatron-LM's own pretrain_gpt.py, on a copy of a real checkout
(CHAMELEON_MEGATRON_LM, else ../shared/megatron-lm next to the repository, as on CI): the
patch round trip, ``--help``, and training on 2 CPU ranks (DP2 and PP2, with and without
swap, README's recipe as written)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from chameleon_megatron import cli
from chameleon_megatron.metrics_file import read_metrics

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lm_support import REPO, copy_checkout, needs_real, patch, script_bytes  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def real_checkout(tmp_path):
    """A copy of the checkout (the original is never written)."""
    return copy_checkout(tmp_path / "Megatron-LM")


@needs_real
@pytest.mark.timeout(300)
def test_real_checkout_patch_round_trip_and_help(real_checkout):
    ckpt, env = real_checkout
    original = script_bytes(ckpt)
    assert patch.status(ckpt) == "unpatched"
    diff = patch.diff(ckpt)
    assert "+    pretrain = _chameleon_wrap(pretrain)" in diff.splitlines()
    assert script_bytes(ckpt) == original  # diff writes nothing
    assert patch.apply(ckpt) is True
    assert patch.apply(ckpt) is False
    assert patch.status(ckpt) == "patched"
    help_text = subprocess.run([sys.executable, str(ckpt / "pretrain_gpt.py"), "--help"],
                               env=env, cwd=ckpt, capture_output=True, text=True, timeout=240)
    assert help_text.returncode == 0, help_text.stderr[-3000:]
    for flag in ("--chameleon-config", "--chameleon-swap", "--chameleon-metrics-file",
                 "--chameleon-ft", "--chameleon-inject-fault"):
        assert flag in help_text.stdout
    assert "--chameleon-ft-respawns" in help_text.stdout
    assert patch.remove(ckpt) is True
    assert script_bytes(ckpt) == original
    assert patch.status(ckpt) == "unpatched"


# What a GPU user runs (a tiny model): on this CPU host, no flag is added for the CPU.
USER_FLAGS = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 8 "
    "--train-iters 4 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer --vocab-size 128 "
    "--log-interval 1 --eval-interval 2 --eval-iters 1"
).split()


def run_real(ckpt: Path, env: dict, out: Path, *extra: str) -> tuple[list[dict], str]:
    """Megatron-LM's pretrain_gpt.py under torchrun on 2 CPU ranks; (records, log)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "pretrain_gpt.py", *USER_FLAGS, "--chameleon-metrics-file", str(out), *extra]
    run = subprocess.Popen(cmd, env=env, cwd=ckpt, text=True, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, start_new_session=True)
    try:
        log = run.communicate(timeout=250)[0]
    finally:  # torchrun's workers go with it
        if run.poll() is None:
            os.killpg(run.pid, 9)
            run.wait()
    assert run.returncode == 0, log[-6000:]
    return iterations(out), log


def iterations(path: Path) -> list[dict]:
    """The iteration records of a metrics file, after the run record it starts with."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records[0]["event"] == "run" and records[0]["run_id"] == 1
    assert [r["event"] for r in records[1:]] == ["iteration"] * (len(records) - 1)
    return records[1:]


def readme_recipe() -> list[str]:
    """The commands of README's Megatron-LM block (continuation lines joined)."""
    section = (REPO / "README.md").read_text().split("## Megatron-LM", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]


@needs_real
@pytest.mark.timeout(600)
def test_readme_recipe_runs_as_written_and_swap_keeps_the_losses(real_checkout):
    """README's CPU recipe (PP2, swap), as written, on a copy of the checkout; then the same
    run without swap: the losses are bitwise equal, and Megatron-LM's own log agrees."""
    ckpt, env = real_checkout
    install, apply, train = readme_recipe()
    assert install == "pip install -e '.[megatron-lm]'"  # what scripts/setup_env.sh did
    here = {**env, "PATH": os.pathsep.join([str(Path(sys.executable).parent), env["PATH"]])}
    for command, cwd in ((apply, REPO), (train, ckpt)):
        run = subprocess.run(["bash", "-c", command.replace("/path/to/Megatron-LM", str(ckpt))],
                             cwd=cwd, env=here, capture_output=True, text=True, timeout=250)
        assert run.returncode == 0, (command, (run.stdout + run.stderr)[-6000:])
    swapped = iterations(ckpt / "runs" / "swap.jsonl")
    assert all(r["swap"]["swapped_out_bytes"] > 0 for r in swapped[1:])
    plain, log = run_real(ckpt, env, ckpt / "runs" / "plain.jsonl",
                          "--pipeline-model-parallel-size", "2")
    assert [(r["iteration"], r["consumed_samples"], r["layout"]) for r in plain] == [
        (i, 8 * i, {"tp": 1, "pp": 2, "vpp": 1, "dp": 1}) for i in (1, 2, 3, 4)]
    assert [r["loss"] for r in swapped] == [r["loss"] for r in plain]
    assert "no CUDA: Megatron-LM's training runs on the CPU (gloo)" in log
    # Megatron-LM's own log lines show the losses rank 0 recorded; its line for iteration 2
    # averages iterations 1 and 2, lines 1 and 3 hold one step each.
    for i in (0, 2):
        assert f"iteration        {i + 1}/       4 |" in log
        assert f"lm loss: {plain[i]['loss']:.6E}" in log


@needs_real
@pytest.mark.timeout(600)
def test_real_checkout_trains_dp2_on_cpu_with_and_without_swap(real_checkout, tmp_path):
    ckpt, env = real_checkout
    patch.apply(ckpt)
    plain, _ = run_real(ckpt, env, tmp_path / "plain.jsonl")
    assert [(r["iteration"], r["consumed_samples"], r["layout"]) for r in plain] == [
        (i, 8 * i, {"tp": 1, "pp": 1, "vpp": 1, "dp": 2}) for i in (1, 2, 3, 4)]
    assert all("swap" not in r for r in plain)
    swapped, _ = run_real(ckpt, env, tmp_path / "swap.jsonl",
                          "--chameleon-swap", "--chameleon-swap-min-tensor-bytes", "1024")
    # Swapping moves saved activations to host memory and back: losses stay bitwise equal.
    assert [r["loss"] for r in swapped] == [r["loss"] for r in plain]
    assert all(r["swap"]["swapped_out_bytes"] > 0 for r in swapped[1:])
    # chameleon's tools read the file this path writes: the run record's args give the model
    # shape, the iteration records the step times and swap figures
    (run,) = read_metrics(tmp_path / "plain.jsonl", "run")
    assert (run["world_size"], run["args"]["num_layers"], run["args"]["hidden_size"]) == (2, 2, 64)
    assert run["versions"]["megatron_core"] == package_version(ckpt)
    profile = tmp_path / "profile.json"
    assert cli.main(["profile", "--metrics", str(tmp_path / "plain.jsonl"), "-o",
                     str(profile)]) == 0
    assert json.loads(profile.read_text())["model"]["num_layers"] == 2
    figure = tmp_path / "swap.png"
    assert cli.main(["report", str(tmp_path / "swap.jsonl"), "--out", str(figure)]) == 0
    assert figure.stat().st_size > 0


def package_version(ckpt: Path) -> str:
    """The version of the checkout's megatron.core (its package_info.py)."""
    info: dict = {}
    exec((ckpt / "megatron" / "core" / "package_info.py").read_text(), info)
    return info["__version__"]


@needs_real
@pytest.mark.parametrize("flags, message", [
    (["--chameleon-swap", "--fine-grained-activation-offloading"],
     "--chameleon-swap with --fine-grained-activation-offloading: Megatron's activation "
     "offloading and Chameleon's swap would both own the saved-tensor hooks"),
    (["--chameleon-ft", "--fp16"], "--chameleon-ft: --fp16: the loss scaler's state"),
    (["--chameleon-ft", "--context-parallel-size", "2"],
     "--chameleon-ft: --context-parallel-size 2"),
    (["--chameleon-metrics-file", "USED"], "already holds a run; give --chameleon-metrics-append"),
])
def test_the_real_entry_refuses_in_one_line_before_any_work(real_checkout, tmp_path, flags,
                                                            message):
    ckpt, env = real_checkout
    patch.apply(ckpt)
    used = tmp_path / "used.jsonl"
    used.write_text('{"event": "run", "run_id": 1}\n')
    flags = [str(used) if f == "USED" else f for f in flags]
    run = subprocess.run([sys.executable, "pretrain_gpt.py", *USER_FLAGS, *flags], env=env,
                         cwd=ckpt, capture_output=True, text=True, timeout=240)
    assert run.returncode == 2, run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if "error" in line.lower()]
    assert errors == [f"pretrain_gpt.py: error: {errors[0].split('error: ', 1)[1]}"], errors
    assert message in errors[0] and "Traceback" not in run.stderr
