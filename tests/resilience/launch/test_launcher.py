"""chameleon-run: survivors outlive a failed worker and read its announcement; plain mode is
torchrun; a silent worker is killed; a lost node is announced by the other agent.

Run as a script, this file is the worker program of these tests.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rt_support import free_port, guard_worker, run_launcher, start_launcher, stop  # noqa: E402

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300), pytest.mark.serial]

# Start-up covers importing torch on a loaded 2-core machine (tens of seconds at worst).
FT = ["--chameleon-ft", "--chameleon-ft-startup-timeout-s", "90"]


def worker_main(argv: list[str]) -> int:
    """fail: this rank's way to fail (exit|kill|hang|none); rank 0 (or --watch) waits for
    --expect announcements and writes them to --out/<rank>.json."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--fail", action="append", default=[], help="RANK:exit|kill|hang")
    parser.add_argument("--expect", type=int, default=0)
    parser.add_argument("--linger", type=float, default=0.0)
    args, _ = parser.parse_known_args(argv)
    guard_worker(60)
    rank = int(os.environ["RANK"])
    how = dict(f.split(":") for f in args.fail).get(str(rank), "none")
    if os.environ.get("CHAMELEON_FT_AGENT") != "1":
        if how == "exit":
            return 7
        time.sleep(args.linger)  # plain torchrun: the agent should end this sleep
        (args.out / f"{rank}.json").write_text("[]")
        return 0
    from chameleon_megatron.resilience.store.announce import read_failures
    from chameleon_megatron.resilience.store.heartbeat import Heartbeat
    from chameleon_megatron.resilience.store.job_store import JobStore

    job = JobStore.from_env()
    Heartbeat.from_env(rank).beat(timeout_s=1.0 if how == "hang" else 30.0)
    (args.out / f"started-{rank}").touch()
    time.sleep(0.5)
    if how == "exit":  # leaving a helper behind, as checkpoint writers' managers would
        helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        (args.out / f"helper-{rank}").write_text(str(helper.pid))
        return 7
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "hang":
        time.sleep(3600)
    found = []
    deadline = time.monotonic() + 40
    while len(found) < args.expect and time.monotonic() < deadline:
        found = read_failures(job)
        time.sleep(0.1)
    (args.out / f"{rank}.json").write_text(json.dumps([json.loads(r.to_json()) for r in found]))
    time.sleep(args.linger)
    return 0


def _launch_args(nproc: int, tmp_path: Path, *worker_args: str) -> list[str]:
    return ["--standalone", f"--nproc-per-node={nproc}", "--monitor-interval=0.1",
            __file__, "--out", str(tmp_path), *worker_args]


def test_survivors_outlive_failures_and_read_each_announcement(tmp_path: Path) -> None:
    args = _launch_args(4, tmp_path, "--fail", "1:exit", "--fail", "2:hang", "--fail", "3:kill",
                        "--expect", "3", *FT)
    code, seconds = run_launcher(args, tmp_path / "log", timeout_s=240)
    log = (tmp_path / "log").read_text()
    assert code == 0, log[-3000:]
    records = {r["rank"]: r for r in json.loads((tmp_path / "0.json").read_text())}
    assert sorted(records) == [1, 2, 3], log[-3000:]
    assert (records[1]["reason"], records[1]["exitcode"]) == ("exit", 7)
    assert (records[3]["reason"], records[3]["signal"]) == ("signal", "SIGKILL")
    hang = records[2]
    assert hang["reason"] == "heartbeat"
    # declared after its 1 s heartbeat timeout, within a few monitor intervals
    assert 1.0 <= hang["time"] - hang["last_seen"] < 5.0
    assert not (tmp_path / "1.json").exists() and not (tmp_path / "2.json").exists()
    helper = int((tmp_path / "helper-1").read_text())  # the failed worker's session went too
    assert not Path(f"/proc/{helper}").exists() or "Z" in _state(helper)


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_without_chameleon_ft_it_is_plain_torchrun(tmp_path: Path) -> None:
    """One failure stops every worker (torchrun's behaviour) and the launch fails."""
    args = _launch_args(2, tmp_path, "--fail", "1:exit", "--linger", "150")
    code, seconds = run_launcher(args, tmp_path / "log", timeout_s=240)
    assert code != 0
    assert seconds < 120, "the survivor should have been stopped, not left to finish"
    assert not (tmp_path / "0.json").exists()


