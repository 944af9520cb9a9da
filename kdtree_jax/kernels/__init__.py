"""XLA FFI custom calls (C++ on CPU, CUDA on GPU), one module per call, each with a pure-JAX `*_ref`.

`impl="ffi"` runs the custom call and `impl="xla"` the reference; the model picks one with `ModelConfig.kernels`.
The FFI libraries are built from `ffi/` by the package's CMake build and registered on first use
(`_registry.register`).
"""

from .draft_attention import draft_attention, draft_attention_ref
from .fused_dot import fused_dot, fused_dot_ref
from .marlin_moe import marlin_moe, marlin_moe_ref
from .mla_pre import mla_pre, mla_pre_ref
from .mla_verify import mla_verify, mla_verify_ref
from .moe_route import moe_route, moe_route_ref
from .move_rows import move_rows, move_rows_ref
from .tree_accept import Accepted, tree_accept, tree_accept_ref
from .tree_build import Tree, tree_build, tree_build_ref

__all__ = ["Accepted", "Tree", "mla_verify", "mla_verify_ref", "tree_accept", "tree_accept_ref", "tree_build",
           "tree_build_ref"]
__all__ += ["marlin_moe", "marlin_moe_ref", "moe_route", "moe_route_ref"]
__all__ += ["move_rows", "move_rows_ref", "mla_pre", "mla_pre_ref", "fused_dot", "fused_dot_ref"]
__all__ += ["draft_attention", "draft_attention_ref"]
