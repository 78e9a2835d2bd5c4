"""Every parallel layout computes the same losses as one process (same weights and data)."""

import pytest

from dist_utils import TINY, losses, run_trainer

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(900)]

ITERS = ["--train-iters", "3", "--hidden-dropout", "0", "--attention-dropout", "0"]

LAYOUTS = {
    "tp2": (2, ["--tensor-model-parallel-size", "2"]),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    "dp2": (2, []),
    "tp2_pp2": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
    "tp2_sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "pp2_vpp2": (2, ["--pipeline-model-parallel-size", "2",
                     "--num-layers-per-virtual-pipeline-stage", "1"]),
}


MOE = ["--num-experts", "4", "--disable-bias-linear"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    records = run_trainer(1, TINY + ITERS, tmp_path_factory.mktemp("ws1"), name="ws1")
    return records


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(name, reference, tmp_path):
    nproc, flags = LAYOUTS[name]
    records = run_trainer(nproc, TINY + ITERS + flags, tmp_path, name=name)
    want, got = losses(reference), losses(records)
    assert len(got) == 3 and all(v is not None for v in got)
    for w, g in zip(want, got):
        assert abs(w - g) <= 1e-5 * abs(w), (name, want, got)
    # The loss falls: the optimizer really stepped in this layout.
    assert got[-1] < got[0]
    its = [r for r in records if r["event"] == "iteration"]
    dp = nproc // ((2 if "tp2" in name else 1) * (2 if "pp2" in name else 1))
    assert its[-1]["layout"]["dp"] == dp and its[-1]["world_size"] == nproc
    assert its[-1]["consumed_samples"] == 3 * 8


def test_moe_at_tp2_with_sequence_parallelism_matches_single_process(tmp_path):
    """megatron-core runs MoE at TP > 1 only with sequence parallelism; on torch's norms
    (no TE, no apex) they are ``megatron.sp_norm``'s, their gradients summed over the TP
    group. Measured: at most 2.5e-8 relative."""
    want = losses(run_trainer(1, TINY + ITERS + MOE, tmp_path, name="moe1"))
    got = losses(run_trainer(2, TINY + ITERS + MOE + [
        "--tensor-model-parallel-size", "2", "--sequence-parallel"], tmp_path, name="moe_tp2"))
    assert len(got) == 3 and got[-1] < got[0]
    for w, g in zip(want, got):
        assert abs(w - g) <= 1e-5 * abs(w), (want, got)
