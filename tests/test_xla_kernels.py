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


# Fusions reading a weight stacked [3, K, N] (a drafter's layers as one array): the first slices one layer off
# (`slice`, then a bitcast to [K, N]); the second views it as [3, K * N] and dynamic-slices a row (the index is the
# fusion's third operand, used as the dynamic-slice's index, not sliced); the third slices two layers; the fourth
# multiplies the whole weight as well as slicing it; the fifth slices a bitcast of it that a dot also reads; the
# sixth updates the stacked array in place.
STACKED = """HloModule jit_draft, entry_computation_layout={()}

%gemm_fusion_dot.1_computation (parameter_0: bf16[8,64], parameter_1: bf16[3,64,32]) -> bf16[8,32] {
  %parameter_1 = bf16[3,64,32]{2,1,0} parameter(1), metadata={scheduling_name="parameter_1"}
  %slice.1 = bf16[1,64,32]{2,1,0} slice(%parameter_1), slice={[1:2], [0:64], [0:32]}
  %bitcast.1 = bf16[64,32]{1,0} bitcast(%slice.1)
  %parameter_0 = bf16[8,64]{1,0} parameter(0)
  ROOT %dot.1 = bf16[8,32]{1,0} dot(%parameter_0, %bitcast.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%gemm_fusion_dot.2_computation (parameter_0.1: bf16[8,64], parameter_1.1: bf16[3,64,32], parameter_2.1: s32[]) \
-> bf16[8,32] {
  %parameter_1.1 = bf16[3,64,32]{2,1,0} parameter(1)
  %bitcast.2 = bf16[3,2048]{1,0} bitcast(%parameter_1.1)
  %parameter_2.1 = s32[] parameter(2)
  %constant.1 = s32[] constant(0)
  %dynamic-slice.1 = bf16[1,2048]{1,0} dynamic-slice(%bitcast.2, %parameter_2.1, %constant.1), \
dynamic_slice_sizes={1,2048}
  %bitcast.3 = bf16[64,32]{1,0} bitcast(%dynamic-slice.1)
  %parameter_0.1 = bf16[8,64]{1,0} parameter(0)
  ROOT %dot.2 = bf16[8,32]{1,0} dot(%parameter_0.1, %bitcast.3), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_add (param_0.1: bf16[3,64,32]) -> bf16[64,32] {
  %param_0.1 = bf16[3,64,32]{2,1,0} parameter(0)
  %slice.2 = bf16[1,64,32]{2,1,0} slice(%param_0.1), slice={[0:1], [0:64], [0:32]}
  %reshape.1 = bf16[64,32]{1,0} reshape(%slice.2)
  %slice.3 = bf16[1,64,32]{2,1,0} slice(%param_0.1), slice={[2:3], [0:64], [0:32]}
  %reshape.2 = bf16[64,32]{1,0} reshape(%slice.3)
  ROOT %add.1 = bf16[64,32]{1,0} add(%reshape.1, %reshape.2)
}

%fused_multiply (param_0.2: bf16[3,64,32]) -> bf16[3,64,32] {
  %param_0.2 = bf16[3,64,32]{2,1,0} parameter(0)
  %slice.4 = bf16[1,64,32]{2,1,0} slice(%param_0.2), slice={[0:1], [0:64], [0:32]}
  %bitcast.4 = bf16[64,32]{1,0} bitcast(%slice.4)
  %broadcast.1 = bf16[3,64,32]{2,1,0} broadcast(%bitcast.4), dimensions={1,2}
  ROOT %multiply.1 = bf16[3,64,32]{2,1,0} multiply(%param_0.2, %broadcast.1)
}

%fused_computation.5 (param_0.3: bf16[8,2048], param_1.3: bf16[3,64,32]) -> bf16[8,3] {
  %param_1.3 = bf16[3,64,32]{2,1,0} parameter(1)
  %bitcast.5 = bf16[3,2048]{1,0} bitcast(%param_1.3)
  %slice.5 = bf16[1,2048]{1,0} slice(%bitcast.5), slice={[0:1], [0:2048]}
  %param_0.3 = bf16[8,2048]{1,0} parameter(0)
  %dot.3 = bf16[8,3]{1,0} dot(%param_0.3, %bitcast.5), lhs_contracting_dims={1}, rhs_contracting_dims={1}
  %broadcast.2 = bf16[8,2048]{1,0} broadcast(%slice.5), dimensions={0,1}
  ROOT %dot.4 = bf16[8,3]{1,0} dot(%broadcast.2, %bitcast.5), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}

%fused_dynamic_update_slice (param_0.4: bf16[3,64,32], param_1.4: bf16[1,64,32], param_2.4: s32[]) \
-> bf16[3,64,32] {
  %param_0.4 = bf16[3,64,32]{2,1,0} parameter(0)
  %param_1.4 = bf16[1,64,32]{2,1,0} parameter(1)
  %param_2.4 = s32[] parameter(2)
  %constant.2 = s32[] constant(0)
  ROOT %dynamic-update-slice.1 = bf16[3,64,32]{2,1,0} dynamic-update-slice(%param_0.4, %param_1.4, %param_2.4, \
%constant.2, %constant.2)
}

ENTRY %main.2 (p_x: bf16[8,64], p_w: bf16[3,64,32], p_i: s32[], p_new: bf16[1,64,32]) -> bf16[8,32] {
  %p_x = bf16[8,64]{1,0} parameter(0)
  %p_w = bf16[3,64,32]{2,1,0} parameter(1)
  %p_i = s32[] parameter(2)
  %p_new = bf16[1,64,32]{2,1,0} parameter(3)
  %gemm_fusion_dot.1 = bf16[8,32]{1,0} fusion(%p_x, %p_w), kind=kCustom, calls=%gemm_fusion_dot.1_computation, \
backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %gemm_fusion_dot.2 = bf16[8,32]{1,0} fusion(%p_x, %p_w, %p_i), kind=kCustom, calls=%gemm_fusion_dot.2_computation
  %loop_add_fusion = bf16[64,32]{1,0} fusion(%p_w), kind=kLoop, calls=%fused_add
  %loop_multiply_fusion = bf16[3,64,32]{2,1,0} fusion(%p_w), kind=kLoop, calls=%fused_multiply
  %bitcast.9 = bf16[8,2048]{1,0} bitcast(%loop_multiply_fusion)
  %fusion.5 = bf16[8,3]{1,0} fusion(%bitcast.9, %p_w), kind=kCustom, calls=%fused_computation.5
  %loop_dynamic_update_slice_fusion = bf16[3,64,32]{2,1,0} fusion(%p_w, %p_new, %p_i), kind=kLoop, \
calls=%fused_dynamic_update_slice
  ROOT %tuple = (bf16[8,32]{1,0}, bf16[8,32]{1,0}) tuple(%gemm_fusion_dot.1, %gemm_fusion_dot.2)
}
"""

