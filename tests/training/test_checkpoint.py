"""Checkpoints: an interrupted run resumes exactly; a checkpoint loads into another layout."""

import shutil
from pathlib import Path

import pytest

from chameleon_megatron.training.checkpoint import TRACKER_FILE
from dist_utils import TINY, losses, run_trainer

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(900)]

TP2_PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
# Dropout stays on: an exact resume needs the RNG states restored too.
BASE = TINY + TP2_PP2 + ["--lr-decay-iters", "6", "--lr-warmup-iters", "1"]


def checkpoint_of(saved: Path, iteration: int, into: Path) -> Path:
    """A checkpoint directory whose latest checkpoint is ``saved``'s of ``iteration``."""
    shutil.copytree(saved / f"iter_{iteration:07d}", into / f"iter_{iteration:07d}")
    (into / TRACKER_FILE).write_text(str(iteration))
    return into


def test_resume_is_exact_and_reshards(tmp_path):
    # One straight run saves at iteration 3 (and 6); the resumed run starts from 3.
    straight_records = run_trainer(4, BASE + ["--train-iters", "6", "--save",
                                              str(tmp_path / "saved"), "--save-interval", "3"],
                                   tmp_path, name="straight")
    straight = losses(straight_records)
    ckpt = checkpoint_of(tmp_path / "saved", 3, tmp_path / "ckpt")
    resumed = run_trainer(4, BASE + ["--train-iters", "6", "--load", str(ckpt)], tmp_path,
                          name="resumed")
    assert straight[:3] + losses(resumed) == straight
    its = [r for r in resumed if r["event"] == "iteration"]
    assert [r["iteration"] for r in its] == [4, 5, 6]
    assert its[0]["consumed_samples"] == 4 * 8
    # The LR schedule resumed where it stopped (not from warm-up).
    assert [r["lr"] for r in its] == [r["lr"] for r in straight_records
                                      if r["event"] == "iteration"][3:]

    # Same checkpoint into PP4: loads, continues from iteration 4 with a sensible loss.
    pp4 = run_trainer(4, TINY + ["--pipeline-model-parallel-size", "4", "--lr-decay-iters", "6",
                                 "--lr-warmup-iters", "1", "--train-iters", "6",
                                 "--hidden-dropout", "0", "--attention-dropout", "0",
                                 "--load", str(ckpt)], tmp_path, name="pp4")
    its4 = [r for r in pp4 if r["event"] == "iteration"]
    assert [r["iteration"] for r in its4] == [4, 5, 6]
    # Without dropout the first resumed loss is the model's loss on step 4's batch; it must
    # be close to the straight run's (which had dropout) and far below the initial loss.
    assert abs(its4[0]["loss"] - straight[3]) < 0.05 * straight[3]
    assert its4[0]["loss"] < straight[0] - 0.1


def test_a_checkpoint_of_another_padded_vocabulary_is_refused_or_matched(tmp_path):
    """128 tokens padded to multiples of 128: 128 rows at TP1, 256 at TP2. A TP1
    checkpoint is refused by TP2 with both shapes and the flag that makes them agree
    (one line, before training); with that flag the loss continues exactly."""
    import sys

    from dist_utils import run_command

    vocab = ["--make-vocab-size-divisible-by", "128", "--hidden-dropout", "0",
             "--attention-dropout", "0", "--lr-decay-iters", "3", "--lr-warmup-iters", "1"]
    straight = losses(run_trainer(1, TINY + vocab + ["--train-iters", "3", "--save",
                                                     str(tmp_path / "saved"), "--save-interval",
                                                     "2"], tmp_path, name="straight"))
    ckpt = checkpoint_of(tmp_path / "saved", 2, tmp_path / "ckpt")
    tp2 = ["--tensor-model-parallel-size", "2", "--train-iters", "3", "--load", str(ckpt)]
    out = run_command([sys.executable, "-m", "torch.distributed.run", "--standalone",
                       "--nproc-per-node", "2", "-m", "chameleon_megatron.pretrain_gpt",
                       *TINY, *vocab, *tp2], timeout=200, check=False)
    errors = [line for line in out.splitlines() if ": error: " in line]
    assert errors == [
        f"chameleon-pretrain-gpt: error: --load {ckpt}: embedding.word_embeddings.weight has "
        "shape [128, 64] in the checkpoint but [256, 64] in this model; the padded "
        "vocabulary differs: this run pads 128 tokens to a multiple of "
        "--make-vocab-size-divisible-by 128 x --tensor-model-parallel-size 2 = 256 rows; "
        "--make-vocab-size-divisible-by 64 pads it to 128 rows at TP 2, as the checkpoint "
        "has"], out[-3000:]
    assert " iteration " not in out
    fitted = run_trainer(2, TINY + vocab + tp2 + ["--make-vocab-size-divisible-by", "64"],
                         tmp_path, name="fitted")
    assert abs(losses(fitted)[0] - straight[2]) < 1e-5 * straight[2]


def _damage_truncate(ckpt: Path) -> str:
    shard = sorted(ckpt.glob("iter_*/*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    return f"{shard.name} is truncated ("


def _damage_remove(ckpt: Path) -> str:
    shard = sorted(ckpt.glob("iter_*/*.distcp"))[0]
    shard.unlink()
    return f"{shard.name} is missing"


def _damage_common(ckpt: Path) -> str:
    common = next(ckpt.glob("iter_*/common.pt"))
    common.write_bytes(common.read_bytes()[:40])
    return "the common state (common.pt) is unreadable"


@pytest.mark.parametrize("damage", [_damage_truncate, _damage_remove, _damage_common])
def test_a_damaged_checkpoint_names_the_file_and_the_iteration(tmp_path, damage):
    import sys

    from dist_utils import run_command

    argv = TINY + ["--train-iters", "2", "--lr-decay-iters", "2", "--lr-warmup-iters", "1"]
    run_trainer(1, argv + ["--save", str(tmp_path / "saved"), "--save-interval", "2"],
                tmp_path, name="saved")
    ckpt = checkpoint_of(tmp_path / "saved", 2, tmp_path / "ckpt")
    expected = damage(ckpt)
    out = run_command([sys.executable, "-m", "chameleon_megatron.pretrain_gpt", *argv,
                       "--train-iters", "3", "--load", str(ckpt)], timeout=200, check=False)
    errors = [line for line in out.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "Traceback" not in out, out[-3000:]
    assert errors[0].startswith(f"chameleon-pretrain-gpt: error: checkpoint {ckpt}/iter_0000002: "
                                f"{expected}"), errors
    assert " iteration " not in out
