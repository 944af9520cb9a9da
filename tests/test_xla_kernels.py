"""benchmarks/xla_kernels.py's reading of optimized HLO text (the deviceless compile itself needs jax's CUDA plugin and
is not run here): which instructions launch kernels, how many, and the bytes their shapes say they move."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

from xla_kernels import entry_kernels, intermediates, layer_diff, shape_bytes, xla_bytes  # noqa: E402

# A hand-written ENTRY in the form `compiled.as_text()` prints: a norm's reduce, a weight-sized product written by
# one fusion and reduced by another, an in-place cache update, a custom call with a tuple result.
HLO = """HloModule jit_step, entry_computation_layout={()}

%fused_multiply (p0: bf16[1536,8,192], p1: bf16[1536]) -> bf16[1536,8,192] {
  %p0 = bf16[1536,8,192]{2,1,0} parameter(0)
  ROOT %m = bf16[1536,8,192]{2,1,0} multiply(%p0, %p0)
}

ENTRY %main.1 (p_w: bf16[1536,8,192], p_x: bf16[1,1536], p_cache: bf16[1,4096,512]) -> bf16[8,192] {
  %p_w = bf16[1536,8,192]{2,1,0} parameter(0), metadata={op_name="w"}
  %p_x = bf16[1,1536]{1,0} parameter(1)
  %p_cache = bf16[1,4096,512]{2,1,0} parameter(2)
  %bitcast.1 = bf16[1536]{0} bitcast(%p_x)
  %input_reduce_fusion.3 = f32[] fusion(%p_x), kind=kInput, calls=%fused_reduce
  %loop_multiply_fusion.13 = bf16[1536,8,192]{2,1,0} fusion(%p_w, %bitcast.1), kind=kLoop, calls=%fused_multiply
  %input_reduce_fusion.22 = bf16[8,192]{1,0} fusion(%loop_multiply_fusion.13), kind=kInput, calls=%fused_reduce.2
  %loop_dynamic_update_slice_fusion = bf16[1,4096,512]{2,1,0} fusion(%p_cache, %p_x), kind=kLoop, calls=%fused_dus
  %bitcast.9 = bf16[1536]{0} bitcast(%loop_multiply_fusion.13)
  %ffi_call.7 = (bf16[1,8,512]{2,1,0}, f32[1,16,8,2]{3,2,1,0}) custom-call(%bitcast.9, %p_cache), \
custom_call_target="kdtree_mla_verify", api_version=API_VERSION_TYPED_FFI
  %get-tuple-element.1 = bf16[1,8,512]{2,1,0} get-tuple-element(%ffi_call.7), index=0
  ROOT %tuple = (bf16[8,192]{1,0}) tuple(%input_reduce_fusion.22)
}
"""

W = 1536 * 8 * 192 * 2  # the weight's bytes (bf16)


def test_shape_bytes_counts_every_array_of_a_tuple():
    assert shape_bytes("bf16[2,3]{1,0}") == 12
    assert shape_bytes("(bf16[2,3]{1,0}, f32[])") == 16
    assert shape_bytes("pred[7]") == 7 and shape_bytes("s4[16]") == 8
    assert shape_bytes("token[]") == 0


def test_entry_kernels_lists_launches_in_program_order():
    ks = entry_kernels(HLO)
    assert [k["kind"] for k in ks] == ["input_reduce_fusion", "loop_multiply_fusion", "input_reduce_fusion",
                                       "loop_dynamic_update_slice_fusion", "kdtree_mla_verify"]
    assert [k["kernels"] for k in ks] == [1, 1, 1, 1, 2]  # mla_verify: its kernel and the split combine
    product = ks[1]
    assert product["bytes_out"] == W and product["bytes_in"] == W + 1536 * 2  # the bitcast's shape is an operand's
    assert product["inputs"] == ["p_w", "p_x"]  # the bitcast named by what it views
    assert ks[4]["bytes_out"] == 8 * 512 * 2 + 16 * 8 * 2 * 4 and ks[4]["custom"]
    assert ks[4]["inputs"] == ["loop_multiply_fusion.13", "p_cache"] and ks[4]["bytes_in"] == 1536 * 2 + 4096 * 512 * 2


def test_bytes_count_a_slice_update_as_the_update_and_leave_custom_calls_out():
    ks = entry_kernels(HLO)
    assert xla_bytes(ks[0]) == 1536 * 2 + 4
    assert xla_bytes(ks[1]) == W + 1536 * 2 + W
    assert xla_bytes(ks[3]) == 2 * 1536 * 2  # the cache operand (the output's size) is updated in place
    assert xla_bytes(ks[4]) == 0


def test_intermediates_are_large_outputs_read_back_by_another_kernel():
    got = intermediates(entry_kernels(HLO))
    # the custom call reads the product through a bitcast, which names the kernel that wrote it; the cache update
    # is in place: not one
    assert got == [dict(name="loop_multiply_fusion.13", kind="loop_multiply_fusion", bytes=W,
                        read_by=["input_reduce_fusion.22", "ffi_call.7"])]


def test_layer_diff_is_the_larger_program_beyond_the_smaller():
    ks = entry_kernels(HLO)
    small, large = ks[:1], ks
    d = layer_diff(small, large)
    assert d["launches"] == 5
    assert d["kinds"] == {"input_reduce_fusion": 1, "kdtree_mla_verify": 2, "loop_dynamic_update_slice_fusion": 1,
                          "loop_multiply_fusion": 1}
    assert d["intermediates"] == 1 and d["intermediate_bytes"] == W


def test_text_without_an_entry_is_refused():
    with pytest.raises(ValueError, match="no ENTRY computation"):
        entry_kernels("HloModule m\n")


def test_report_puts_the_base_counts_beside_these():
    from xla_kernels import report
    meta = dict(date="2026-12-05", commit="abc", target="H200", jax="0.10.2", context=4096, layers=3, n=8,
                ffi_ops=["mla_verify"], xla_flags="", program="step")
    layer = dict(launches=29, kinds={"input_reduce_fusion": 12, "kdtree_marlin_moe": 4}, xla_bytes=69.2e6,
                 intermediates=0, intermediate_bytes=0, intermediate_kinds=[])
    base = dict(meta=dict(meta, commit="old"), rows=[dict(batch=1, t=1, layer=dict(layer, launches=34))])
    text = report(meta, [dict(batch=1, t=1, layer=layer)], base)
    assert "| 1 x 1 | 34 -> 29 | 69.2 | 0 (0.0) -> 0 | input_reduce_fusion 12, kdtree_marlin_moe 4 |" in text
    assert "kernels a layer (old -> now)" in text and "one MoE layer" in text
    text = report(dict(meta, program="draft"), [dict(batch=1, t=8, layer=layer)])
    assert "| 1 x 8 | 29 |" in text and "one drafter layer" in text and "--program draft" in text
