"""Argument checks shared by the API (`generate`, `stream`, `forward`), the serving engine, the HTTP server and the
command line: one rule per kind of argument, so that a value refused in one place is refused in all of them.

Each rule returns the value in its canonical Python type or raises an `ArgumentError` (a ValueError) that names the
argument, the range it must lie in and the value given. Integers refuse floats and booleans (`eos_id=4.7` is an
error, not token 4); numbers refuse booleans, NaN and infinities; every range is that of the dtype the value is
stored in on the device: token ids and top_k in int32, temperature and top_p in float32 (a value that would round to
0 or inf there is refused), seeds below 2**63 (two uint32 words).
"""

from __future__ import annotations

import math
import os
import stat
from typing import Sequence

import jax
import numpy as np

INT32_LIMIT = 2**31  # top_k, max_tokens and token ids are int32 on the device
SEED_LIMIT = 2**63
FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # the smallest normal float32
FLOAT32_MAX = float(np.finfo(np.float32).max)


class ArgumentError(ValueError):
    """An argument of the wrong type or outside its range; `name` is the argument as its caller spells it."""

    def __init__(self, name: str, message: str):
        super().__init__(message)
        self.name = name


def _bound(n: int) -> str:
    """n as written in a message: 2**63 rather than 9223372036854775808."""
    return f"2**{n.bit_length() - 1}" if n >= 2**16 and n & (n - 1) == 0 else str(n)


TRACED_HINT = ("generate and stream run their own compiled loop on the host and take concrete values: call them "
               "outside jax.jit, vmap and grad (forward may be traced)")


def not_traced(name: str, value) -> None:
    """A TypeError naming the argument when `value` is a traced value (inside jax.jit, vmap or grad), which has no
    number or ids to check or read (JAX's own error named neither the argument nor the call)."""
    if isinstance(value, jax.core.Tracer):
        raise TypeError(f"{name} is a traced value ({value.aval.str_short()}): {TRACED_HINT}")


def scalar(value, name: str = "value"):
    """A numpy scalar or a 0-d array (numpy's or jax's) as the Python number or bool it holds; anything else as it
    is. So `temperature=jnp.float32(0.5)` is 0.5, and a float16 compares without a cast warning. A traced value is
    a TypeError naming `name`; a 0-d array that holds no number (a jax.random key) stays as it is, for the rule to
    refuse by its type."""
    not_traced(name, value)
    if isinstance(value, np.generic) or (getattr(value, "shape", None) == () and hasattr(value, "dtype")
                                          and hasattr(value, "item")):
        if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):  # .item() is NotImplementedError
            return value
        return value.item()
    return value


