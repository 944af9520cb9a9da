"""Tokenizers: bytes for the tiny and embedded models, tiktoken for Kimi checkpoints (offline, from files)."""

from __future__ import annotations

from .configs import BYTE_VOCAB, TINY_BOS, TINY_EOS, TINY_MASK, TINY_PAD


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then BOS, EOS, PAD and MASK (the drafter's mask token)."""

    vocab_size = BYTE_VOCAB + 4
    bos_id, eos_id, pad_id, mask_id = TINY_BOS, TINY_EOS, TINY_PAD, TINY_MASK

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in ids if 0 <= i < BYTE_VOCAB).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"
