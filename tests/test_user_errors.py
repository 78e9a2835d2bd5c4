"""A user's mistake ends every entry with one ``<prog>: error:`` line naming the flag, file
(with line) or value, exit 2, no traceback, and before the model is built where it is known
then (chameleon, chameleon-pretrain-gpt, chameleon-run)."""

import json
import sys
from pathlib import Path

import pytest

from chameleon_megatron import cli
from chameleon_megatron.metrics_file import MetricsWriter, read_metrics, run_ids
from chameleon_megatron.resilience.decision.metrics_profile import read_run
from dist_utils import run_command

pytestmark = pytest.mark.timeout(240)

REPO = Path(__file__).resolve().parents[1]
PROFILE = str(REPO / "configs" / "profiles" / "gpt-7b-h100.json")
PLAN = ["plan", "--profile", PROFILE, "--layout", "tp=1,pp=2,dp=4"]
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--vocab-size", "64", "--micro-batch-size", "1",
        "--train-iters", "2"]
BUILT = "start: GPT"  # the line the trainer logs once the model is built (must not appear)


def _cli_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"chameleon {argv[0]}: error: "), err
    return err


@pytest.fixture
def bad_files(tmp_path: Path) -> Path:
    (tmp_path / "bad.yaml").write_text("sim:\n  tp: [1, 2\n  pp: 3\n")
    (tmp_path / "bad.json").write_text('{"layers":\n')
    (tmp_path / "cut.jsonl").write_text('{"event": "run", "run_id": 1}\n{"event": "iterat')
    return tmp_path


@pytest.mark.parametrize("argv,expected", [
    (["--failed", "5,abc"], "--failed '5,abc': 'abc' is not an integer"),
    (["--failed", ""], "--failed '': name at least one failed rank"),
    (["--failed", "9"], "--failed: ranks [9] are not in the layout (ranks 0..7)"),
    (["--failed", "1", "--swap-bandwidth-gbps", "-1"], "--swap-bandwidth-gbps=-1.0: must be >= 0"),
])
def test_plan_flag_mistakes(argv, expected, capsys):
    assert expected in _cli_error(PLAN + argv, capsys)


def test_plan_layout_that_does_not_fit_the_profile(capsys):
    err = _cli_error(["plan", "--profile", PROFILE, "--layout", "tp=1,pp=3,dp=4",
                      "--failed", "1"], capsys)
    assert "--layout tp=1,pp=3,dp=4 with the 32 layers of --profile" in err


def test_missing_files_are_named(tmp_path, capsys):
    missing = str(tmp_path / "nope")
    for argv in (["plan", "--profile", missing, "--layout", "tp=1,pp=2,dp=4", "--failed", "1"],
                 ["simulate", "--preset", missing + ".yaml"],
                 ["simulate", "--preset", "32", "--trace", missing + ".json"],
                 ["report", missing + ".jsonl"],
                 ["profile", "--metrics", missing + ".jsonl", "-o", str(tmp_path / "p.json")]):
        assert f"{missing}" in _cli_error(argv, capsys)
        assert "no such file or directory" in _cli_error(argv, capsys)


def test_malformed_files_are_named_with_their_line(bad_files, capsys):
    d = bad_files
    assert f"{d}/bad.yaml:3: not valid YAML" in _cli_error(
        ["simulate", "--preset", str(d / "bad.yaml")], capsys)
    assert f"{d}/bad.json:2: not valid JSON" in _cli_error(
        ["plan", "--profile", str(d / "bad.json"), "--layout", "tp=1,pp=2,dp=4",
         "--failed", "1"], capsys)
    assert f"{d}/bad.json:2: not valid JSON" in _cli_error(
        ["simulate", "--preset", "32", "--trace", str(d / "bad.json")], capsys)
    for argv in (["report", str(d / "cut.jsonl")],
                 ["profile", "--metrics", str(d / "cut.jsonl"), "-o", str(d / "p.json")]):
        assert f"{d}/cut.jsonl:2: not a JSON record" in _cli_error(argv, capsys)


def test_verbose_keeps_the_traceback(tmp_path):
    with pytest.raises(FileNotFoundError):
        cli.main(["-v", "report", str(tmp_path / "nope.jsonl")])


def test_a_bug_is_not_worded_as_a_users_mistake(monkeypatch):
    from chameleon_megatron.commands import plan

    def broken(args):
        raise KeyError("internal")

    monkeypatch.setattr(plan, "run", broken)
    with pytest.raises(KeyError):
        cli.main(PLAN + ["--failed", "1"])


# ------------------------------------------------------------------ the trainer's entries
def _entry(argv: list[str], *, launcher: bool = False, check: bool = False) -> str:
    prefix = ([sys.executable, "-m", "chameleon_megatron.run", "--nproc-per-node", "2", "-m"]
              if launcher else [sys.executable, "-m"])
    return run_command([*prefix, "chameleon_megatron.pretrain_gpt", *argv], timeout=180,
                       check=check)


def _one_error_line(out: str, prog: str) -> str:
    lines = [line for line in out.splitlines() if "error" in line.lower()]
    assert len(lines) == 1 and "Traceback" not in out and BUILT not in out, out
    assert lines[0].startswith(f"{prog}: error: "), out
    return lines[0]