@pytest.mark.parametrize("flag, message", [
    ("--max-restarts=2", "--max-restarts=2: must be 0 with --chameleon-ft"),
    ("--run-path", "--run-path: not supported with --chameleon-ft"),
])
def test_ft_launch_refuses_options_that_undo_recovery(flag: str, message: str) -> None:
    import torch.distributed.run as torchrun

    from chameleon_megatron.run import check_ft_launch, ft_config

    args = torchrun.parse_args(["--nproc-per-node=2", flag, "train.py", "--chameleon-ft"])
    assert ft_config(args.training_script_args).enabled
    with pytest.raises(ValueError, match=message):
        check_ft_launch(args)
    plain = torchrun.parse_args(["--nproc-per-node=2", "train.py", "--lr", "1e-4"])
    assert not ft_config(plain.training_script_args).enabled


def test_a_joining_node_finds_the_job_store_at_the_rendezvous_endpoint() -> None:
    import torch.distributed.run as torchrun

    from chameleon_megatron.run import ft_config
    from chameleon_megatron.resilience.launch.join_node import store_endpoint

    def parse(*flags: str):  # type: ignore[no-untyped-def]
        return torchrun.parse_args([*flags, "train.py", "--chameleon-ft", "--chameleon-ft-join"])

    static = parse("--master-addr=10.0.0.5", "--master-port=29511", "--rdzv-id=job")
    assert ft_config(static.training_script_args).join
    assert store_endpoint(static) == ("10.0.0.5", 29511)
    c10d = parse("--rdzv-backend=c10d", "--rdzv-endpoint=head:29600", "--rdzv-id=job")
    assert store_endpoint(c10d) == ("head", 29600)
    assert store_endpoint(parse("--rdzv-backend=c10d", "--rdzv-endpoint=head")) == ("head", 29400)
    with pytest.raises(ValueError, match="--standalone with --chameleon-ft-join"):
        store_endpoint(parse("--standalone"))


def test_a_node_waiting_at_the_rendezvous_does_not_restart_the_workers(
        caplog: pytest.LogCaptureFixture) -> None:
    """torch's agent restarts every worker when a node waits at the rendezvous; ours keeps
    them and says how to join (once)."""
    from chameleon_megatron.resilience.launch.agent import ChameleonAgent

    agent = ChameleonAgent.__new__(ChameleonAgent)  # only the restart step is exercised
    agent._told_waiting = False
    with caplog.at_level("ERROR"):
        agent._restart_workers(None)  # torch's would stop and re-rendezvous the group
        agent._restart_workers(None)
    assert [r.message for r in caplog.records if "--chameleon-ft-join" in r.message] == [
        "a node is waiting at the rendezvous: the workers are not restarted; start it with "
        "--chameleon-ft-join to join the running job"]


def test_a_lost_node_is_announced_by_the_other_agent(tmp_path: Path) -> None:
    """Two agents (nodes) of one worker each; node 1's agent is killed with its worker."""
    common = ["--nnodes=2", "--nproc-per-node=1", "--master-addr=127.0.0.1",
              f"--master-port={free_port()}", "--rdzv-id=rt-node", "--monitor-interval=0.1",
              __file__, "--out", str(tmp_path), "--expect", "1", "--linger", "1",
              *FT, "--chameleon-ft-node-timeout-s", "2"]
    node0 = start_launcher(["--node-rank=0", *common], tmp_path / "log0")
    node1 = start_launcher(["--node-rank=1", *common], tmp_path / "log1")
    try:
        deadline = time.monotonic() + 40
        while not (tmp_path / "started-1").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)  # both agents have beaten at least once
        # the agent; its worker (own session) exits when it sees its parent gone
        os.killpg(node1.pid, signal.SIGKILL)
        code = node0.wait(timeout=45)
    finally:
        stop(node0)
        stop(node1)
    log = (tmp_path / "log0").read_text()
    assert code == 0, log[-3000:]
    records = json.loads((tmp_path / "0.json").read_text())
    assert [(r["rank"], r["reason"]) for r in records] == [(1, "node")], log[-3000:]


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
