"""GPT2BPETokenizer: megatron-core's text tokenizer class over the local byte-level BPE."""

from __future__ import annotations

from typing import Any

from megatron.core.tokenizers.text.text_tokenizer import MegatronTokenizerText

from chameleon_megatron.training.gpt2_bpe import ByteLevelBPE


class GPT2BPETokenizer(MegatronTokenizerText):
    """megatron-core's text tokenizer (``vocab_size``, ``eod``, ``tokenize``, cache key with
    both file paths) over a GPT-2 BPE read from local files."""

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        super().__init__(None, {"library": "gpt2-bpe", "model_type": "gpt"},
                         vocab_file=vocab_file, merges_file=merge_file)

    def _restore_model(self, vocab_file: str, merges_file: str, **_: Any) -> ByteLevelBPE:
        """The library object megatron-core's methods delegate to (its own would download)."""
        return ByteLevelBPE.from_files(vocab_file, merges_file)
