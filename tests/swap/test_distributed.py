"""Swap through the trainer on 2 gloo processes: bitwise equal to the same run without swap.

One launch trains every layout twice (without, then with swap) in one process group, so the
start-up cost is paid once; each layout is then checked by its own test.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(400)]

REPO = Path(__file__).resolve().parents[2]
SWAP = ["--chameleon-swap", "--chameleon-swap-min-tensor-bytes", "256"]
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform",
             "--recompute-num-layers", "1"]
LAYOUTS = {
    "tp2": ["--tensor-model-parallel-size", "2"],
    "pp2_1f1b": ["--pipeline-model-parallel-size", "2"],
    "pp2_vpp2": ["--pipeline-model-parallel-size", "2",
                 "--num-layers-per-virtual-pipeline-stage", "1"],
    "dp2": [],
    "dp2_full_recompute": RECOMPUTE,
}
# With full recompute the backward re-creates most saved bytes, which cannot be swapped.
BUDGET = {name: "0.9" if name.endswith("recompute") else "0.5" for name in LAYOUTS}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("swap_dist")
    layouts = {name: {"flags": flags + ["--data-cache-path", str(out / "cache")],
                      "swap": SWAP + ["--chameleon-swap-budget-fraction", BUDGET[name]]}
               for name, flags in LAYOUTS.items()}
    port = _free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        log = open(out / f"log{rank}.txt", "w")
        procs.append(subprocess.Popen(
            [sys.executable, str(REPO / "tests/swap/dist_worker.py"), str(out),
             json.dumps(layouts)], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True))
    try:
        codes = [p.wait(timeout=360) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    if codes != [0, 0]:
        logs = "\n".join((out / f"log{r}.txt").read_text()[-3000:] for r in range(2))
        pytest.fail(f"workers exited with {codes}:\n{logs}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_losses_and_gradients_bitwise_equal(results, layout):
    swapped = 0
    for rank, res in enumerate(results):
        off, on = res[layout]["off"], res[layout]["on"]
        assert len(off) == len(on) == 3
        # The loss is global and the gradient norm is all-reduced: any difference in any
        # gradient of any rank would show in both, and in every later step's loss.
        assert [(r["loss"], r["grad_norm"]) for r in off] == \
            [(r["loss"], r["grad_norm"]) for r in on], f"rank {rank}"
        for step, r in enumerate(on):
            m = r["swap"]
            assert m["live_entries"] == 0 and m["host_buffers_live"] == 0
            if step > 0:
                assert m["plan_version"] == 1 and m["mode"] == "light"
                assert m["peak_resident_saved_bytes"] <= m["budget_bytes"]
                assert m["matched"] >= 0.99 * m["planned_tensors"]
                swapped += m["swapped_out_bytes"]
    assert swapped > 0
