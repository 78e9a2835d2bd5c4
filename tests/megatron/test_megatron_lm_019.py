"""Megatron-LM core_v0.19.0, the current release, through patches/apply.py on Python 3.12
(.venv312, scripts/setup_env312.sh; CHAMELEON_MEGATRON_LM_019, else ../shared/megatron-lm-0.19
next to the repository): the patch round trip and ``--help``, README's recipe with swap
against the same run without swap, and the run-time refusal of a checkout whose release or
seams were not checked."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Sequence

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lm_support import (  # noqa: E402
    REAL_019, REPO, copy_checkout, double_the_loss, patch, rename_train_model_parameter,
    script_bytes,
)
from test_megatron_lm_real import USER_FLAGS, iterations, readme_recipe  # noqa: E402
from test_megatron_lm_presets import PRESETS, check_preset, probe_presets  # noqa: E402
from test_megatron_lm_yaml import PLACEMENTS, probe_yaml_path  # noqa: E402

REQUIRED = os.environ.get("CHAMELEON_REQUIRE_019") == "1"
"""Set by scripts/test.sh: a missing Python 3.12 or checkout fails these tests, not skips them."""

pytestmark = [
    pytest.mark.skipif(not REQUIRED and sys.version_info < (3, 12), reason=(
        "Megatron-LM 0.19 needs Python >= 3.12 (it imports typing.override): run with "
        ".venv312/bin/python (scripts/setup_env312.sh)")),
    pytest.mark.skipif(not REQUIRED and not REAL_019, reason=(
        "no Megatron-LM 0.19 checkout: set CHAMELEON_MEGATRON_LM_019 or put one next to the "
        "repository (shared/megatron-lm-0.19)")),
    pytest.mark.timeout(600),
]


@pytest.fixture
def checkout(tmp_path):
    """A copy of the 0.19 checkout (the original is never written)."""
    return copy_checkout(tmp_path / "Megatron-LM", REAL_019)


def test_patch_round_trip_and_help(checkout):
    ckpt, env = checkout
    original = script_bytes(ckpt)
    assert patch.megatron_version(ckpt)[:2] == (0, 19)
    assert patch.status(ckpt) == "unpatched"
    assert "+    pretrain = _chameleon_wrap(pretrain)" in patch.diff(ckpt).splitlines()
    assert patch.apply(ckpt) is True
    assert patch.apply(ckpt) is False
    assert patch.status(ckpt) == "patched"
    # 0.19 parses its arguments in __main__, before pretrain(): the flags reach that parse, and
    # Chameleon's check of them ends the run in one line. (Its --help cannot show them: 0.19's
    # own help text of --moe-paged-stash-buffer-size-factor-cuda, "10%)", breaks argparse.)
    run = subprocess.run([sys.executable, "pretrain_gpt.py", *USER_FLAGS, "--chameleon-swap",
                          "--chameleon-swap-budget-fraction", "2"], env=env, cwd=ckpt,
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 2, run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("pretrain_gpt.py: error: "), errors
    assert "swap.budget_fraction=2.0" in errors[0] and "Traceback" not in run.stderr
    assert patch.remove(ckpt) is True
    assert script_bytes(ckpt) == original
    assert patch.status(ckpt) == "unpatched"


def run_job(ckpt: Path, env: dict, *flags: str, nproc: int = 2,
            user_flags: Sequence[str] = USER_FLAGS) -> str:
    """pretrain_gpt.py under torchrun on ``nproc`` CPU ranks; its output."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(nproc), "pretrain_gpt.py", *user_flags, *flags]
    run = subprocess.Popen(cmd, env=env, cwd=ckpt, text=True, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, start_new_session=True)
    try:
        log = run.communicate(timeout=280)[0]
    finally:  # torchrun's workers go with it
        if run.poll() is None:
            os.killpg(run.pid, 9)
            run.wait()
    assert run.returncode == 0, log[-6000:]
    return log


@pytest.mark.serial
def test_readme_recipe_swap_is_bitwise_the_run_without_swap(checkout):
    """README's recipe (PP2, swap) as written on 0.19; the same job without swap gives the
    same losses bit for bit, and Megatron-LM's own log agrees."""
    ckpt, env = checkout
    _, apply, train = readme_recipe()
    here = {**env, "PATH": os.pathsep.join([str(Path(sys.executable).parent), env["PATH"]])}
    for command, cwd in ((apply, Path(patch.__file__).parents[1]), (train, ckpt)):
        run = subprocess.run(["bash", "-c", command.replace("/path/to/Megatron-LM", str(ckpt))],
                             cwd=cwd, env=here, capture_output=True, text=True, timeout=280)
        assert run.returncode == 0, (command, (run.stdout + run.stderr)[-6000:])
    swapped = iterations(ckpt / "runs" / "swap.jsonl")
    assert all(r["swap"]["swapped_out_bytes"] > 0 for r in swapped[1:])
    log = run_job(ckpt, env, "--pipeline-model-parallel-size", "2",
            "--chameleon-metrics-file", str(ckpt / "runs" / "plain.jsonl"))
    plain = iterations(ckpt / "runs" / "plain.jsonl")
    assert [(r["iteration"], r["consumed_samples"], r["layout"]) for r in plain] == [
        (i, 8 * i, {"tp": 1, "pp": 2, "vpp": 1, "dp": 1}) for i in (1, 2, 3, 4)]
    assert [r["loss"] for r in swapped] == [r["loss"] for r in plain]
    assert "no CUDA: Megatron-LM's training runs on the CPU (gloo)" in log
    for i in (0, 2):  # Megatron-LM's own lines for iterations 1 and 3 (one step each)
        assert f"lm loss: {plain[i]['loss']:.6E}" in log


