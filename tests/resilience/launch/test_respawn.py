"""chameleon-run restarts a failed worker's slot as a joiner: a new process, same command line
and environment, a fresh launch-rank id (CHAMELEON_FT_JOIN_ID), monitored like the others."""

from __future__ import annotations

import datetime
import json
import re
import sys
import textwrap
from pathlib import Path

import pytest
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rt_support import run_launcher  # noqa: E402

from chameleon_megatron.resilience.store.env import JOIN_ENV
from chameleon_megatron.resilience.store.job_store import JobStore
from chameleon_megatron.resilience.store.joiners import allocate_join_id, join_id_from_env

pytestmark = [pytest.mark.timeout(150), pytest.mark.serial]

# Start-up covers importing torch on a loaded 2-core machine (tens of seconds at worst).
FT = ["--chameleon-ft", "--chameleon-ft-startup-timeout-s", "90",
      "--chameleon-ft-respawn-delay-s", "0.5"]

# argv: OUT_DIR FAILS WAIT_S EXPECT. FAILS is "ID:exit|hang|exit-when-done,...", keyed by RANK
# or by a restarted worker's join id. A joiner that does not fail at once writes
# OUT_DIR/joiner-<id>.json. Rank 0 waits for a failure, then up to WAIT_S for a joiner, marks
# the job done, waits for EXPECT failures and past the restart delay, and writes what the job
# store holds to OUT_DIR/report.json.
WORKER = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    from rt_support import guard_worker
    guard_worker(90)
    from chameleon_megatron.resilience.store.announce import read_failures
    from chameleon_megatron.resilience.store.heartbeat import Heartbeat, dump_stacks_on_request
    from chameleon_megatron.resilience.store.job_store import JobStore
    from chameleon_megatron.resilience.store.joiners import join_id_from_env

    def wait_for(condition, seconds):
        deadline = time.monotonic() + seconds
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.1)

    out, wait_s, expect = Path(sys.argv[1]), float(sys.argv[3]), int(sys.argv[4])
    fails = dict(f.split(":") for f in sys.argv[2].split(",") if f)
    join_id = join_id_from_env()
    me = int(os.environ["RANK"]) if join_id is None else join_id
    job = JobStore.from_env()
    how = fails.get(str(me))
    Heartbeat.from_env(me).beat(timeout_s=1.0 if how == "hang" else 60.0)
    if how == "exit":
        sys.exit(3)
    if how == "hang":
        dump_stacks_on_request()
        def hung_here():
            time.sleep(3600)
        hung_here()
    seen = {{k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}}
    if join_id is not None:
        (out / f"joiner-{{join_id}}.json").write_text(json.dumps({{"argv": sys.argv, "env": seen}}))
        wait_for(job.is_done, 60 if how == "exit-when-done" else 0)
        sys.exit(3 if how == "exit-when-done" else 0)
    wait_for(lambda: read_failures(job), 60)
    wait_for(lambda: list(out.glob("joiner-*.json")), wait_s)
    job.mark_done()
    wait_for(lambda: len(read_failures(job)) >= expect, 60)
    time.sleep(1.0)  # past the restart delay: a restart now would already be spawned
    spawned = {{}}
    for i in range(2, 6):
        if job.store.check([f"join/spawned/{{i}}"]):
            spawned[i] = json.loads(job.store.get(f"join/spawned/{{i}}"))
    failures = [json.loads(r.to_json()) for r in read_failures(job)]
    (out / "report.json").write_text(json.dumps(
        {{"argv": sys.argv, "env": seen, "failures": failures, "spawned": spawned}}))
