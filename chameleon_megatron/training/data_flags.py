"""Megatron-LM's data and tokenizer flags checked against each other (no files read, no
megatron import): one of --mock-data/--data-path, blend weights, --split, which tokenizer
reads which file flag, and the vocabulary sizes the flags alone determine (file tokenizers:
``data_files`` reads theirs)."""

from __future__ import annotations

import argparse
import math
import re

from chameleon_megatron.configurable import ConfigError

BYTE_VOCAB_SIZE = 257  # the byte tokenizer of training/tokenizer.py: 256 bytes + end-of-document


def _need(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Vocabulary padded so each TP rank gets an equal slice (Megatron's rule)."""
    multiple = divisible_by * tp
    return ((vocab_size + multiple - 1) // multiple) * multiple


def check_data(args: argparse.Namespace) -> None:
    """Data and tokenizer flags; fills the vocabulary sizes the flags alone determine."""
    _need(args.mock_data != bool(args.data_path),
          "give exactly one of --mock-data and --data-path")
    if args.data_path:
        _check_blend(args.data_path)
    _check_split(args)
    _check_tokenizer(args)
    vocab = tokenizer_vocab_size(args)
    args.padded_vocab_size = None if vocab is None else padded_vocab_size(
        vocab, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size)


def data_blend(values: list[str]) -> tuple[list[str], list[float] | None]:
    """--data-path as megatron reads it: ``W1 P1 W2 P2 ...`` (an even count whose every
    other item is a number) gives prefixes and weights; anything else is prefixes alone."""
    def is_weight(text: str) -> bool:
        try:
            float(text)
        except ValueError:
            return False
        return True

    if len(values) > 1 and len(values) % 2 == 0 and all(is_weight(v) for v in values[::2]):
        return list(values[1::2]), [float(v) for v in values[::2]]
    return list(values), None


def _check_blend(values: list[str]) -> None:
    prefixes, weights = data_blend(values)
    for prefix, weight in zip(prefixes, weights or []):
        # megatron normalizes the weights: a zero, negative or infinite one breaks the sum.
        _need(math.isfinite(weight) and weight > 0,
              f"--data-path weight {weight} (of {prefix}): must be a number > 0")


def split_weights(text: str) -> list[float]:
    """--split ``train,valid,test`` as numbers (missing ones 0), checked as megatron needs
    them: at most three, none negative, a positive sum."""
    try:
        weights = [float(part) for part in re.split(r"[,/]", text)]
    except ValueError:
        weights = []
    _need(1 <= len(weights) <= 3 and all(math.isfinite(w) and w >= 0 for w in weights)
          and sum(weights) > 0,
          f"--split {text!r}: must be up to three numbers >= 0 (train,valid,test weights), "
          "not all 0")
    return weights + [0.0] * (3 - len(weights))


def _check_split(args: argparse.Namespace) -> None:
    _, valid, _ = split_weights(args.split)
    if args.eval_interval and args.eval_iters > 0:
        _need(valid > 0, f"--split {args.split}: no validation part, but --eval-interval "
              f"{args.eval_interval} --eval-iters {args.eval_iters} evaluates; give the split "
              "a second weight > 0")


TOKENIZER_FILES = {"GPT2BPETokenizer": ("vocab_file", "merge_file"),
                   "HuggingFaceTokenizer": ("tokenizer_model",)}
"""The file flags (dest names) each tokenizer reads its vocabulary from; preflight reads
them and fills ``vocab_size`` before the model is sized."""


def _check_tokenizer(args: argparse.Namespace) -> None:
    kind = args.tokenizer_type
    for dest in ("vocab_file", "merge_file", "tokenizer_model"):
        flag, value = "--" + dest.replace("_", "-"), getattr(args, dest)
        if dest in TOKENIZER_FILES.get(kind, ()):
            _need(value is not None, f"--tokenizer-type {kind} needs {flag}")
        else:
            reader = next(k for k, dests in TOKENIZER_FILES.items() if dest in dests)
            _need(value is None, f"{flag} {value}: read only by --tokenizer-type {reader}, "
                  f"not by {kind or 'the byte tokenizer (no --tokenizer-type)'}")
    given = args.vocab_size
    _need(given is None or given > 0, f"--vocab-size={given}: must be > 0")
    if kind == "NullTokenizer":
        _need(given is not None, "--tokenizer-type NullTokenizer needs --vocab-size (its "
              "token ids are 0..vocab-size-1, end of document is vocab-size)")
    elif kind is None and args.mock_data:
        _need(given is not None, "--mock-data needs --vocab-size > 0 (or a --tokenizer-type)")
    elif kind is None:
        args.vocab_size = BYTE_VOCAB_SIZE if given is None else given
        _need(args.vocab_size >= 2, f"--vocab-size={given}: the byte tokenizer needs >= 2")


def tokenizer_vocab_size(args: argparse.Namespace) -> int | None:
    """How many token ids the tokenizer makes; the model's embedding covers them, padded.
    NullTokenizer's end-of-document id follows its --vocab-size ids (Megatron's rule); a
    tokenizer read from files has its size once preflight has read them (None before)."""
    if args.tokenizer_type == "NullTokenizer":
        return args.vocab_size + 1
    return args.vocab_size
