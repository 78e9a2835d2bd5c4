"""Write a text corpus as a megatron indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``).

Documents are separated by blank lines; each is tokenized with the byte tokenizer and
ends with the end-of-document token, as Megatron-LM's ``preprocess_data.py --append-eod``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from chameleon_megatron.training.data import ByteTokenizer


def documents(text: str) -> list[str]:
    """Blank-line separated documents, stripped, empty ones dropped."""
    return [d.strip() for d in text.split("\n\n") if d.strip()]


def build_indexed_dataset(text_path: str | Path, prefix: str | Path,
                          vocab_size: int = 257) -> int:
    """Tokenize ``text_path`` into ``prefix.bin/.idx``; returns the number of documents."""
    docs = documents(Path(text_path).read_text(encoding="utf-8"))
    if not docs:
        raise ValueError(f"{text_path}: no documents (blank-line separated text expected)")
    tokenizer = ByteTokenizer(vocab_size)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for doc in docs:
        ids = np.append(tokenizer.tokenize(doc), tokenizer.eod)
        builder.add_document(torch.from_numpy(ids), [len(ids)])
    builder.finalize(f"{prefix}.idx")
    return len(docs)
