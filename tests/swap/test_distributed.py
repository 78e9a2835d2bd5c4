"""Swap through the trainer on 2 gloo processes: bitwise equal to the same run without swap,
in fp32 and bf16, dense and MoE, Adam and SGD.

One launch trains every layout twice (without, then with swap) in one process group, so the
start-up cost is paid once; each layout is then checked by its own test.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
from dist_utils import run_command  # noqa: E402

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
    # what GPU users run: bf16 activations go to host and back unchanged; MoE; SGD
    "tp2_bf16": ["--tensor-model-parallel-size", "2", "--bf16"],
    "pp2_bf16": ["--pipeline-model-parallel-size", "2", "--bf16"],
    "dp2_moe": ["--num-experts", "4", "--disable-bias-linear"],
    "dp2_sgd": ["--optimizer", "sgd"],
}
# With full recompute the backward re-creates most saved bytes, which cannot be swapped.
BUDGET = {name: "0.9" if name.endswith("recompute") else "0.5" for name in LAYOUTS}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("swap_dist")
    layouts = {name: {"flags": flags + ["--data-cache-path", str(out / "cache")],
                      "swap": SWAP + ["--chameleon-swap-budget-fraction", BUDGET[name]]}
               for name, flags in LAYOUTS.items()}
    run_command([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc-per-node=2", str(REPO / "tests/swap/dist_worker.py"), str(out),
                 json.dumps(layouts)], timeout=360, log=out / "log.txt")
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
