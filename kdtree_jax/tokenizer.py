"""Tokenizers: bytes for the tiny and embedded models, tiktoken for Kimi checkpoints (offline, from files)."""

from __future__ import annotations

import base64
import binascii
import json
import os

import tiktoken

from .configs import BYTE_VOCAB, TINY_BOS, TINY_EOS, TINY_MASK, TINY_PAD
from .validate import path_problem, shown


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then BOS, EOS, PAD and MASK (the drafter's mask token)."""

    vocab_size = BYTE_VOCAB + 4
    bos_id, eos_id, pad_id, mask_id = TINY_BOS, TINY_EOS, TINY_PAD, TINY_MASK

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in ids if 0 <= i < BYTE_VOCAB).decode("utf-8", errors="replace")

    def token_bytes(self, i: int) -> bytes:
        """The bytes token i stands for (none for the special tokens)."""
        return bytes([i]) if 0 <= i < BYTE_VOCAB else b""

    def __repr__(self) -> str:
        return "ByteTokenizer()"


# Kimi's pre-tokenization regex: `TikTokenTokenizer.pat_str` of Moonshot's tokenization_kimi.py, verbatim (data that
# describes the tokenizer format). Source: the copy of tokenization_kimi.py in github.com/troy12x/quasar-kimi
# (docs/model.md §8); several independent ports of the same file carry the identical pattern.
# `&&[^\p{Han}]` is a character-class intersection, which tiktoken's regex engine supports.
KIMI_PAT_STR = "|".join([  # noqa: FLY002 (the list form of the source)
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
# Special tokens take ids num_base .. num_base + 257 (tokenization_kimi.py: 256 reserved + 2).
NUM_SPECIAL_TOKENS = 256 + 2
# tiktoken panics on very long inputs and very long runs of (non-)whitespace; Kimi's tokenizer splits them first.
MAX_ENCODE_CHARS = 400_000
MAX_RUN_CHARS = 25_000

TIKTOKEN_FILE = "tiktoken.model"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


def load_tiktoken_ranks(path: str | os.PathLike) -> dict[bytes, int]:
    """A tiktoken BPE file (one `base64-token rank` per line) as {token bytes: rank}, read offline."""
    ranks = {}
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except (ValueError, binascii.Error):
                raise ValueError(f"{path}:{n}: not a tiktoken BPE line (base64 token, rank)") from None
    if not ranks:  # (tiktoken's own error said "max() arg is an empty sequence")
        raise ValueError(f"{path}: holds no tokens (an empty tiktoken BPE file)")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: the ranks are not 0 .. {len(ranks) - 1} without gaps")
    return ranks


def _token_name(value) -> str | None:
    """A token as tokenizer_config.json writes it: a string, or a dict with its "content"."""
    return value.get("content") if isinstance(value, dict) else value


class TiktokenTokenizer:
    """Kimi K2.x's tokenizer: tiktoken BPE over `tiktoken.model` with Kimi's split pattern and special tokens.

    The special tokens fill the ids right after the base ranks; their names come from `added_tokens_decoder` in
    tokenizer_config.json, else `<|reserved_token_{id}|>` (as in Moonshot's tokenization_kimi.py). `encode` treats
    special-token text as the special token (tiktoken `allowed_special="all"`, Kimi's default).
    """

    mask_id = None  # Kimi defines no mask token

    def __init__(self, model_file: str | os.PathLike, config: dict | None = None):
        config = config or {}
        ranks = load_tiktoken_ranks(model_file)
        self.num_base = len(ranks)
        if not isinstance(config, dict):
            raise ValueError(f"{TOKENIZER_CONFIG_FILE} must hold a JSON object, got {shown(config)}")
        added = config.get("added_tokens_decoder") or {}
        try:
            names = {int(i): _token_name(t) for i, t in added.items()}
        except (AttributeError, TypeError, ValueError):
            raise ValueError(f"{TOKENIZER_CONFIG_FILE}: added_tokens_decoder must map token ids to tokens, got "
                             f"{shown(added)}") from None
        ids = range(self.num_base, self.num_base + NUM_SPECIAL_TOKENS)
        self.special_tokens = {names.get(i) or f"<|reserved_token_{i}|>": i for i in ids}
        self._enc = tiktoken.Encoding(name=os.path.basename(model_file), pat_str=KIMI_PAT_STR,
                                      mergeable_ranks=ranks, special_tokens=self.special_tokens)
        self.vocab_size = self._enc.n_vocab
        for field in ("bos_token", "eos_token"):  # one named but not a token: no row would ever end (or begin) with it
            name = _token_name(config.get(field))
            if name is not None and name not in self.special_tokens:
                raise ValueError(f"{TOKENIZER_CONFIG_FILE}: {field} {shown(name)} is not one of the special tokens "
                                 "(added_tokens_decoder)")
        self.bos_id = self.special_tokens.get(_token_name(config.get("bos_token")) or "[BOS]")
        self.eos_id = self.special_tokens.get(_token_name(config.get("eos_token")) or "[EOS]")
        self.pad_id = self.special_tokens.get(_token_name(config.get("pad_token")) or "[PAD]")

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        """Token ids of `text`; with allow_special=False, special-token text is encoded as plain text."""
        special = {"allowed_special": "all"} if allow_special else {"disallowed_special": ()}
        ids: list[int] = []
        for start in range(0, len(text), MAX_ENCODE_CHARS):
            for piece in _split_runs(text[start:start + MAX_ENCODE_CHARS], MAX_RUN_CHARS):
                ids.extend(self._enc.encode(piece, **special))
        return ids

    def decode(self, ids) -> str:
        """Text of the ids (ids outside the tokenizer's vocabulary are dropped; invalid UTF-8 is replaced)."""
        return self._enc.decode([int(i) for i in ids if 0 <= int(i) < self.vocab_size], errors="replace")

    def token_bytes(self, i: int) -> bytes:
        """The bytes token i stands for (a special token: its name's)."""
        return self._enc.decode_single_token_bytes(int(i)) if 0 <= int(i) < self.vocab_size else b""

    def __repr__(self) -> str:
        return f"TiktokenTokenizer(num_base={self.num_base}, vocab_size={self.vocab_size})"


def _split_runs(s: str, max_run: int):
    """Split s so that no piece holds more than max_run consecutive whitespace or non-whitespace characters."""
    start, run, space = 0, 0, s[:1].isspace()
    for i, ch in enumerate(s):
        if ch.isspace() != space:
            run, space = 1, ch.isspace()
        else:
            run += 1
            if run > max_run:
                yield s[start:i]
                start, run = i, 1
    yield s[start:]


def load_tokenizer(directory: str | os.PathLike):
    """The tokenizer of a checkpoint directory: TiktokenTokenizer when it holds `tiktoken.model` (with
    tokenizer_config.json when present), else ByteTokenizer. A ValueError names a tokenizer file that is there but
    is not a regular file (a directory, a FIFO, which would block the read, a symlink loop or to nothing), or does not
    parse."""
    model_file = os.path.join(directory, TIKTOKEN_FILE)
    if not _present(model_file):
        return ByteTokenizer()
    config_file = os.path.join(directory, TOKENIZER_CONFIG_FILE)
    config = None
    if _present(config_file):
        try:
            with open(config_file) as f:
                config = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise ValueError(f"{config_file}: not valid JSON ({type(e).__name__}: {e})") from None
    return TiktokenTokenizer(model_file, config)


def _present(path: str) -> bool:
    """Whether a tokenizer file is there: False when nothing is at path; a ValueError naming it when something is but
    it is not a regular file (it used to be taken as no file, or opened: a FIFO blocked the load forever)."""
    if not os.path.lexists(path):
        return False
    why = path_problem(path)
    if why is not None:
        raise ValueError(f"{path} {'is a symbolic link to nothing' if why == 'is missing' else why}")
    return True
