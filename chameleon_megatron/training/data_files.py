"""Megatron-LM's data and tokenizer flags checked against the files they name, before any
work starts and without importing megatron (the CPU platform patches come first): every
dataset prefix has its .bin and .idx, each --split part gets sequences, and the tokenizer's
files exist and give its vocabulary size (which sizes the model)."""

from __future__ import annotations

import argparse
import struct
from pathlib import Path

from chameleon_megatron.configurable import ConfigError
from chameleon_megatron.training.data_flags import (
    TOKENIZER_FILES,
    data_blend,
    padded_vocab_size,
    split_weights,
)
from chameleon_megatron.training.gpt2_bpe import load_merges, load_vocab

_INDEX_MAGIC = b"MMIDIDX\x00\x00"  # megatron's indexed dataset index files start with it


def check_data_files(args: argparse.Namespace) -> None:
    """Every dataset prefix of --data-path (plain, or weighted: W1 P1 W2 P2 ...) has its
    .bin and .idx; the tokenizer's files exist and give its vocabulary."""
    for prefix in data_blend(args.data_path or [])[0]:
        missing = [s for s in (".bin", ".idx") if not Path(prefix + s).is_file()]
        if missing:
            raise ConfigError(f"--data-path {prefix}: no {' or '.join(prefix + s for s in missing)}"
                              " (give the prefix of an indexed dataset, without .bin/.idx)")
        _splits_hold_sequences(args.split, prefix)
    _tokenizer_files(args)


def _splits_hold_sequences(split: str, prefix: str) -> None:
    """Each part of --split with a weight gets a sequence of ``prefix``: megatron loops
    forever building a split that has none (its epochs never add a token)."""
    count = _sequence_count(prefix)
    weights = split_weights(split)
    total, ends = sum(weights), [0.0]
    for weight in weights:  # megatron's bookends: normalized weights, summed in order
        ends.append(ends[-1] + weight / total)
    for name, begin, end in zip(("train", "valid", "test"), ends, ends[1:]):
        # megatron rounds each bookend to a sequence index
        if end > begin and int(round(begin * count)) == int(round(end * count)):
            raise ConfigError(f"--split {split}: its {name} part of --data-path {prefix} "
                              f"({count} sequences) holds none, and megatron cannot build an "
                              "empty split; give that part weight 0, or use more data")


def _sequence_count(prefix: str) -> int:
    """Sequences (documents without sentence splitting) of an indexed dataset, from its
    .idx header: the magic, a version, the token type, then the count."""
    with open(prefix + ".idx", "rb") as stream:
        head = stream.read(26)
    if len(head) < 26 or head[:9] != _INDEX_MAGIC:
        raise ConfigError(f"--data-path {prefix}: {prefix}.idx is not a megatron index file")
    return struct.unpack("<Q", head[18:26])[0]


def _tokenizer_files(args: argparse.Namespace) -> None:
    """The files of --tokenizer-type exist and hold a vocabulary, whose size becomes
    ``vocab_size`` (and sizes the model: ``padded_vocab_size``). Read without megatron,
    which must not be imported before the CPU platform patches."""
    kind = args.tokenizer_type
    if kind not in TOKENIZER_FILES:
        return
    for dest in TOKENIZER_FILES[kind]:
        path = Path(getattr(args, dest))
        if not (path.exists() if dest == "tokenizer_model" else path.is_file()):
            raise ConfigError(f"--{dest.replace('_', '-')} {path}: does not exist "
                              f"(--tokenizer-type {kind} reads it; nothing is downloaded)")
    size = (_gpt2_vocab_size(args.vocab_file, args.merge_file) if kind == "GPT2BPETokenizer"
            else _hf_vocab_size(args.tokenizer_model))
    if args.vocab_size is not None and args.vocab_size != size:
        raise ConfigError(f"--vocab-size={args.vocab_size} contradicts --tokenizer-type {kind}, "
                          f"whose vocabulary has {size} tokens (leave --vocab-size out)")
    args.vocab_size = size
    args.padded_vocab_size = padded_vocab_size(
        size, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size)


def _gpt2_vocab_size(vocab_file: str, merge_file: str) -> int:
    """Tokens of a GPT-2 vocab.json, once it and merges.txt parse (errors name the flag)."""
    try:
        load_merges(merge_file)
    except ValueError as exc:  # the message starts with the file's path
        raise ConfigError(f"--merge-file {exc}") from None
    try:
        return len(load_vocab(vocab_file))
    except ValueError as exc:
        raise ConfigError(f"--vocab-file {exc}") from None


def _hf_vocab_size(path: str) -> int:
    """Tokens of the transformers tokenizer at ``path``, as megatron-core counts them."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ConfigError("--tokenizer-type HuggingFaceTokenizer needs the transformers "
                          "package: pip install transformers") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, use_fast=True, local_files_only=True)
    except Exception as exc:  # transformers raises many kinds; the message is what counts
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"--tokenizer-model {path}: not a tokenizer transformers can load "
                          f"({reason})") from None
    return len(tokenizer)
