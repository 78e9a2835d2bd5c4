"""Real data through megatron's indexed dataset, the sample order, and batch ramp-up."""

import argparse
import random

import pytest

from dist_utils import losses, run_command, run_trainer

pytestmark = pytest.mark.timeout(300)


def _corpus(path):
    rng = random.Random(0)
    words = "the cat sat on a mat while the dog ran after a red ball in the park".split()
    docs = [" ".join(rng.choice(words) for _ in range(rng.randint(20, 60))) for _ in range(120)]
    path.write_text("\n\n".join(docs))


def test_indexed_dataset_trains(tmp_path):
    import sys

    corpus = tmp_path / "corpus.txt"
    _corpus(corpus)
    prefix = tmp_path / "data" / "corpus"
    out = run_command([sys.executable, "scripts/build_indexed_dataset.py", "--input",
                       str(corpus), "--output-prefix", str(prefix)], timeout=120)
    assert "wrote 120 documents" in out
    assert prefix.with_suffix(".bin").stat().st_size > 0
    records = run_trainer(1, [
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--data-path", str(prefix), "--split", "90,10,0",
        "--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters", "12",
        "--lr", "3e-3", "--eval-interval", "12", "--eval-iters", "1",
        "--hidden-dropout", "0", "--attention-dropout", "0",
    ], tmp_path)
    ls = losses(records)
    assert len(ls) == 12
    # Bytes of a 15-word vocabulary are very predictable: the loss falls well below ln(257).
    assert ls[0] > 5.0 and ls[-1] < ls[0] - 1.0
    evals = [r for r in records if r["event"] == "eval"]
    assert len(evals) == 1 and evals[0]["loss"] is not None
    run = [r for r in records if r["event"] == "run"][0]
    assert run["args"]["vocab_size"] == 257


def test_microbatch_order_is_megatrons():
    from chameleon_megatron.training.data import microbatch_indices

    # Global batch 8 = 2 microbatches x 2 samples x dp 2: interleaved by data-parallel rank.
    assert microbatch_indices(16, micro=2, dp=2, dp_rank=0, num_microbatches=2) == [
        [16, 17], [20, 21]]
    assert microbatch_indices(16, micro=2, dp=2, dp_rank=1, num_microbatches=2) == [
        [18, 19], [22, 23]]


def test_batch_rampup_formula():
    from chameleon_megatron.training.data import global_batch_size_at

    args = argparse.Namespace(rampup_batch_size=[4, 4, 80], global_batch_size=16)
    # 3 increments over 80 samples: one every 26.67 samples.
    assert [global_batch_size_at(args, c) for c in (0, 26, 27, 54, 80, 1000)] == [
        4, 4, 8, 12, 16, 16]
    assert global_batch_size_at(argparse.Namespace(rampup_batch_size=None,
                                                   global_batch_size=16), 5) == 16


def test_byte_tokenizer_round_trip():
    from chameleon_megatron.training.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    ids = tok.tokenize("héllo")
    assert tok.eod == 256 and ids.max() < 256
    assert tok.detokenize(ids) == "héllo"
    with pytest.raises(ValueError, match="vocab_size=1"):
        ByteTokenizer(1)


def _indexed(tmp_path, documents=100):
    from chameleon_megatron.training.indexed_data import build_indexed_dataset

    corpus = tmp_path / "corpus.txt"
    rng = random.Random(1)
    corpus.write_text("\n\n".join(" ".join(rng.choice("abcdefgh") for _ in range(40))
                                  for _ in range(documents)))
    prefix = tmp_path / "data" / "corpus"
    build_indexed_dataset(corpus, prefix)
    return prefix


def _datasets(prefix, *flags):
    from chameleon_megatron.training.arguments import parse_args
    from chameleon_megatron.training.data import build_datasets
    from chameleon_megatron.training.validate import validate_args

    args = validate_args(parse_args([
        "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
        "--seq-length", "32", "--data-path", str(prefix), "--train-iters", "2", *flags]), 1)
    return build_datasets(args)


def test_split_decides_which_documents_validation_sees(tmp_path):
    prefix = _indexed(tmp_path)
    everything = _datasets(prefix, "--split", "1,0,0")
    assert everything.valid is None
    assert set(everything.train.indices) == set(range(100))
    split = _datasets(prefix, "--split", "8,1,1", "--eval-interval", "2", "--eval-iters", "1")
    assert set(split.train.indices) == set(range(80))
    assert set(split.valid.indices) == set(range(80, 90))


def test_data_cache_path_receives_the_index_caches(tmp_path):
    prefix = _indexed(tmp_path)
    cache = tmp_path / "cache"
    _datasets(prefix, "--split", "8,1,1", "--data-cache-path", str(cache))
    names = {p.name.split("-", 1)[1] for p in cache.iterdir()}  # after the config's hash
    for part in ("train", "valid"):
        assert {f"GPTDataset-{part}-{kind}_index.npy"
                for kind in ("document", "sample", "shuffle")} <= names
    megatron_default = tmp_path / "data" / "corpus" / "cache" / "GPTDataset_indices"
    assert not megatron_default.exists()
    _datasets(prefix, "--split", "8,1,1")  # without the flag: megatron's place, by the data
    assert any(megatron_default.iterdir())
