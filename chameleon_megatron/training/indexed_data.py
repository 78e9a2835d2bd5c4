"""Write a text corpus as a megatron indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``).

Documents are separated by blank lines; each is tokenized (the byte tokenizer, or any
tokenizer of ``training.tokenizer``) and ends with the end-of-document token, as Megatron-LM's
``preprocess_data.py --append-eod`` writes them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

from chameleon_megatron.training.tokenizer import ByteTokenizer


def documents(text: str) -> list[str]:
    """Blank-line separated documents, stripped, empty ones dropped."""
    return [d.strip() for d in text.split("\n\n") if d.strip()]


def build_indexed_dataset(text_path: str | Path, prefix: str | Path, vocab_size: int = 257,
                          tokenizer: Any = None) -> int:
    """Tokenize ``text_path`` into ``prefix.bin/.idx`` with ``tokenizer`` (the byte tokenizer
    of ``vocab_size`` by default); returns the number of documents."""
    docs = documents(Path(text_path).read_text(encoding="utf-8"))
    if not docs:
        raise ValueError(f"{text_path}: no documents (blank-line separated text expected)")
    tokenizer = tokenizer if tokenizer is not None else ByteTokenizer(vocab_size)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    # The smallest integer type that holds every id, as Megatron-LM's preprocess_data picks.
    builder = IndexedDatasetBuilder(f"{prefix}.bin",
                                    dtype=DType.optimal_dtype(tokenizer.vocab_size))
    for doc in docs:
        ids = np.append(np.asarray(tokenizer.tokenize(doc), dtype=np.int64), tokenizer.eod)
        builder.add_document(torch.from_numpy(ids), [len(ids)])
    builder.finalize(f"{prefix}.idx")
    return len(docs)