def is_integer(value) -> bool:
    """Whether value is a Python or numpy integer (not a bool)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def shown(value, limit: int = 60) -> str:
    """repr(value) for a message, cut to `limit` characters (a request's 5 MB field is not sent back whole)."""
    text = repr(value).replace("\n", " ")  # one line: an array's repr has several (a str's escapes its own)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def is_real(value) -> bool:
    """Whether value is a Python or numpy real number (not a bool)."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def integer(name: str, value, low: int | None = None, high: int | None = None, *, optional: bool = False):
    """value as an int: a Python or numpy integer (not a bool, not a float) in [low, high) (None: unbounded); None
    passes when `optional`."""
    value = scalar(value, name)
    if value is None and optional:
        return None
    if not is_integer(value) or (low is not None and value < low) or (high is not None and value >= high):
        if low is not None and high is not None:
            need = f"an integer in [{_bound(low)}, {_bound(high)})"
        elif low is not None:
            need = f"an integer >= {_bound(low)}"
        else:
            need = "an integer" + (f" < {_bound(high)}" if high is not None else "")
        raise ArgumentError(name, f"{name} must be {'None or ' if optional else ''}{need}, got {shown(value)}")
    return int(value)


def seconds(name: str, value) -> float:
    """value as a float: a finite number of seconds > 0 (a timeout)."""
    value = scalar(value, name)
    if not is_real(value) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {shown(value)}")
    return float(value)


def flag(name: str, value) -> bool:
    """value as a bool: True or False only (not 0, 1 or "yes")."""
    if not isinstance(value, (bool, np.bool_)):
        raise ArgumentError(name, f"{name} must be true or false, got {shown(value)}")
    return bool(value)


def temperature(value, name: str = "temperature") -> float:
    """A sampling temperature: a finite number >= 0 (0: greedy), inside float32's normal range when it is not 0
    (sampling divides float32 logits by it)."""
    value = scalar(value, name)
    if not is_real(value) or not math.isfinite(value) or value < 0:
        raise ArgumentError(name, f"{name} must be a finite number >= 0, got {shown(value)}")
    if 0 < value < FLOAT32_TINY or value > FLOAT32_MAX:
        raise ArgumentError(name, f"{name} {shown(value)} is outside float32's normal range [{FLOAT32_TINY:.4g}, "
                                  f"{FLOAT32_MAX:.4g}] (it would round to 0 or inf); use 0 for greedy decoding")
    return float(value)


def top_k(value, name: str = "top_k") -> int | None:
    """None (all tokens) or an integer in [1, 2**31): the number of most likely tokens kept."""
    return integer(name, value, 1, INT32_LIMIT, optional=True)


def top_p(value, name: str = "top_p") -> float | None:
    """None or a number in (0, 1], at least float32's smallest normal number: the nucleus' mass; 1 is returned as
    None (no nucleus)."""
    value = scalar(value, name)
    if value is None:
        return None
    if not is_real(value) or not 0 < value <= 1:
        raise ArgumentError(name, f"{name} must be None or a number in (0, 1], got {shown(value)}")
    if value < FLOAT32_TINY:
        raise ArgumentError(name, f"{name} {shown(value)} is below float32's normal range (>= {FLOAT32_TINY:.4g}): it "
                                  "would round to 0")
    return None if value == 1 else float(value)


def seed(value, name: str = "seed") -> int:
    """A random seed: an integer in [0, 2**63)."""
    return integer(name, value, 0, SEED_LIMIT)


def prng_key(value, name: str = "key"):
    """A JAX random key: a typed key array (`jax.random.key(0)`) of shape (), or a raw uint32 key of shape (2,)
    (`jax.random.PRNGKey(0)`); an int or any other array is refused naming the argument (JAX's own error,
    'invalid PRNG key data', names none)."""
    shape, dtype = tuple(getattr(value, "shape", ()) or ()), getattr(value, "dtype", None)
    typed = dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
    if (typed and shape == ()) or (not typed and dtype is not None and np.dtype(dtype) == np.uint32
                                   and shape == (2,)):
        return value
    got = (f"keys of shape {shape}" if typed else f"an array of {np.dtype(dtype).name} {shape}" if dtype is not None
           else f"{type(value).__name__} {shown(value)}")
    raise ArgumentError(name, f"{name} must be a JAX random key of one draw, e.g. jax.random.key(0), got {got}")


def token_id(name: str, value, vocab_size: int, *, optional: bool = False) -> int | None:
    """A token id in [0, vocab_size) (eos_id, for one)."""
    value = scalar(value, name)
    if value is None and optional:
        return None
    if not is_integer(value):
        raise ArgumentError(name, f"{name} must be {'None or ' if optional else ''}an integer token id, got "
                                  f"{shown(value)}")
    if not 0 <= value < vocab_size:
        raise ArgumentError(name, f"{name} {value} is outside the vocabulary [0, {vocab_size})")
    return int(value)


ENCODE_HINT = "encode text with the model's tokenizer first (model.tokenizer.encode(text))"


def _ids(what: str, name: str, r, vocab_size: int) -> np.ndarray:
    """One token-id sequence `r` as int32, `what` naming it in messages ("prompt", "prompts: prompt 2")."""
    not_traced(what, r)
    if isinstance(r, (str, bytes, bytearray, memoryview)):
        raise ArgumentError(name, f"{what} is {'text' if isinstance(r, (str, bytes)) else 'bytes'}, not token ids: "
                                  f"{ENCODE_HINT}")
    if isinstance(r, Sequence) and any(isinstance(x, (bool, np.bool_)) for x in r):
        raise TypeError(f"{what} holds booleans, not token ids")
    try:
        a = np.asarray(r)
    except ValueError:  # ragged nesting
        raise ArgumentError(name, f"{what} must be a flat sequence of token ids") from None
    if a.ndim != 1 or a.size == 0:
        raise ArgumentError(name, f"{what} must be a non-empty 1-D sequence of token ids, got shape {a.shape}")
    if not np.issubdtype(a.dtype, np.integer) and all(is_integer(x) for x in r):  # integers past int64, which numpy
        bad = next((int(x) for x in r if not 0 <= x < vocab_size), None)  # makes objects or float64
        if bad is not None:
            raise ArgumentError(name, f"{what} has token id {bad} outside the vocabulary [0, {vocab_size})")
    if not np.issubdtype(a.dtype, np.integer):
        if a.dtype.kind in "US":
            raise TypeError(f"{what} holds text, not token ids: {ENCODE_HINT}")
        raise TypeError(f"{what} must hold integer token ids, got dtype {a.dtype}")
    if a.min() < 0 or a.max() >= vocab_size:
        bad = int(a[(a < 0) | (a >= vocab_size)][0])
        raise ArgumentError(name, f"{what} has token id {bad} outside the vocabulary [0, {vocab_size})")
    return a.astype(np.int32)


def token_row(value, vocab_size: int, name: str = "prompt") -> np.ndarray:
    """One prompt as an int32 array: a non-empty 1-D sequence of integers in [0, vocab_size) (text is refused with
    a pointer to the tokenizer). TypeError for ids that are not integers."""
    return _ids(name, name, value, vocab_size)


def token_rows(rows, vocab_size: int, name: str = "prompts", row: str = "prompt") -> list[np.ndarray]:
    """Token-id rows (a list of lists, or an array [B, T]) as int32 arrays: at least one row, every row a non-empty
    1-D sequence of integers in [0, vocab_size). `name` is the argument, `row` what one row is called in messages.
    TypeError for ids that are not integers."""
    not_traced(name, rows)
    if isinstance(rows, (str, bytes)):
        raise ArgumentError(name, f"{name} is text, not lists of token ids: {ENCODE_HINT}, one list per {row}")
    if isinstance(rows, np.ndarray) or (hasattr(rows, "__array__") and not isinstance(rows, Sequence)):
        arr = np.asarray(rows)
        if arr.ndim != 2:
            raise ArgumentError(name, f"{name} as an array must be [B, T], got shape {arr.shape}")
        rows = list(arr)
    if not isinstance(rows, Sequence) or len(rows) == 0:
        raise ArgumentError(name, f"{name} must be a non-empty list of token-id lists (or a [B, T] array)")
    if all(is_integer(r) for r in rows):
        raise ArgumentError(name, f"{name} must be a list of {row}s (token-id lists); wrap a single {row} in []")
    return [_ids(f"{name}: {row} {i}", name, r, vocab_size) for i, r in enumerate(rows)]


def path_problem(path, want_dir: bool = False) -> str | None:
    """Why `path` is not the regular file (or, want_dir, the directory) a reader wants, in the words the checkpoint
    reader and the command line share: "is missing", "does not open: <why>" (a symlink loop, no permission), "is a
    directory", "is not a regular file" / "is not a directory"; None when it is what is wanted."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "is missing"
    except OSError as e:
        return f"does not open: {e.strerror}"
    if want_dir:
        return None if stat.S_ISDIR(mode) else "is not a directory"
    if stat.S_ISREG(mode):
        return None
    return "is a directory" if stat.S_ISDIR(mode) else "is not a regular file"