def test_an_updated_checkout_is_refused_at_run_time_in_one_line(checkout):
    """Patched as 0.19, then a seam's signature changed (an updated checkout): pretrain_gpt.py
    stops before any work, one line naming the seam, exit 2."""
    ckpt, env = checkout
    patch.apply(ckpt)
    rename_train_model_parameter(ckpt)
    message = "Megatron-LM 0.19.1: train(forward_step_func, models, "
    run = subprocess.run([sys.executable, "pretrain_gpt.py", *USER_FLAGS], env=env, cwd=ckpt,
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 2, run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("pretrain_gpt.py: error: "), errors
    assert message in errors[0] and "Traceback" not in run.stderr


@pytest.mark.serial
def test_a_killed_rank_recovers_with_the_losses_of_megatron_lms_failure_free_run(checkout,
                                                                                 tmp_path):
    """PP2 x DP2 on 4 ranks under chameleon-run with --chameleon-ft: rank 1 dies in backward
    of step 3, the survivors re-plan (to PP1 x DP2), rebuild through 0.19's
    setup_model_and_optimizer (its config container made again for the new layout) and
    re-enter its train(). Against
    Megatron-LM's failure-free run of the same job (torchrun, no fault tolerance): every step
    once, every loss within 1e-4."""
    from test_megatron_lm_ft import JOB, MEGATRON_ONLY, TOLERANCE, killed_against_plain

    ckpt, env = checkout
    patch.apply(ckpt)
    steps, done = killed_against_plain(checkout, tmp_path, JOB,
                                       "rank=1,iteration=3,phase=backward,kind=exit",
                                       abs=TOLERANCE, ft=MEGATRON_ONLY)
    assert (done["failed_ranks"], done["fallback"], done["redo_iteration"]) == ([1], None, 3)
    assert done["migrated_bytes"] > 0  # the state came from the surviving replica
    # the new layout (PP1 x DP2, one spare) is a model the config container had to describe anew
    assert [(r["layout"]["pp"], r["layout"]["dp"]) for r in steps] == [(2, 2)] * 2 + [(1, 2)] * 4


@pytest.mark.serial
@pytest.mark.parametrize("strategy,mode", [("reroute", "reroute"), ("replan", "hetero")])
def test_a_plan_runs_on_0_19s_loop_with_the_failure_free_losses(checkout, tmp_path,
                                                                strategy, mode):
    """test_megatron_lm_plans on this release: PP2 x DP2, rank 1 killed in step 3, the
    forced strategy runs through the plan runtime with 0.19's datasets (its provider) and LR
    schedule; every step once, every loss within 1e-4 of 0.19's failure-free run. The
    evaluation after step 3 runs in a megatron layout (PP1 x DP2: step 4), the plan
    returns for steps 5 and 6. The script has a loss of its own (``double_the_loss``) and
    model flags chameleon's own trainer does not read (``OWN_MODEL``): the plan's stages are
    0.19's GPT builder's from its config, trained with the script's forward step."""
    from test_megatron_lm_ft import JOB, TOLERANCE, killed_against_plain
    from test_megatron_lm_plans import OWN_MODEL

    ckpt, env = checkout
    patch.apply(ckpt)
    double_the_loss(ckpt)
    steps, done = killed_against_plain(checkout, tmp_path, [*JOB, *OWN_MODEL],
                                       "rank=1,iteration=3,phase=forward,kind=exit",
                                       abs=2 * TOLERANCE,
                                       ft=("--chameleon-ft-strategy", strategy))
    assert (done["decision"]["executed"], done["layout_after"]["mode"]) == (strategy, mode)
    assert [r["world_size"] for r in steps] == [4, 4, 3, 2, 3, 3]


@pytest.mark.serial
def test_a_checkpoint_during_a_plan_resumes_a_fresh_job_on_0_19(checkout, tmp_path):
    """test_megatron_lm_plans' checkpoint during a plan, on this release, the failure in
    step 2 itself (0.16's is in the save after it): rank 1 dies, the heterogeneous re-plan
    redoes the step; the checkpoint after step 2 is 0.19's own,
    written in a megatron layout the job changes to for it, and the plan returns for steps 5
    and 6. A fresh 0.19 job on all 4 ranks (PP2 x DP2) loads it and trains steps 3 to 6:
    every loss within 1e-4 of 0.19's failure-free run."""
    from test_megatron_lm_ft import JOB, TOLERANCE, WORK, iterations, launch, recoveries

    ckpt, env = checkout
    patch.apply(ckpt)
    plain = {r["iteration"]: r["loss"]
             for r in iterations(launch(checkout, tmp_path / "plain.jsonl", 4, ft=False)[0])}
    saved = tmp_path / "ckpt"
    records, log = launch(checkout, tmp_path / "ft.jsonl", 4, "--chameleon-ft",
                          "--chameleon-ft-strategy", "replan", "--save", str(saved),
                          "--save-interval", "2", "--chameleon-inject-fault",
                          "rank=1,iteration=2,phase=forward,kind=exit", job=JOB)
    assert [(r["cause"], r["redo_iteration"] - 1, r["layout_after"]["mode"])
            for r in recoveries(records) if r["cause"] in WORK] == [
        ("work", 2, "megatron"), ("back", 4, "hetero"), ("work", 6, "megatron")]
    for r in iterations(records):
        assert r["loss"] == pytest.approx(plain[r["iteration"]], abs=TOLERANCE), r
    (saved / "latest_checkpointed_iteration.txt").write_text("2")
    resumed, log = launch(checkout, tmp_path / "resumed.jsonl", 4, "--load", str(saved),
                          ft=False)
    again = iterations(resumed)
    assert [r["iteration"] for r in again] == [3, 4, 5, 6], log[-4000:]
    for r in again:
        assert r["loss"] == pytest.approx(plain[r["iteration"]], abs=TOLERANCE), r


@pytest.mark.serial
def test_a_respawned_worker_joins_on_0_19(checkout, tmp_path):
    """0.19's pretrain() takes a joiner as 0.16's does (its initialize_megatron stops short
    of the distributed world; the model comes from 0.19's config container for the layout
    the joiner is given): ``test_megatron_lm_ft.respawned_joins`` on this release."""
    from test_megatron_lm_ft import JOIN_JOB, launch, respawned_joins

    ckpt, env = checkout
    patch.apply(ckpt)
    plain = launch(checkout, tmp_path / "plain.jsonl", 4, ft=False, job=JOIN_JOB)
    respawned_joins(checkout, plain, tmp_path)


@pytest.mark.serial
def test_a_failure_in_the_final_validation_recovers_on_0_19(checkout, tmp_path):
    """0.19's pretrain() runs the same end-of-job work after train() as 0.16's: rank 1 dies
    as its evaluation on the validation set after step 6 starts, the survivors redo it in
    the new layout, then evaluate the test set; every loss, and both end-of-job
    evaluations, equal Megatron-LM's failure-free run within 1e-4."""
    from test_megatron_lm_ft import FINAL, killed_at_the_end, launch
    from test_megatron_lm_ft import iterations as steps_of

    ckpt, env = checkout
    patch.apply(ckpt)
    records, log = launch(checkout, tmp_path / "plain.jsonl", 4, ft=False)
    finals = FINAL.findall(log)
    assert [f[:2] for f in finals] == [("6", "validation"), ("6", "test")]
    reference = ({r["iteration"]: r["loss"] for r in steps_of(records)}, {}, finals)
    _, log = killed_at_the_end(checkout, reference, tmp_path,
                               "rank=1,iteration=6,phase=final-eval,kind=exit")
    assert "the work after step 6 is redone from its final validation" in log


@pytest.mark.parametrize(("placement", "error"), PLACEMENTS)
def test_megatron_lms_yaml_path_cannot_start_a_gpt_job_on_0_19(tmp_path, placement, error):
    """The reason ``--yaml-cfg`` is refused holds on 0.19 too (test_megatron_lm_yaml.py)."""
    probe_yaml_path(REAL_019, tmp_path, placement, error)


@pytest.fixture(scope="module")
def parsed_presets_019() -> dict[str, dict]:
    return probe_presets(REAL_019)


@pytest.mark.parametrize("preset", PRESETS, ids=[p.stem for p in PRESETS])
def test_every_preset_is_read_by_0_19s_parser(parsed_presets_019, preset):
    check_preset(parsed_presets_019, preset)


@pytest.mark.serial
def test_the_cpu_preset_trains_on_0_19(checkout, tmp_path):
    """configs/tiny-cpu.yaml through 0.19's pretrain_gpt.py on 4 ranks: its megatron
    section is the job (TP2 x PP2, its batch sizes), command-line flags win over it."""
    ckpt, env = checkout
    patch.apply(ckpt)
    out = tmp_path / "tiny.jsonl"
    run_job(ckpt, env, "--chameleon-config", str(REPO / "configs" / "tiny-cpu.yaml"),
            "--tokenizer-type", "NullTokenizer", "--train-iters", "2", "--lr-warmup-iters", "1",
            "--eval-iters", "1", "--log-interval", "1", "--chameleon-metrics-file", str(out),
            nproc=4, user_flags=())
    assert [(r["iteration"], r["consumed_samples"], r["layout"]) for r in iterations(out)] == [
        (i, 16 * i, {"tp": 2, "pp": 2, "vpp": 1, "dp": 1}) for i in (1, 2)]