""")


def _launch(tmp_path: Path, fails: str, *, wait_s: float, expect: int, respawns: int) -> dict:
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(tests=str(Path(__file__).resolve().parents[1])))
    args = ["--standalone", "--nproc-per-node=2", "--monitor-interval=0.1", str(script),
            str(tmp_path), fails, str(wait_s), str(expect),
            *FT, "--chameleon-ft-respawns", str(respawns)]
    code, _ = run_launcher(args, tmp_path / "log", timeout_s=110)
    log = (tmp_path / "log").read_text()
    assert code == 0, log[-3000:]
    assert (tmp_path / "report.json").exists(), log[-3000:]
    return json.loads((tmp_path / "report.json").read_text())


def _joiner(tmp_path: Path, join_id: int) -> dict:
    return json.loads((tmp_path / f"joiner-{join_id}.json").read_text())


@pytest.mark.multiproc
def test_a_failed_worker_is_restarted_once_as_a_joiner(tmp_path: Path) -> None:
    report = _launch(tmp_path, "1:exit", wait_s=60, expect=1, respawns=1)
    failures = report["failures"]
    assert [(f["rank"], f["reason"], f["exitcode"]) for f in failures] == [(1, "exit", 3)]
    joiner = _joiner(tmp_path, 2)  # WORLD_SIZE 2 + the job's first join
    assert joiner["argv"] == report["argv"]  # same command line as the launched workers
    assert joiner["env"] == {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                             "MASTER_PORT": report["env"]["MASTER_PORT"]}
    assert list(report["spawned"]) == ["2"]
    spawned = report["spawned"]["2"]
    assert spawned["failed"] == 1 and spawned["node"]
    assert spawned["time"] - failures[0]["time"] >= 0.5  # the restart delay was honoured
    assert sorted(p.name for p in tmp_path.glob("joiner-*")) == ["joiner-2.json"]


@pytest.mark.multiproc
def test_without_respawns_nothing_is_restarted(tmp_path: Path) -> None:
    report = _launch(tmp_path, "1:exit", wait_s=3, expect=1, respawns=0)
    assert [f["rank"] for f in report["failures"]] == [1]
    assert report["spawned"] == {}
    assert not list(tmp_path.glob("joiner-*"))


@pytest.mark.multiproc
def test_a_silent_joiner_is_killed_announced_and_restarted_in_turn(tmp_path: Path) -> None:
    """Rank 1 exits; its joiner 2 beats once (1 s timeout) and hangs (its agent has it write
    its stacks before the kill); joiner 3 works, then fails once the job is done: with budget
    left, it is still not restarted."""
    report = _launch(tmp_path, "1:exit,2:hang,3:exit-when-done", wait_s=60, expect=3,
                     respawns=3)
    failures = {f["rank"]: f for f in report["failures"]}
    assert sorted(failures) == [1, 2, 3]
    silent = failures[2]
    assert (silent["reason"], silent["signal"]) == ("heartbeat", "SIGKILL")
    assert silent["time"] - silent["last_seen"] >= 1.0
    log = (tmp_path / "log").read_text()  # where it hung, asked for before the kill
    assert re.search(r'File ".*worker.py", line \d+ in hung_here', log), log[-3000:]
    assert (failures[3]["reason"], failures[3]["exitcode"]) == ("exit", 3)
    assert {i: s["failed"] for i, s in report["spawned"].items()} == {"2": 1, "3": 2}
    assert _joiner(tmp_path, 3)["env"]["RANK"] == "1"
    assert sorted(p.name for p in tmp_path.glob("joiner-*")) == ["joiner-3.json"]


@pytest.mark.parametrize("backend", ["hash", "tcp"])
def test_join_ids_are_distinct_and_follow_the_launch_ranks(backend: str) -> None:
    if backend == "hash":
        store: dist.Store = dist.HashStore()
    else:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True,
                              timeout=datetime.timedelta(seconds=10))
    agent_a, agent_b = JobStore(store, "run-x"), JobStore(store, "run-x")
    ids = [allocate_join_id(agent_a, 4), allocate_join_id(agent_b, 4), allocate_join_id(agent_a, 4)]
    assert ids == [4, 5, 6]
    assert allocate_join_id(JobStore(store, "run-y"), 4) == 4  # another run counts on its own
    with pytest.raises(ValueError, match="launch_world_size=0: must be >= 1"):
        allocate_join_id(agent_a, 0)


def test_join_id_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(JOIN_ENV, raising=False)
    assert join_id_from_env() is None
    monkeypatch.setenv(JOIN_ENV, "7")
    assert join_id_from_env() == 7
    for bad, limit in [("seven", "must be an integer"), ("", "must be an integer"),
                       ("0", "must be >= 1"), ("-2", "must be >= 1")]:
        monkeypatch.setenv(JOIN_ENV, bad)
        with pytest.raises(ValueError, match=f"CHAMELEON_FT_JOIN_ID='{bad}': {limit}"):
            join_id_from_env()


def test_respawn_config_is_checked() -> None:
    from chameleon_megatron.run import ft_config

    ft = ft_config(["--chameleon-ft-respawns", "2", "--chameleon-ft-respawn-delay-s", "0.25"])
    assert (ft.respawns, ft.respawn_delay_s) == (2, 0.25)
    with pytest.raises(ValueError, match=r"ft.respawns=-1: must be >= 0"):
        ft_config(["--chameleon-ft-respawns", "-1"])
    with pytest.raises(ValueError, match=r"ft.respawn_delay_s=-0.5: must be >= 0"):
        ft_config(["--chameleon-ft-respawn-delay-s", "-0.5"])
