"""kdtree-jax: Kimi K2.x inference with DDTree speculative decoding, in JAX.

Public API (see DESIGN.md): ModelConfig, configs, init_params, forward, init_drafter, load, make_mesh, generate.
"""

from . import configs, kernels
from .config import ConfigError, ModelConfig
from .model import KVCache, Model, Params, decode_step, forward, init_cache, init_params, prefill, shard_params
from .drafter import Drafter, DrafterProtocol, OracleDrafter, init_drafter
from .decoding import GenerateOutput
from .generate import generate
from .distributed import init_distributed
from .sharding import make_mesh
from .checkpoint import load

__all__ = ["ConfigError", "Drafter", "DrafterProtocol", "GenerateOutput", "KVCache", "Model", "ModelConfig",
           "OracleDrafter", "Params", "configs", "decode_step", "forward", "generate", "init_cache", "init_drafter",
           "init_params", "load", "init_distributed", "kernels", "make_mesh", "prefill", "shard_params"]
__version__ = "0.1.0"
