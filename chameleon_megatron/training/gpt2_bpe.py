"""GPT-2's byte-level BPE from a local ``vocab.json`` + ``merges.txt`` pair.

megatron-core 0.16.1 builds its GPT2BPETokenizer through transformers' AutoTokenizer for the
hub model "gpt2" (a download), while Megatron-LM's ``--vocab-file``/``--merge-file`` name
local files. This is the tokenizer library the trainer's GPT2BPETokenizer wraps: it has the
methods megatron-core's ``MegatronTokenizerText`` calls on its library object
(``text_to_ids``, ``ids_to_text``, ``vocab_size``, ``eod``, ...).

It imports nothing of megatron, so preflight can read a vocabulary before megatron-core is
imported (the CPU platform patches must come first).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

END_OF_TEXT = "<|endoftext|>"
"""GPT-2's end-of-document token; Megatron-LM uses it as ``eod``."""

# GPT-2's pre-tokenization: contractions, letter runs, digit runs, other symbols (each may
# carry one leading space), then whitespace. Python's ``re`` has no \p{L}/\p{N}: a letter is
# a word character that is neither a digit nor "_", a number is a decimal digit.
_PIECES = re.compile(
    r"'(?:s|t|re|ve|m|ll|d)| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+")


def byte_symbols() -> list[str]:
    """The character that spells each byte in GPT-2 vocabularies.

    Printable Latin-1 bytes spell themselves; every other byte takes the next code point
    from 256 on, in byte order. So each byte string has a whitespace-free spelling that maps
    back to the same bytes, and a vocabulary holds all 256 single-byte tokens.
    """
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    symbols, spare = [], 256
    for byte in range(256):
        if byte in printable:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(spare))
            spare += 1
    return symbols


def load_vocab(path: str | Path) -> dict[str, int]:
    """``vocab.json``: a JSON object of token -> id, the ids 0..n-1 once each (the model's
    embedding has one row per id); raises ValueError naming the file and what is wrong."""
    try:
        vocab = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc.reason})") from None
    if not isinstance(vocab, dict) or not all(
            isinstance(k, str) and isinstance(v, int) for k, v in vocab.items()):
        raise ValueError(f"{path}: not a GPT-2 vocabulary (a JSON object of token -> id)")
    if sorted(vocab.values()) != list(range(len(vocab))):
        raise ValueError(f"{path}: the ids of its {len(vocab)} tokens are not 0..{len(vocab) - 1}"
                         " once each")
    if END_OF_TEXT not in vocab:
        raise ValueError(f"{path}: no {END_OF_TEXT} token (the end-of-document token)")
    return vocab


def load_merges(path: str | Path) -> list[tuple[str, str]]:
    """``merges.txt``: one ``LEFT RIGHT`` pair a line, highest priority first, after an
    optional ``#version`` line; raises ValueError naming the file and line."""
    merges = []
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc.reason})") from None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or (number == 1 and line.startswith("#version")):
            continue
        pair = line.split()
        if len(pair) != 2:
            raise ValueError(f"{path}:{number}: {line!r} is not a merge (two symbols and a space)")
        merges.append((pair[0], pair[1]))
    return merges


class ByteLevelBPE:
    """Encodes text as GPT-2 does: UTF-8 bytes spelled with ``byte_symbols``, split into
    pieces, each piece merged pair by pair, lowest-ranked pair first."""

    def __init__(self, vocab: dict[str, int], merges: list[tuple[str, str]]) -> None:
        self._vocab = vocab
        self._inverse = {i: token for token, i in vocab.items()}
        self._ranks = {pair: rank for rank, pair in enumerate(merges)}
        self._symbols = byte_symbols()
        self._bytes = {symbol: byte for byte, symbol in enumerate(self._symbols)}
        self._known: dict[str, list[str]] = {}  # piece -> its tokens; text repeats pieces

    @classmethod
    def from_files(cls, vocab_file: str | Path, merge_file: str | Path) -> "ByteLevelBPE":
        return cls(load_vocab(vocab_file), load_merges(merge_file))

    # What megatron-core's MegatronTokenizerText reads of its library.
    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def vocab(self) -> dict[str, int]:
        return self._vocab

    @property
    def inv_vocab(self) -> dict[int, str]:
        return self._inverse

    @property
    def eod(self) -> int:
        return self._vocab[END_OF_TEXT]

    @property
    def eos_id(self) -> int:
        return self.eod

    def text_to_tokens(self, text: str) -> list[str]:
        tokens: list[str] = []
        for piece in _PIECES.findall(text):
            tokens += self._merge("".join(self._symbols[b] for b in piece.encode("utf-8")))
        return tokens

    def tokens_to_ids(self, tokens: list[str]) -> list[int]:
        try:
            return [self._vocab[token] for token in tokens]
        except KeyError as exc:
            raise ValueError(f"token {exc.args[0]!r} is not in the vocabulary (a byte-level "
                             "vocabulary holds all 256 byte symbols and every merge)") from None

    def text_to_ids(self, text: str) -> list[int]:
        return self.tokens_to_ids(self.text_to_tokens(text))

    def ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self._inverse[int(i)] for i in ids]

    def tokens_to_text(self, tokens: list[str]) -> str:
        spelled = "".join(tokens)
        return bytes(self._bytes.get(c, ord("?")) for c in spelled).decode("utf-8", "replace")

    def ids_to_text(self, ids: list[int]) -> str:
        return self.tokens_to_text(self.ids_to_tokens(ids))

    def _merge(self, word: str) -> list[str]:
        """The tokens of one piece: merge its lowest-ranked adjacent pair until none ranks."""
        if word in self._known:
            return self._known[word]
        parts = list(word)
        while len(parts) > 1:
            pairs = list(zip(parts, parts[1:]))
            best = min(pairs, key=lambda p: self._ranks.get(p, len(self._ranks)))
            if best not in self._ranks:
                break
            merged, i = [], 0
            while i < len(parts):
                if i + 1 < len(parts) and (parts[i], parts[i + 1]) == best:
                    merged.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        self._known[word] = parts
        return parts
