"""A checkpoint save cut off between its write and its finalization leaves its write results
in megatron's queue; the redo of that save must not read them (``megatron/ckpt_writes``)."""

from __future__ import annotations

import queue
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from chameleon_megatron.megatron.ckpt_writes import check_write_queue, drop_abandoned_writes

pytestmark = pytest.mark.timeout(240)
WORKER = Path(__file__).with_name("ckpt_redo_worker.py")


def _redo(tmp_path: Path, case: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(WORKER), str(tmp_path), case, *extra],
                          capture_output=True, text=True, timeout=200)


@pytest.mark.parametrize("case", ["fewer", "same"])
def test_the_redo_of_a_save_cut_off_after_its_write_loads(tmp_path: Path, case: str) -> None:
    done = _redo(tmp_path, case)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "dropped 1" in done.stdout and "redo loaded" in done.stdout


@pytest.mark.parametrize("case", ["fewer", "same"])
def test_without_the_drop_megatron_s_redo_reads_the_abandoned_results(
        tmp_path: Path, case: str) -> None:
    """0.16: "fewer" fails in the save ("Incomplete worker results"), "same" writes a
    checkpoint whose files cannot be read; 0.19 writes both, and neither loads."""
    done = _redo(tmp_path, case, "--no-drop")
    assert done.returncode != 0 and "redo loaded" not in done.stdout, done.stdout
    assert "Incomplete worker results" in done.stderr or "Error" in done.stderr


def test_a_queue_whose_manager_is_gone_is_forgotten() -> None:
    class Broken:
        def get_nowait(self):
            raise EOFError

    module = SimpleNamespace(_results_queue=Broken())
    assert drop_abandoned_writes(module) == 0 and module._results_queue is None


def test_every_queued_result_is_dropped_and_a_missing_queue_is_refused() -> None:
    results: queue.Queue = queue.Queue()
    for item in ({0: []}, {0: [], 1: []}):
        results.put(item)
    assert drop_abandoned_writes(SimpleNamespace(_results_queue=results)) == 2
    assert results.empty()
    assert drop_abandoned_writes(SimpleNamespace(_results_queue=None)) == 0
    with pytest.raises(RuntimeError, match="_results_queue"):
        check_write_queue(SimpleNamespace(__name__="megatron.elsewhere"))
