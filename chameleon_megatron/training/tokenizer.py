"""The tokenizer a run's datasets are built with, from Megatron-LM's tokenizer flags.

megatron.core.datasets reads three things of a tokenizer: ``vocab_size``, ``eod`` and
``unique_identifiers`` (part of the index cache key). Without ``--tokenizer-type`` the
trainer keeps its byte tokenizer, which needs no file. NullTokenizer and
HuggingFaceTokenizer are megatron-core's own (``megatron.core.tokenizers``);
GPT2BPETokenizer (``gpt2_tokenizer``) is megatron-core's text tokenizer class over the local
byte-level BPE of ``gpt2_bpe`` (megatron-core's own GPT2BPETokenizer downloads from the hub).
It is imported only when asked for: megatron-core's text tokenizers import transformers,
about 1 s of every worker's start-up.

The model is sized before this module is used: validate and preflight work out the
vocabulary size without importing megatron (see ``preflight._tokenizer_files``), and
``checked_vocab`` makes sure the tokenizer built here agrees with them.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
from megatron.core.tokenizers import MegatronTokenizer

from chameleon_megatron.configurable import ConfigError
from chameleon_megatron.training.data_flags import BYTE_VOCAB_SIZE, tokenizer_vocab_size


class ByteTokenizer:
    """UTF-8 bytes as tokens plus an end-of-document token (no vocabulary file needed).

    Has what megatron.core.datasets reads of a tokenizer: ``vocab_size``, ``eod`` and
    ``unique_identifiers`` (part of the dataset cache key).
    """

    def __init__(self, vocab_size: int = BYTE_VOCAB_SIZE) -> None:
        if vocab_size < 2:
            raise ValueError(f"vocab_size={vocab_size}: must be >= 2")
        self.vocab_size = vocab_size
        self.eod = vocab_size - 1
        self.unique_identifiers = {"class": type(self).__name__, "vocab_size": vocab_size}

    def tokenize(self, text: str) -> np.ndarray:
        ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)
        return ids % (self.vocab_size - 1)

    def detokenize(self, ids: np.ndarray) -> str:
        return bytes(int(i) for i in ids if i < min(256, self.eod)).decode("utf-8", "replace")


def build_tokenizer(args: argparse.Namespace) -> Any:
    """The tokenizer of ``--tokenizer-type`` (the byte tokenizer without it)."""
    kind = args.tokenizer_type
    if kind is None:
        return ByteTokenizer(args.vocab_size)
    if kind == "NullTokenizer":
        return MegatronTokenizer.from_pretrained(metadata_path={"library": "null"},
                                                 vocab_size=args.vocab_size)
    if kind == "GPT2BPETokenizer":
        from chameleon_megatron.training.gpt2_tokenizer import GPT2BPETokenizer

        return GPT2BPETokenizer(args.vocab_file, args.merge_file)
    if kind == "HuggingFaceTokenizer":
        # Fast tokenizers load from tokenizer.json alone, as Megatron-LM's legacy
        # HuggingFaceTokenizer (transformers' default) does.
        return MegatronTokenizer.from_pretrained(
            tokenizer_path=args.tokenizer_model, metadata_path={"library": "huggingface"},
            use_fast=True)
    raise ConfigError(f"--tokenizer-type {kind}: not a tokenizer this trainer builds")


def checked_vocab(tokenizer: Any, args: argparse.Namespace) -> Any:
    """``tokenizer``, once its vocabulary is the one the model was sized for: a token id
    past the embedding table would fail deep inside the first forward pass."""
    expected = tokenizer_vocab_size(args)
    if tokenizer.vocab_size != expected:
        raise ConfigError(
            f"--tokenizer-type {args.tokenizer_type or '(byte)'}: the tokenizer has "
            f"{tokenizer.vocab_size} tokens, but the model was sized for {expected} "
            f"(padded to {args.padded_vocab_size})")
    return tokenizer
