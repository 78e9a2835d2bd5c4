"""--tokenizer-type: datasets tokenized with each tokenizer train, the model's vocabulary
follows the tokenizer, blends draw by weight, and Megatron-LM's preprocess_data.py output
loads as it is. Vocabularies are tiny files the tests write."""

import argparse
import json
import math
import os
import random
import sys
from pathlib import Path

import numpy as np
import pytest
from dist_utils import REPO, losses, run_command, run_trainer

from chameleon_megatron.config import config_from_args
from chameleon_megatron.preflight import preflight
from chameleon_megatron.training.arguments import parse_args
from chameleon_megatron.training.data_flags import padded_vocab_size
from chameleon_megatron.training.gpt2_bpe import END_OF_TEXT, ByteLevelBPE, byte_symbols
from chameleon_megatron.training.validate import validate_args

pytestmark = pytest.mark.timeout(120)

WORDS = "the cat sat on a mat while the dog ran after a red ball in the park".split()
# Merges of a tiny GPT-2 vocabulary, highest priority first ("Ġ" spells a space).
MERGES = [("h", "e"), ("Ġ", "t"), ("Ġt", "he"), ("a", "t"), ("Ġ", "c"), ("Ġc", "at"),
          ("Ġ", "s"), ("Ġs", "at"), ("Ġ", "m"), ("Ġm", "at"), ("o", "n"), ("Ġ", "on")]
DIVISIBLE = 8  # --make-vocab-size-divisible-by: small, so padding shows the vocabulary
MODEL = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--lr", "1e-3", "--log-interval", "1", "--make-vocab-size-divisible-by", str(DIVISIBLE),
         "--hidden-dropout", "0", "--attention-dropout", "0", "--split", "90,10,0"]


def _texts(n: int = 60, numbers: bool = False, seed: int = 0) -> list[str]:
    """Documents of random words, or of random ids below 100 (NullTokenizer's text)."""
    rng = random.Random(seed)
    if numbers:
        return [" ".join(str(rng.randrange(100)) for _ in range(rng.randint(20, 50)))
                for _ in range(n)]
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 50))) for _ in range(n)]


def _gpt2_files(root: Path) -> list[str]:
    """A GPT-2 vocabulary (all 256 byte symbols, the merges, end of text) and its merges."""
    tokens = [*byte_symbols(), *(a + b for a, b in MERGES), END_OF_TEXT]
    (root / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}))
    (root / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in MERGES))
    return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(root / "vocab.json"),
            "--merge-file", str(root / "merges.txt")]


def _hf_files(root: Path) -> list[str]:
    """A word-level transformers tokenizer saved to a directory (no network)."""
    pytest.importorskip("transformers", reason="HuggingFaceTokenizer needs transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, **{w: i + 2 for i, w in enumerate(sorted(set(WORDS)))}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>",
                            eos_token="</s>").save_pretrained(root / "hf")
    return ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(root / "hf")]


