"""kdtree-jax: Kimi K2.x inference with DDTree speculative decoding, in JAX.

Public API (README, "Use"): ModelConfig, configs, init_params, forward, init_drafter, load, make_mesh, generate, stream,
and the `kernels` (each custom call with its pure-JAX reference).
"""

from . import configs, kernels
from .config import ConfigError, ModelConfig
from .model import KVCache, Model, Params, decode_step, init_cache, init_params, prefill, shard_params
from .drafter import Drafter, DrafterProtocol, OracleDrafter, init_drafter
from .decoding import GenerateOutput, Sampler
from .generate import forward, generate, stream  # forward: model.forward behind the API's checks
from .distributed import init_distributed
from .sharding import make_mesh
from .checkpoint import load

__all__ = ["ConfigError", "Drafter", "DrafterProtocol", "GenerateOutput", "KVCache", "Model", "ModelConfig",
           "OracleDrafter", "Params", "Sampler", "configs", "decode_step", "forward", "generate", "init_cache",
           "init_drafter", "init_params", "init_distributed", "kernels", "load", "make_mesh", "prefill",
           "shard_params", "stream"]
__version__ = "0.1.0"
