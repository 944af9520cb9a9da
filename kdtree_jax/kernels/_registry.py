"""Finds the FFI libraries built from `ffi/`, loads them with ctypes and registers their targets with XLA, once.

`libkdtree_jax_cpu.so` (C++ handlers) is always built; `libkdtree_jax_cuda.so` (CUDA handlers, sm_90a) only where
nvcc was found at build time. When the CUDA library is missing or does not load, every CUDA target is registered to
a stub that fails with a readable message when it runs (instead of an unregistered-target error), and the reason is
kept in `cuda_status()`. The libraries are looked up in $KDTREE_JAX_FFI_DIR (if set), then next to the package.
A C++ library that is found but does not load (truncated, corrupt, built for another platform) raises
`FfiLibraryError`, which names the file and says how to rebuild it.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.resources
import os
import warnings

import jax

CPU_LIBRARY = "libkdtree_jax_cpu.so"
CUDA_LIBRARY = "libkdtree_jax_cuda.so"

# target name -> exported handler symbol
CPU_TARGETS = {
    "kdtree_tree_build": "KdTreeBuildCpu",
    "kdtree_tree_build_levels": "KdTreeBuildLevelsCpu",
    "kdtree_tree_accept": "KdTreeAcceptCpu",
    "kdtree_mla_verify": "KdMlaVerifyCpu",
    "kdtree_marlin_moe": "KdMarlinMoeCpu",
    "kdtree_moe_route": "KdMoeRouteCpu",
    "kdtree_move_rows": "KdMoveRowsCpu",
    "kdtree_mla_pre": "KdMlaPreCpu",
    "kdtree_fused_dot": "KdFusedDotCpu",
    "kdtree_draft_attention": "KdDraftAttentionCpu",
}
CUDA_TARGETS = {
    "kdtree_tree_build": "KdTreeBuildCuda",
    "kdtree_tree_accept": "KdTreeAcceptCuda",
    "kdtree_mla_verify": "KdMlaVerifyCuda",
    "kdtree_marlin_moe": "KdMarlinMoeCuda",
    "kdtree_marlin_moe_fused": "KdMarlinMoeFusedCuda",
    "kdtree_moe_route": "KdMoeRouteCuda",
    "kdtree_move_rows": "KdMoveRowsCuda",
    "kdtree_mla_pre": "KdMlaPreCuda",
    "kdtree_fused_dot": "KdFusedDotCuda",
    "kdtree_draft_attention": "KdDraftAttentionCuda",
}

_cuda_error: str | None = None
REBUILD_HINT = ("rebuild it with `pip install -e .` (which runs the CMake build of ffi/), or point KDTREE_JAX_FFI_DIR "
                "at a directory holding a good build")


class FfiLibraryError(OSError):
    """A custom-call library file that exists but cannot be loaded."""


def _candidates(name: str) -> list[str]:
    paths = []
    if os.environ.get("KDTREE_JAX_FFI_DIR"):
        paths.append(os.path.join(os.environ["KDTREE_JAX_FFI_DIR"], name))
    paths.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), name))
    try:  # the installed package (editable installs keep the built libraries apart from the sources)
        paths.append(str(importlib.resources.files("kdtree_jax").joinpath(name)))
    except (ModuleNotFoundError, TypeError, ValueError):
        pass
    return list(dict.fromkeys(paths))


def _find(name: str) -> str | None:
    return next((p for p in _candidates(name) if os.path.isfile(p)), None)


@functools.cache
def cpu_library() -> ctypes.CDLL:
    """The C++ handlers; raises RuntimeError if the package was installed without building them."""
    path = _find(CPU_LIBRARY)
    if path is None:
        raise RuntimeError(
            f"kdtree-jax: {CPU_LIBRARY} not found (looked in {_candidates(CPU_LIBRARY)}). Install the package with "
            "pip (which runs the CMake build of ffi/), set KDTREE_JAX_FFI_DIR, or pass impl='xla'.")
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        reason = str(e).removeprefix(f"{path}: ")
        raise FfiLibraryError(f"{path} is not a loadable library ({reason}); {REBUILD_HINT}, or pass "
                              "impl='xla'") from None
    if not hasattr(lib, "KdTreeBuildWorkspaceBytes"):
        raise FfiLibraryError(f"{path} is not this package's library or predates it (no KdTreeBuildWorkspaceBytes); "
                              f"{REBUILD_HINT}")
    lib.KdTreeBuildWorkspaceBytes.restype = ctypes.c_int64
    lib.KdTreeBuildWorkspaceBytes.argtypes = [ctypes.c_int64] * 4
    return lib


@functools.cache
def cuda_library() -> ctypes.CDLL | None:
    """The CUDA handlers, or None (the reason is in `cuda_status()`)."""
    global _cuda_error
    path = _find(CUDA_LIBRARY)
    if path is None:
        _cuda_error = f"{CUDA_LIBRARY} was not built (no nvcc at build time?)"
        return None
    try:
        return ctypes.CDLL(path)
    except OSError as e:
        _cuda_error = f"{path} failed to load: {e}; {REBUILD_HINT}"
        return None


def cuda_status() -> str:
    """'ok', or why the CUDA handlers are unavailable."""
    return "ok" if cuda_library() is not None else str(_cuda_error)


@functools.cache
def register() -> None:
    """Registers every target for platform "cpu" and "CUDA" (idempotent)."""
    cpu = cpu_library()
    for name, symbol in CPU_TARGETS.items():
        if not hasattr(cpu, symbol):
            raise RuntimeError(f"kdtree-jax: {cpu._name} has no handler {symbol}: the library predates this "
                               "version of the package; rebuild it (pip install -e . or a CMake build of ffi/)")
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(cpu, symbol)), platform="cpu")
    cuda = cuda_library()
    if cuda is None and any(d.platform == "gpu" for d in jax.devices()):
        warnings.warn(f"kdtree-jax: CUDA custom calls unavailable: {cuda_status()}; they will fail if run "
                      "(use impl='xla').", RuntimeWarning, stacklevel=3)
    for name, symbol in CUDA_TARGETS.items():
        fn = getattr(cuda, symbol, None) if cuda is not None else None
        if cuda is not None and fn is None:
            warnings.warn(f"kdtree-jax: {cuda._name} has no handler {symbol} (built before it existed; rebuild): "
                          f"{name} fails if run on a GPU", RuntimeWarning, stacklevel=3)
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(fn or cpu.KdCudaUnavailable), platform="CUDA")


def tree_build_workspace_bytes(b: int, l: int, v: int, budget: int) -> int:
    """Bytes of scratch the CUDA tree_build handler needs (its last output), from the C++ plan in ffi/common.h."""
    return int(cpu_library().KdTreeBuildWorkspaceBytes(b, l, v, budget))
