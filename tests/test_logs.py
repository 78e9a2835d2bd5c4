"""Logs a user can read: a start-up line, structured records as JSON from one rank, and the
libraries' harmless CPU warnings once (rank 0), not once per rank and module."""

import json
import logging
import re
import sys
import warnings

import numpy as np
import pytest

from chameleon_megatron.logs import FORMAT, RecordFormatter, _OnceFilter
from dist_utils import run_command

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--vocab-size", "64", "--micro-batch-size", "1",
        "--train-iters", "2", "--mock-data"]


def _record(msg, *args) -> logging.LogRecord:
    return logging.LogRecord("x", logging.INFO, __file__, 1, msg, args, None)


def test_dict_records_are_one_json_object_numbers_included():
    line = RecordFormatter("%(message)s").format(_record(
        {"event": "swap_plan", "stall_s": np.float64(0.25), "ranks": np.array([1, 2]),
         "layout": (1, 2)}))
    assert json.loads(line) == {"event": "swap_plan", "stall_s": 0.25, "ranks": [1, 2],
                                "layout": [1, 2]}
    assert RecordFormatter("%(message)s").format(_record("plain %d", 3)) == "plain 3"


def test_harmless_messages_pass_once_on_rank_0_and_never_elsewhere():
    first, other = _OnceFilter(silent=False), _OnceFilter(silent=True)
    apex = "mod.py:3: UserWarning: Apex is not installed. Falling back to Torch Norm"
    assert [first.filter(_record(apex)), first.filter(_record(apex))] == [True, False]
    assert not other.filter(_record(apex))
    assert first.filter(_record("a real warning")) and other.filter(_record("a real one"))


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_two_ranks_log_the_start_line_once_and_library_warnings_once(tmp_path):
    out = run_command([sys.executable, "-m", "torch.distributed.run", "--standalone",
                       "--nproc-per-node", "2", "-m", "chameleon_megatron.pretrain_gpt",
                       *TINY, "--pipeline-model-parallel-size", "2", "--chameleon-swap"],
                      timeout=200)
    assert len(re.findall(r" start: GPT 2 layers, hidden 32, [\d.]+ M parameters \| world 2: "
                          r"tp 1, pp 2, dp 1, vpp 1 \| .* \| fp32 \| swap on \(budget 50% of "
                          r"the saved activations.*\| fault tolerance off", out)) == 1, out
    assert out.count("UserWarning: Apex is not installed") == 1, out  # rank 0, once
    assert out.count("Unable to save MockGPTDataset indexes") == 1, out
    plans = [json.loads(line.split(": ", 1)[1]) for line in out.splitlines()
             if "chameleon_megatron.swap.manager: {" in line]
    # One record per stage (each stage has one rank here), parseable as JSON.
    assert sorted(p["rank"] for p in plans if p["event"] == "swap_plan") == [0, 1], out


def test_setup_logging_filters_warnings_for_other_ranks():
    from chameleon_megatron import logs

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")  # whatever filters the test run has
            logs.setup_logging(rank=1)
            logging.captureWarnings(False)  # back to catch_warnings' recorder: the filters stay
            warnings.warn("Apex is not installed. Falling back", UserWarning)
            warnings.warn("something else", UserWarning)
        assert [str(w.message) for w in seen] == ["something else"]
        assert isinstance(root.handlers[0].formatter, RecordFormatter)
        assert root.handlers[0].formatter._fmt == FORMAT
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
