"""benchmarks/marlin_stages.py: the early returns it patches into the marlin_moe handler still find their places
(the GPU run itself is a benchmark, not a test)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import marlin_stages  # noqa: E402

HANDLER = os.path.join(os.path.dirname(__file__), "..", "ffi", "marlin_moe.cu")


def test_every_stage_return_lands_once_in_the_handler():
    with open(HANDLER) as f:
        src = f.read()
    out = marlin_stages.patched_source(src)
    for stage in (0, 1, 2, 3):
        assert out.count(f"if (KD_STOP == {stage}) return ffi::Error::Success();") == 1
    # in the handler's order: nothing launched, align, gate/up (down not yet), down (the combine not yet)
    at = [out.index(f"KD_STOP == {stage})") for stage in (0, 1, 3)]
    assert at == sorted(at)
    assert out.index("KD_STOP == 0)") < out.index("AlignKernel<<<")
    assert out.index("KD_STOP == 1)") > out.index("AlignKernel<<<")
    assert out.index("KD_STOP == 3)") < out.index("return Launch(CombineKernel8,")
    gemm2 = out.index("return LaunchGemm<NT, false, kL2, kPersist>(stream, g2,")
    assert out.rindex("KD_STOP == 2)", 0, gemm2) > out.index("LaunchGemm<NT, true, kL2, kPersist>(stream, g1,")
    assert len(out) - len(src) == sum(len(line) for _, line, _ in marlin_stages.PATCHES)


def test_a_handler_that_moved_on_is_named():
    with open(HANDLER) as f:
        src = f.read().replace('LastError("align launch")', 'LastError("the align launch")')
    with pytest.raises(SystemExit, match="the handler changed"):
        marlin_stages.patched_source(src)
