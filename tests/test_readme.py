"""The README's commands are run exactly as written: the demo here, the test command by CI
(``.ci/run`` is that command), and the Megatron-LM patch command on a copy of the checkout."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dist_utils import run_command

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
MEGATRON_LM = REPO.parent / "shared" / "megatron-lm"


def two_commands() -> list[str]:
    """The commands of the README's "Two commands" block, comments stripped."""
    section = README.split("## Two commands", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.strip()]


def test_ci_runs_the_readme_test_command():
    demo, tests = two_commands()
    assert (demo, tests) == ("bash scripts/demo_cpu.sh", "bash scripts/test.sh")
    steps = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()
             if line.strip() and not line.startswith(("#", "set ", "cd "))]
    assert steps == [tests]


@pytest.mark.serial
@pytest.mark.timeout(900)
def test_demo_runs_as_written_and_shows_what_the_project_does():
    demo = two_commands()[0]
    out = run_command(["bash", "-c", demo], timeout=840)
    # The job: swap on, a rank killed mid-run, recovered in memory, finished.
    assert re.search(r" start: .*\| swap on .*\| fault tolerance on", out), out[-3000:]
    assert "injecting fault rank=3,iteration=12" in out
    assert "recovered in memory from failure of ranks [3]" in out
    assert re.search(r"iteration +30/ +30", out)
    # The summary: memory per stage, the recovery's phases and choice, the loss.
    assert re.search(r"stage 0: .* MiB with swap, .* MiB without \(\d+\.\d % less\)", out, re.S)
    assert re.search(r"stage 1: .* MiB with swap", out, re.S)
    assert re.search(r"detect [\d.]+ s.*decide [\d.]+ s", out, re.S)
    assert re.search(r"decision: (reroute|replan) \(chosen by score", out)
    assert re.search(r"loss at iteration 30: [\d.]+ \(reference [\d.]+\)", out)
    for png in ("metrics-swap.png", "metrics-recovery.png"):
        assert (REPO / "runs" / "demo" / png).stat().st_size > 10_000


@pytest.mark.skipif(not MEGATRON_LM.is_dir(), reason="no Megatron-LM checkout next to the repo")
def test_readme_patch_command_as_written(tmp_path):
    line = next(x for x in README.splitlines() if "python patches/apply.py" in x)
    command = re.search(r"`(python patches/apply\.py [^`]+)`", line).group(1)
    checkout = tmp_path / "Megatron-LM"
    shutil.copytree(MEGATRON_LM, checkout, ignore=shutil.ignore_patterns(".git", "tests"))
    argv = command.replace("/path/to/Megatron-LM", str(checkout)).split()[1:]
    subprocess.run([sys.executable, *argv], cwd=REPO, check=True)
    assert "chameleon-megatron" in (checkout / "pretrain_gpt.py").read_text()