@pytest.mark.parametrize("argv,expected", [
    (["--data-path", "/no/such/prefix"],
     "--data-path /no/such/prefix: no /no/such/prefix.bin or /no/such/prefix.idx"),
    (["--mock-data", "--chameleon-ft"], "--chameleon-ft: needs the chameleon-run launcher"),
    (["--mock-data", "--chameleon-ft-join"], "ft.join=True: joins a fault-tolerant job: give "
                                             "--chameleon-ft too"),
    (["--mock-data", "--chameleon-ft-shard-replica-interval", "0"],
     "ft.shard_replica_interval=0: must be >= 1"),
    (["--mock-data", "--chameleon-ft-strategy", "reroute", "--no-chameleon-ft-plans"],
     "ft.strategy='reroute': reroutes through the plan runtime, which ft.plans=false turns off"),
    (["--mock-data", "--chameleon-inject-fault", "rank=1,iteration=1,phase=forward,kind=exit"], "give --chameleon-ft too"),
])
def test_trainer_refuses_before_building_the_model(argv, expected):
    assert expected in _one_error_line(_entry(TINY + argv), "chameleon-pretrain-gpt")


@pytest.mark.parametrize("argv,expected", [
    (["--pipeline-model-parallel-size", "3"], "world size 2 is not divisible"),
    (["--tensor-model-parallel-size", "2", "--num-experts", "2", "--disable-bias-linear"],
     "--num-experts with --tensor-model-parallel-size=2 needs --sequence-parallel"),
    (["--sequence-parallel"], "--sequence-parallel needs --tensor-model-parallel-size > 1"),
    (["--chameleon-ft", "--chameleon-inject-fault",
      "rank=1,iteration=2,phase=final-eval,kind=exit"],
     "phase=final-eval fires in the work Megatron-LM's pretrain() does after its loop"),
])
def test_chameleon_run_checks_the_training_args_before_any_worker_starts(argv, expected):
    line = _one_error_line(_entry(TINY + ["--mock-data", *argv], launcher=True),
                           "chameleon-run")
    assert expected in line


@pytest.mark.parametrize("launch,expected", [
    (["--nproc-per-node", "0"], "--nproc-per-node=0: must be >= 1"),
    (["--nproc-per-node", "2", "--nnodes", "0"], "--nnodes=0: every bound must be >= 1"),
    (["--nproc-per-node", "2", "--nnodes", "0:2"], "--nnodes=0:2: every bound must be >= 1"),
])
def test_chameleon_run_refuses_an_empty_world(launch, expected):
    for ft in ([], ["--chameleon-ft"]):
        out = run_command([sys.executable, "-m", "chameleon_megatron.run", *launch, "-m",
                           "chameleon_megatron.pretrain_gpt", *TINY, "--mock-data", *ft],
                          timeout=120, check=False)
        assert expected in _one_error_line(out, "chameleon-run")


def test_chameleon_run_reports_a_failed_worker_in_one_line(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import os, sys\nif os.environ['RANK'] == '1':\n"
                      "    print('worker says why', file=sys.stderr)\n    sys.exit(3)\n")
    out = run_command([sys.executable, "-m", "chameleon_megatron.run", "--nproc-per-node", "2",
                       str(script)], timeout=120, check=False)
    assert "worker says why" in out and "Traceback" not in out, out
    assert [line for line in out.splitlines() if "error" in line.lower()] == [
        line for line in out.splitlines() if line.startswith("chameleon-run: error: worker "
                                                            "rank 1 (local rank 1, pid ")], out


def test_metrics_file_of_another_run_is_refused_unless_appended(tmp_path):
    metrics = str(tmp_path / "m.jsonl")
    argv = TINY + ["--mock-data", "--chameleon-metrics-file", metrics]
    _entry(argv, check=True)
    line = _one_error_line(_entry(argv), "chameleon-pretrain-gpt")
    assert f"--chameleon-metrics-file {metrics}: already holds a run" in line
    _entry(argv + ["--chameleon-metrics-append", "--seed", "7"], check=True)
    assert run_ids(metrics) == [1, 2]
    first, last = read_metrics(metrics, "iteration", run=1), read_metrics(metrics, "iteration")
    assert [r["iteration"] for r in first] == [r["iteration"] for r in last] == [1, 2]
    assert {r["run_id"] for r in last} == {2} and first[0]["loss"] != last[0]["loss"]
    assert read_run(metrics, 1).args["seed"] != read_run(metrics).args["seed"] == 7


def test_readers_take_one_run_of_a_file(tmp_path):
    path = tmp_path / "m.jsonl"
    for loss in (1.0, 2.0):
        writer = MetricsWriter(str(path))
        writer.write({"event": "run", "args": {}})
        writer.write({"event": "iteration", "iteration": 1, "loss": loss})
        writer.close()
    assert [json.loads(x)["run_id"] for x in path.read_text().splitlines()] == [1, 1, 2, 2]
    assert [r["loss"] for r in read_metrics(path, "iteration")] == [2.0]
    assert [r["loss"] for r in read_metrics(path, "iteration", run=1)] == [1.0]
    with pytest.raises(ValueError, match=r"no run 3 \(runs: \[1, 2\]\)"):
        read_metrics(path, run=3)


def test_the_failed_worker_named_is_the_one_that_exited_not_one_the_launcher_stopped():
    """torchrun stops the other workers once one fails; on a loaded machine a lower rank is
    still running then and ends by SIGTERM: the line names the worker that exited itself."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from chameleon_megatron.run import worker_failure

    failures = {0: ProcessFailure(local_rank=0, pid=10, exitcode=-15, error_file="<N/A>"),
                1: ProcessFailure(local_rank=1, pid=11, exitcode=3, error_file="<N/A>")}
    message, code = worker_failure(ChildFailedError("fail.py", failures))
    assert message.startswith("worker rank 1 (local rank 1, pid 11) exited with code 3 "
                              "(and 1 more)") and code == 3, message