def _tokenizer_flags(kind: str, root: Path) -> list[str]:
    if kind == "NullTokenizer":
        # 128 ids and the end of document: padding to 8 shows the 129th
        return ["--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]
    return _gpt2_files(root) if kind == "GPT2BPETokenizer" else _hf_files(root)


def _checked(argv: list[str]) -> argparse.Namespace:
    """The arguments as the trainer checks them before building anything."""
    args = validate_args(parse_args(argv), 1)
    preflight(args, config_from_args(args))
    return args


def _write_dataset(texts: list[str], prefix: Path, args: argparse.Namespace) -> None:
    from chameleon_megatron.training.indexed_data import build_indexed_dataset
    from chameleon_megatron.training.tokenizer import build_tokenizer

    corpus = prefix.with_suffix(".txt")
    corpus.write_text("\n\n".join(texts))
    build_indexed_dataset(corpus, prefix, tokenizer=build_tokenizer(args))


def _model_vocab_rows(args: argparse.Namespace) -> int:
    """Rows of the word embedding of the model the trainer builds for ``args``."""
    from megatron.core import parallel_state

    from chameleon_megatron.megatron import groups
    from chameleon_megatron.megatron.platform import cpu_platform
    from chameleon_megatron.training import model as model_lib

    kernels = model_lib.available_kernels()
    with cpu_platform():
        ours = not parallel_state.model_parallel_is_initialized()  # (another test's, else)
        if ours:
            groups.init_from_launcher(rank=0, world_size=1, backend="gloo", timeout_s=30)
            groups.build_uniform(1, 1, timeout_s=30)
        try:
            config = model_lib.transformer_config(args, kernels)
            chunk = model_lib.build_model_chunks(args, config, kernels)[0]
            return chunk.embedding.word_embeddings.weight.shape[0]
        finally:
            if ours:
                groups.destroy()


def test_gpt2_bpe_spells_bytes_and_merges_as_gpt2(tmp_path):
    symbols = byte_symbols()
    # GPT-2's table: printable bytes spell themselves, space is "Ġ", newline "Ċ", byte 0 "Ā".
    assert (symbols[ord("a")], symbols[ord(" ")], symbols[ord("\n")], symbols[0]) == (
        "a", "Ġ", "Ċ", "Ā")
    assert len(set(symbols)) == 256
    _gpt2_files(tmp_path)
    bpe = ByteLevelBPE.from_files(tmp_path / "vocab.json", tmp_path / "merges.txt")
    assert bpe.text_to_tokens("the cat sat, then") == ["t", "he", "Ġcat", "Ġsat", ",",
                                                       "Ġthe", "n"]
    text = "the mat\n\n  héllo wörld 42!"
    assert bpe.ids_to_text(bpe.text_to_ids(text)) == text
    assert bpe.vocab_size == 256 + len(MERGES) + 1 and bpe.eod == 256 + len(MERGES)


@pytest.mark.parametrize("kind", ["NullTokenizer", "GPT2BPETokenizer", "HuggingFaceTokenizer"])
def test_each_tokenizer_trains_and_sizes_the_model(kind, tmp_path):
    flags = _tokenizer_flags(kind, tmp_path)
    prefix = tmp_path / "corpus"
    args = _checked([*MODEL, *flags, "--mock-data", "--train-iters", "2"])
    _write_dataset(_texts(numbers=kind == "NullTokenizer"), prefix, args)

    from chameleon_megatron.training.tokenizer import build_tokenizer

    size = build_tokenizer(args).vocab_size
    expected = {"NullTokenizer": 129, "GPT2BPETokenizer": 256 + len(MERGES) + 1,
                "HuggingFaceTokenizer": 2 + len(set(WORDS))}[kind]
    assert size == expected
    padded = padded_vocab_size(size, DIVISIBLE, 1)
    assert _model_vocab_rows(args) == padded

    argv = [*MODEL, *flags, "--data-path", str(prefix), "--train-iters", "2"]
    records = run_trainer(1, argv, tmp_path)
    assert len(losses(records)) == 2 and all(math.isfinite(x) for x in losses(records))
    run = next(r for r in records if r["event"] == "run")["args"]
    assert (run["tokenizer_type"], run["padded_vocab_size"]) == (kind, padded)


def test_a_weighted_blend_draws_from_both_prefixes_by_weight(tmp_path):
    from chameleon_megatron.training.data import build_datasets

    prefixes = [tmp_path / "a", tmp_path / "b"]
    byte_tokenizer = argparse.Namespace(tokenizer_type=None, vocab_size=257)
    for i, prefix in enumerate(prefixes):  # the same size: unweighted, they would be 50/50
        _write_dataset(_texts(seed=i), prefix, byte_tokenizer)
    blend = ["0.3", str(prefixes[0]), "0.7", str(prefixes[1])]
    argv = [*MODEL, "--data-path", *blend, "--train-iters", "50", "--global-batch-size", "8"]
    train = build_datasets(_checked(argv)).train
    counts = np.bincount(np.asarray(train.dataset_index), minlength=2)
    assert counts.sum() >= 400
    assert abs(counts[0] / counts.sum() - 0.3) < 0.03
    assert {train[i]["dataset_id"] for i in range(20)} == {0, 1}

    records = run_trainer(1, [*MODEL, "--data-path", *blend, "--train-iters", "2"], tmp_path)
    assert all(math.isfinite(x) for x in losses(records)) and len(losses(records)) == 2


# ---------------------------------------------- Megatron-LM's tools/preprocess_data.py

MEGATRON_LM = Path(os.environ.get("CHAMELEON_MEGATRON_LM") or REPO.parent / "shared" /
                   "megatron-lm")

# Runs preprocess_data.py unmodified. It imports megatron.training for its tokenizers and
# argument group; that package's __init__ pulls in the whole training loop (triton, pydantic,
# ...), so the package is entered without it, its names taken from global_vars on demand.
# The tokenizer modules import six and regex at the top: where those are not installed,
# stand-ins take their place (the paths run here never call them).
DRIVER = '''\
import importlib, importlib.util, re, runpy, sys, types
from pathlib import Path

def from_global_vars(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return getattr(importlib.import_module("megatron.training.global_vars"), name)

training = types.ModuleType("megatron.training")
training.__path__ = [str(Path(sys.argv[1]).resolve().parents[1] / "megatron" / "training")]
training.__getattr__ = from_global_vars
sys.modules["megatron.training"] = training
if importlib.util.find_spec("six") is None:
    sys.modules["six"] = types.ModuleType("six")
if importlib.util.find_spec("regex") is None:
    sys.modules["regex"] = re
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
'''


@pytest.mark.skipif(not (MEGATRON_LM / "tools" / "preprocess_data.py").is_file(),
                    reason=f"no Megatron-LM checkout at {MEGATRON_LM} (CHAMELEON_MEGATRON_LM)")
@pytest.mark.parametrize("kind", ["NullTokenizer", "GPT2BPETokenizer"])
def test_preprocess_data_output_trains(kind, tmp_path):
    if kind == "GPT2BPETokenizer":
        # Megatron-LM's GPT-2 tokenizer needs regex's \p{L}; only that tokenizer uses it.
        pytest.importorskip("regex", reason="Megatron-LM's GPT2BPETokenizer needs regex")
    flags = _tokenizer_flags(kind, tmp_path)
    texts = _texts(40, numbers=kind == "NullTokenizer")
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    (tmp_path / "driver.py").write_text(DRIVER)
    # Megatron-LM's new tokenizer system builds GPT2BPETokenizer through the hub; its legacy
    # one reads the two files.
    legacy = ["--legacy-tokenizer"] if kind == "GPT2BPETokenizer" else []
    run_command([sys.executable, str(tmp_path / "driver.py"),
                 str(MEGATRON_LM / "tools" / "preprocess_data.py"), "--input", str(jsonl),
                 "--output-prefix", str(tmp_path / "mlm"), "--workers", "1", "--append-eod",
                 *flags, *legacy], timeout=120, env={"PYTHONDONTWRITEBYTECODE": "1"})
    prefix = tmp_path / "mlm_text_document"

    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from chameleon_megatron.training.tokenizer import build_tokenizer

    args = _checked([*MODEL, *flags, "--data-path", str(prefix), "--train-iters", "2"])
    ours = build_tokenizer(args)
    written = IndexedDataset(str(prefix))
    assert len(written) == len(texts)
    for i in (0, len(texts) - 1):  # Megatron-LM's ids are this trainer's tokenizer's ids
        assert list(written[i]) == [*ours.tokenize(texts[i]), ours.eod]

    records = run_trainer(1, [*MODEL, *flags, "--data-path", str(prefix), "--train-iters", "2"],
                          tmp_path)
    assert len(losses(records)) == 2 and all(math.isfinite(x) for x in losses(records))

