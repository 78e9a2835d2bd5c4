#!/usr/bin/env python3
"""Build a small megatron indexed dataset from a text file, for --data-path.

    python scripts/build_indexed_dataset.py --input corpus.txt --output-prefix data/corpus
    python -m chameleon_megatron.pretrain_gpt --data-path data/corpus ...

With --tokenizer-type (and its files) the text is tokenized as the trainer's same flags
tokenize it; give the trainer the same tokenizer flags.
"""

import argparse

from chameleon_megatron.training.arguments import TOKENIZER_TYPES
from chameleon_megatron.training.indexed_data import build_indexed_dataset
from chameleon_megatron.training.tokenizer import build_tokenizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", required=True, help="UTF-8 text; documents separated by blank lines")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="byte tokenizer (257 by default) or NullTokenizer vocabulary")
    p.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None,
                   help="the trainer's tokenizer of that name (the byte tokenizer without it)")
    p.add_argument("--vocab-file", help="GPT2BPETokenizer: vocab.json")
    p.add_argument("--merge-file", help="GPT2BPETokenizer: merges.txt")
    p.add_argument("--tokenizer-model", help="HuggingFaceTokenizer: a local tokenizer directory")
    a = p.parse_args()
    if a.tokenizer_type is None and a.vocab_size is None:
        a.vocab_size = 257
    if a.tokenizer_type == "NullTokenizer" and a.vocab_size is None:
        p.error("--tokenizer-type NullTokenizer needs --vocab-size")
    n = build_indexed_dataset(a.input, a.output_prefix, tokenizer=build_tokenizer(a))
    print(f"wrote {n} documents to {a.output_prefix}.bin/.idx")


if __name__ == "__main__":
    main()
