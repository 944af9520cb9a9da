"""Giving the C heap's free memory back to the operating system while a server runs.

glibc's malloc serves a large allocation with its own mapping, which `free` unmaps, but after such a block is freed
it raises that size limit to the block's size (up to 32 MiB), so that later blocks of that size come from the heap.
Memory freed inside the heap stays with the process for reuse: under a mix of requests whose buffers come and go in
many sizes, the resident set rises in steps and does not come down (issue 46's soak: +5-6% over 20 minutes on the
embedded model, in steps of 10-60 MiB with no new compilation). `malloc_trim(0)` hands the free pages inside the heap
back (glibc 2.8+ releases them wherever they lie, not only at its top). `HeapTrimmer` calls it every few seconds on
a thread of its own, which costs a walk of the heap's free lists (about a millisecond) and, for the pages handed back,
a page fault when they are used again. Elsewhere (another C library, macOS) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

DEFAULT_EVERY_S = 10.0


def _malloc_trim():
    """glibc's malloc_trim, or None where the C library has none."""
    name = ctypes.util.find_library("c")
    try:
        fn = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


class HeapTrimmer:
    """Calls malloc_trim(0) every `every_s` seconds until `stop()`; `available` is False (and nothing runs) where the
    C library has no malloc_trim. `trims` counts the calls made."""

    def __init__(self, every_s: float = DEFAULT_EVERY_S):
        if not every_s > 0:
            raise ValueError(f"the heap trim interval must be a positive number of seconds, got {every_s!r}")
        self.every_s = every_s
        self.trims = 0
        self._trim = _malloc_trim()
        self._stop = threading.Event()
        self._thread = None
        if self._trim is not None:
            self._thread = threading.Thread(target=self._loop, name="kdtree-jax-heap-trim", daemon=True)
            self._thread.start()

    @property
    def available(self) -> bool:
        return self._trim is not None

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self._trim(0)
            self.trims += 1

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
