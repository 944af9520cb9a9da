"""The corpus every machine has: the Python standard library's own source files (`Lib/` of the running interpreter),
split deterministically into train and held-out files by a hash of their relative path; bytes as tokens.

Training (`kdtree_jax.train`), the benchmarks' prompts (`kdtree-jax bench`, `bench-serve`) and the notebooks read
it through these helpers.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

import numpy as np

from .configs import TINY_BOS

HELDOUT_PERCENT = 10


def corpus_split(root: str | None = None) -> tuple[list[Path], list[Path]]:
    """(train files, held-out files) among the .py files of the standard library, by md5 of the relative path."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts)
    train, held = [], []
    for p in files:
        h = int(hashlib.md5(str(p.relative_to(root)).encode()).hexdigest(), 16)
        (held if h % 100 < HELDOUT_PERCENT else train).append(p)
    return train, held


def load_tokens(files: list[Path]) -> np.ndarray:
    """Byte tokens of the files, each file preceded by BOS: int32 [n]."""
    parts = []
    for p in files:
        data = np.frombuffer(p.read_bytes(), np.uint8).astype(np.int32)
        parts.append(np.concatenate([[TINY_BOS], data]))
    return np.concatenate(parts) if parts else np.zeros((0,), np.int32)


def windows(tokens: np.ndarray, rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
    """`batch` random windows of `length` tokens: int32 [batch, length]."""
    starts = rng.integers(0, len(tokens) - length, size=batch)
    return np.stack([tokens[s:s + length] for s in starts])