X = 8 * 64 * 2  # the activations [8, 64], bf16
STACK = 3 * 64 * 32 * 2  # the stacked weight [3, 64, 32], bf16
LAYER = 64 * 32 * 2  # one layer of it: [1, 64, 32] or [1, 2048]
OUT = 8 * 32 * 2  # a product [8, 32]


def test_a_stacked_weight_that_a_fusion_only_slices_counts_as_the_slice():
    ks = {k["name"]: k for k in entry_kernels(STACKED)}
    one = ks["gemm_fusion_dot.1"]  # slice of layer 1, then a bitcast
    assert one["input_bytes_full"] == [X, STACK]
    assert one["input_bytes"] == [X, LAYER] and one["bytes_in"] == X + LAYER
    assert xla_bytes(one) == X + LAYER + OUT
    two = ks["gemm_fusion_dot.2"]  # a bitcast, then a dynamic-slice of a row; the index operand is read whole
    assert two["input_bytes"] == [X, LAYER, 4] and two["bytes_in"] == X + LAYER + 4
    assert xla_bytes(two) == X + LAYER + 4 + OUT
    both = ks["loop_add_fusion"]  # layers 0 and 2, each sliced and reshaped
    assert both["input_bytes"] == [2 * LAYER] and xla_bytes(both) == 2 * LAYER + 64 * 32 * 2


def test_a_stacked_weight_also_read_whole_counts_whole():
    ks = {k["name"]: k for k in entry_kernels(STACKED)}
    mul = ks["loop_multiply_fusion"]  # sliced, and multiplied whole
    assert mul["input_bytes"] == [STACK] and mul["bytes_in"] == STACK
    assert xla_bytes(mul) == STACK + STACK
    view = ks["fusion.5"]  # its bitcast is sliced, and read by a dot
    assert view["input_bytes"] == [8 * 2048 * 2, STACK] and xla_bytes(view) == 8 * 2048 * 2 + STACK + 8 * 3 * 2


def test_an_in_place_update_of_a_stacked_array_still_counts_the_update():
    ks = {k["name"]: k for k in entry_kernels(STACKED)}
    dus = ks["loop_dynamic_update_slice_fusion"]
    assert dus["input_bytes_full"] == [STACK, LAYER, 4] and dus["bytes_out"] == STACK
    assert xla_bytes(dus) == 2 * (LAYER + 4)  # the stacked operand is the buffer updated in place
