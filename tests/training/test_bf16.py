"""--bf16 trains in every layout: bf16 parameters and activations, fp32 main gradients and
master weights (megatron's Float16Module, DDP and mixed-precision optimizer), on CPU gloo."""

import shutil

import pytest

from chameleon_megatron.training.checkpoint import TRACKER_FILE
from dist_utils import TINY, losses, run_trainer

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(900)]

BF16 = ["--bf16", "--hidden-dropout", "0", "--attention-dropout", "0"]
TOLERANCE = 1e-3
"""Relative loss difference allowed between layouts in bf16. Activations are rounded to 8
bits of mantissa at every layer, and a layout changes where and in which order partial sums
are rounded (the loss itself is computed in fp32); measured here: at most 9e-5 (TP2 x PP2),
DP2 bitwise equal."""

LAYOUTS = {
    "tp2": (2, ["--tensor-model-parallel-size", "2"]),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    "dp2": (2, []),
    "tp2_pp2": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One bf16 process, 4 steps, a checkpoint after step 2."""
    tmp = tmp_path_factory.mktemp("bf16")
    records = run_trainer(1, TINY + BF16 + ["--train-iters", "4", "--save", str(tmp / "saved"),
                                            "--save-interval", "2"], tmp, name="ws1")
    return records, tmp / "saved"


def test_bf16_is_in_effect(reference, tmp_path):
    """The same process in fp32 computes other losses (bf16 ignored, they would be bitwise
    equal); measured: up to 1.4e-4 apart, as far as bf16 layouts are from each other."""
    fp32 = losses(run_trainer(1, TINY + BF16[1:] + ["--train-iters", "4"], tmp_path))
    bf16 = losses(reference[0])
    assert max(abs(a - b) / abs(a) for a, b in zip(fp32, bf16)) > 1e-5


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_bf16_layout_matches_one_process(name, reference, tmp_path):
    nproc, flags = LAYOUTS[name]
    records = run_trainer(nproc, TINY + BF16 + ["--train-iters", "4"] + flags, tmp_path,
                          name=name)
    want, got = losses(reference[0]), losses(records)
    assert len(got) == 4 and all(v is not None for v in got)
    for w, g in zip(want, got):
        assert abs(w - g) <= TOLERANCE * abs(w), (name, want, got)
    assert got[-1] < got[0]  # the optimizer stepped


def test_a_bf16_checkpoint_resumes_exactly(reference, tmp_path):
    """Resuming from step 2 continues bit for bit: bf16 weights, fp32 master weights and
    Adam moments, the LR schedule and the data position all come back."""
    records, saved = reference
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved / "iter_0000002", ckpt / "iter_0000002")
    (ckpt / TRACKER_FILE).write_text("2")
    resumed = run_trainer(1, TINY + BF16 + ["--train-iters", "4", "--load", str(ckpt)],
                          tmp_path, name="resumed")
    assert losses(resumed) == losses(records)[2:]
