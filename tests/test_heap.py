"""The server's heap trimmer (kdtree_jax/serving/heap.py): on glibc it hands free heap pages back to the system on a
thread of its own; a bad interval is refused."""

import ctypes
import platform
import time

import pytest

from kdtree_jax.serving.heap import HeapTrimmer


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_trimmer_runs_and_hands_free_heap_pages_back():
    """Memory freed inside the heap stays resident until malloc_trim: 64 MiB in 4 KiB blocks (well under the size
    glibc maps on its own) with one block kept at the heap's top, so that nothing can shrink from the top, is
    resident after the free; the trimmer's thread gives most of it back within a few intervals."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(4096) for _ in range(16384)]
    for p in blocks:
        ctypes.memset(p, 1, 4096)
    keep = libc.malloc(4096)
    before = _rss_kib()
    for p in blocks:
        libc.free(p)
    held = _rss_kib()
    trimmer = HeapTrimmer(every_s=0.05)
    try:
        assert trimmer.available
        deadline = time.monotonic() + 10
        while (trimmer.trims < 3 or _rss_kib() > held - 32 * 1024) and time.monotonic() < deadline:
            time.sleep(0.05)
        after = _rss_kib()
    finally:
        trimmer.stop()
        libc.free(keep)
    assert trimmer.trims >= 3
    assert held > before - 16 * 1024, (before, held)  # freed but still resident
    assert after < held - 32 * 1024, (before, held, after)  # handed back
    stopped = trimmer.trims
    time.sleep(0.2)
    assert trimmer.trims == stopped  # stop() ends the thread


@pytest.mark.parametrize("every", [0, -1.0, float("nan")])
def test_bad_interval_is_refused(every):
    with pytest.raises(ValueError, match="heap trim interval"):
        HeapTrimmer(every_s=every)

