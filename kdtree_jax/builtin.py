"""The embedded default model: a small trained K2-architecture target and its distilled DFlash drafter.

Shipped in `kdtree_jax/builtin_model/` as flat .npz files (float weights rounded to bf16, routed experts INT4
group-32, the router fp32) with their configs and the training log. `kdtree_jax.train` reproduces them; see the
README. `kj.load("builtin")` returns them as a Model with the byte tokenizer.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from .config import ModelConfig
from .drafter import Drafter, DrafterConfig, drafter_info
from .model import ArrayInfo, Model, abstract_params
from .quant import Int4Array
from .tokenizer import ByteTokenizer

PACKAGE_DIR = Path(__file__).parent / "builtin_model"


def available(directory: str | os.PathLike | None = None) -> bool:
    d = Path(directory or PACKAGE_DIR)
    return all((d / f).exists() for f in ("config.json", "target.npz", "drafter.npz", "drafter_config.json"))


def _shipped_as_is(path, x) -> bool:
    """Leaves the package keeps in their own dtype: INT4 packs and scales, and the router (trained in fp32)."""
    return isinstance(x, Int4Array) or "router" in jax.tree_util.keystr(path)


def to_shipping(tree):
    """Float weights rounded to bf16 for the package (the fp32 router and INT4 packs/scales kept as they are)."""

    def cast(path, x):
        return x if _shipped_as_is(path, x) or not jnp.issubdtype(x.dtype, jnp.floating) else x.astype(jnp.bfloat16)

    return jax.tree_util.tree_map_with_path(cast, tree, is_leaf=lambda x: isinstance(x, Int4Array))


def shipping_struct(cfg: ModelConfig):
    """ShapeDtypeStructs of the target as `to_shipping` stores it (floats bf16, the router fp32)."""
    structs = abstract_params(dataclasses.replace(cfg, dtype="bfloat16"))
    return jax.tree_util.tree_map_with_path(
        lambda path, x: jax.ShapeDtypeStruct(x.shape, jnp.float32) if _shipped_as_is(path, x) else x, structs)


def from_shipping(tree, dtype):
    """The inverse for running: bf16 float weights cast (exactly) to `dtype`; INT4 packs and scales untouched."""
    return jax.tree.map(lambda x: x if isinstance(x, Int4Array) else x.astype(dtype) if x.dtype == jnp.bfloat16 else x,
                        tree, is_leaf=lambda x: isinstance(x, Int4Array))


def _key_arrays(tree) -> dict[str, np.ndarray]:
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        arr = np.asarray(leaf)
        out[jax.tree_util.keystr(path)] = arr.view(np.uint16) if arr.dtype == jnp.bfloat16 else arr
    return out


def save_npz(path: str | os.PathLike, tree, compress: bool = True) -> None:
    """Every leaf of `tree` by key path (bf16 stored as its uint16 bits), written atomically."""
    path = os.fspath(path)
    tmp = path + ".tmp.npz"
    (np.savez_compressed if compress else np.savez)(tmp, **_key_arrays(tree))
    os.replace(tmp, path)


def load_npz(path: str | os.PathLike, like):
    """Arrays saved by save_npz, in the structure and dtypes of `like`, each shape checked."""
    data = np.load(path)
    leaves = []
    for p, ref in jax.tree_util.tree_flatten_with_path(like)[0]:
        key = jax.tree_util.keystr(p)
        if key not in data:
            raise KeyError(f"{path} has no array {key}")
        arr = data[key]
        if ref.dtype == jnp.bfloat16:
            arr = arr.view(jnp.bfloat16)
        if tuple(arr.shape) != tuple(ref.shape) or arr.dtype != ref.dtype:
            raise ValueError(f"{path}: {key} is {arr.dtype}{list(arr.shape)}, expected {ref.dtype}{list(ref.shape)}")
        leaves.append(jnp.asarray(arr))
    return jax.tree.unflatten(jax.tree.structure(like), leaves)


def read_configs(directory) -> tuple[ModelConfig, DrafterConfig]:
    d = Path(directory)
    cfg = ModelConfig.from_dict(json.loads((d / "config.json").read_text()))
    raw = json.loads((d / "drafter_config.json").read_text())
    return cfg, DrafterConfig(**{**raw, "target_layer_ids": tuple(raw["target_layer_ids"])})


def load_builtin(directory: str | os.PathLike | None = None, dtype: str = "float32"):
    """The embedded model as a Model (cfg, params, drafter, tokenizer), weights cast exactly to `dtype`."""

    d = Path(directory or PACKAGE_DIR)
    if not available(d):
        raise FileNotFoundError(f"no embedded model in {d} (train one with `python -m kdtree_jax.train`)")
    cfg, dcfg = read_configs(d)
    params = load_npz(d / "target.npz", shipping_struct(cfg))
    dlike = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                         drafter_info(dataclasses.replace(dcfg, dtype="bfloat16")),
                         is_leaf=lambda x: isinstance(x, ArrayInfo))
    dparams = load_npz(d / "drafter.npz", dlike)
    cfg = dataclasses.replace(cfg, dtype=dtype, kernels="xla")
    dcfg = dataclasses.replace(dcfg, dtype=dtype)
    return Model(cfg=cfg, params=from_shipping(params, jnp.dtype(dtype)),
                 drafter=Drafter(params=from_shipping(dparams, jnp.dtype(dtype)), cfg=dcfg),
                 tokenizer=ByteTokenizer(), manifest={"source": str(d), "format": "builtin"})
