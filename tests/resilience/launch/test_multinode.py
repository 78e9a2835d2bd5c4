"""``scripts/launch_multinode.sh`` over a real network: a node that joins the running job.

Three network-namespace hosts with their own addresses (``netns_support``). Hosts 0 and 1
start the job (static rendezvous, one gloo worker each, DP2); host 1's worker exits in
step 3 and host 0 trains on alone; then host 2 runs the same script with
``--chameleon-ft-join``: its agent finds the job store at host 0's address, registers as the
next agent, and its worker is admitted between two steps, so the job grows back to two
ranks. Every step runs once, with the failure-free run's loss. (A node lost and the store's
host lost, over the same hosts: ``test_partition.py``.)
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from e2e_support import assert_losses_match, faults, records, run_reference  # noqa: E402
from multinode_support import BATCH, running, start_node, wait_for  # noqa: E402
from netns_support import hosts  # noqa: E402

pytestmark = [pytest.mark.multiproc, pytest.mark.serial, pytest.mark.timeout(420)]

ITERS = 100
"""Steps of at least 0.3 s: the joining node (10-20 s to start on a loaded machine) is
admitted well before the end."""


def _recoveries(tmp: Path) -> list[dict]:
    metrics = tmp / "metrics.jsonl"
    return [r for r in records(metrics) if r["event"] == "recovery"] if metrics.exists() \
        else []


def test_a_node_joins_the_running_job_over_the_network(tmp_path: Path) -> None:
    (tmp_path / "reference").mkdir()
    ref_losses, _ = run_reference(tmp_path / "reference", ITERS, flags=tuple(BATCH))
    flags = [*faults("rank=1,iteration=3,phase=forward,kind=exit"),
             "--chameleon-ft-mtbf-prior-s", "1e9"]
    with hosts(3) as (h0, h1, h2), \
            running(tmp_path, (h0, h1), 29403, flags, iters=ITERS) as procs:
        wait_for(lambda: bool(_recoveries(tmp_path)), 200, procs[:1])
        procs.append(start_node(h2, tmp_path, 2, 2, h0, 29403, [*flags, "--chameleon-ft-join"],
                                ITERS))
        assert procs[0].wait(timeout=300) == 0, (tmp_path / "log0").read_text()[-6000:]
        assert procs[2].wait(timeout=60) == 0, (tmp_path / "log2").read_text()[-6000:]
    recs = records(tmp_path / "metrics.jsonl")
    assert assert_losses_match(recs, ref_losses) == list(range(1, ITERS + 1))
    failure, join = [r for r in recs if r["event"] == "recovery"]
    assert failure["failed_ranks"] == [1], failure
    assert join["cause"] == "join" and join["joined"] == [2], join
    grown = [r for r in recs if r["event"] == "iteration" and r["world_size"] == 2
             and r["iteration"] >= join["redo_iteration"]]
    assert grown and grown[-1]["iteration"] == ITERS
    assert '"event": "node_join", "group_rank": 2' in (tmp_path / "log2").read_text()
    for log in ("log0", "log1", "log2"):  # every host names its peers (netns_support)
        assert "hostname of the client socket cannot be retrieved" not in \
            (tmp_path / log).read_text(), log
