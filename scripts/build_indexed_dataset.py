#!/usr/bin/env python3
"""Build a small megatron indexed dataset from a text file, for --data-path.

    python scripts/build_indexed_dataset.py --input corpus.txt --output-prefix data/corpus
    python -m chameleon_megatron.pretrain_gpt --data-path data/corpus ...
"""

import argparse

from chameleon_megatron.training.indexed_data import build_indexed_dataset


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", required=True, help="UTF-8 text; documents separated by blank lines")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    p.add_argument("--vocab-size", type=int, default=257, help="byte tokenizer vocabulary")
    a = p.parse_args()
    n = build_indexed_dataset(a.input, a.output_prefix, a.vocab_size)
    print(f"wrote {n} documents to {a.output_prefix}.bin/.idx")


if __name__ == "__main__":
    main()
