"""`kdtree-convert`: a Hugging Face Kimi K2.x / DeepSeek-V3 checkpoint -> this project's orbax checkpoint.

Sources (docs/convert.md):
  - bf16 / fp32 / fp16 weights, as `save_pretrained` writes them;
  - FP8 e4m3 weights with fp32 `weight_scale_inv` per 128x128 block (Kimi-K2-Instruct, DeepSeek-V3), dequantized;
  - compressed-tensors `pack-quantized` INT4 routed experts (K2-Thinking, K2.5, K2.6): kept bit-exactly with
    `--experts int4` (never dequantized and requantized), dequantized with `--experts bf16`;
  - the `language_model.` prefix of the K2.5 / K2.6 multimodal wrapper; `vision_tower.*`, `mm_projector.*` and other
    non-language-model tensors, stale `rotary_emb.inv_freq` buffers and multi-token-prediction layers are skipped
    and listed in the manifest.
One `model.safetensors.index.json` with its shards, or the `*.safetensors` files of the directory, are read with
a small header parser and positioned reads (no mmap, no torch): resident memory stays about one layer of the
source. The tensor-name mapping is `kdtree_converters.hf`; the output layout is `kdtree_jax.checkpoint`.

Work goes to a hidden sibling directory `.OUT_DIR.partial` that is renamed to OUT_DIR only when complete. Each
item (the embedding/head, then one item per decoder layer) is recorded when written: a killed conversion resumes
on rerun from the last finished item, and gives the same checkpoint as an uninterrupted run. One conversion at a
time writes to OUT_DIR (an exclusive lock on `.OUT_DIR.lock`); the finish is crash-safe (see `_publish`).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import dataclasses
import fcntl
import json
import math
import os
import re
import shutil
import signal
import sys
import time
from collections import Counter

import jax
import ml_dtypes
import numpy as np
from tqdm import tqdm

from kdtree_jax import checkpoint as ckpt
from kdtree_jax.checkpoint import CheckpointError
from kdtree_jax.cli import OneLineParser, report_errors
from kdtree_jax.config import ConfigError, ModelConfig, check_hf_config
from kdtree_jax.model import abstract_params
from kdtree_jax.tokenizer import TIKTOKEN_FILE, TOKENIZER_CONFIG_FILE, load_tokenizer

from .hf import drafter_config_from_hf, drafter_from_hf, drafter_tensor_shapes, layer_from_hf, top_from_hf

INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = (TIKTOKEN_FILE, TOKENIZER_CONFIG_FILE, "special_tokens_map.json", "chat_template.jinja")
LM_PREFIX = "language_model."
MAX_HEADER_BYTES = 100 << 20  # safetensors caps its JSON header at 100 MB
# Test hook: "STAGE=SIGNAL" sends the conversion SIGNAL (KILL, STOP, ...) at STAGE, so that tests can check
# resuming from the worst moments. The stages: "written:N" (N items written, the last one not yet recorded), then
# the finish's "manifest", "sealed", "aside" and "landed" (see _seal and _publish). Unset in normal use.
FAULT_ENV = "KDTREE_CONVERT_FAULT"
NONFINITE_CHUNK = 1 << 24  # elements checked for NaN / inf at a time (bounds the temporary mask)

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
          "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2, "I64": np.int64, "I32": np.int32,
          "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
FP8 = (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2))
FLOATS = (*(np.dtype(DTYPES[k]) for k in ("F64", "F32", "F16", "BF16")), *FP8)

LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
EXPERT_RE = re.compile(r"mlp\.experts\.(\d+)\.")


# ---------------------------------------------------------------------------------------------------------------
# safetensors files: headers parsed here, tensors read with positioned reads into fresh numpy arrays
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Tensor:
    """Where one tensor lies: its name in the file, the file, dtype, shape and absolute byte range."""

    name: str
    file: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def read_header(path: str) -> dict[str, Tensor]:
    """The tensors of one safetensors file, with a CheckpointError for anything that is not a valid header."""
    with ckpt.open_regular(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: corrupt safetensors file ({size} bytes, shorter than its header length)")
        n = int.from_bytes(head, "little")
        if n > min(size - 8, MAX_HEADER_BYTES):
            raise CheckpointError(f"{path}: corrupt safetensors header (header length {n} but the file has {size} "
                                  "bytes)")
        raw = f.read(n)
    try:
        header = json.loads(raw, object_pairs_hook=_unique_keys)
        if not isinstance(header, dict):
            raise TypeError("not a JSON object")
    except (UnicodeDecodeError, ValueError, TypeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    base, out = 8 + n, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            if not isinstance(dtype, str) or not all(_is_int(v) for v in (*shape, begin, end)):
                raise TypeError  # a float, bool or string where safetensors writes integers: not truncated here
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: corrupt safetensors header entry for {name!r}: {info!r}") from None
        if dtype not in DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {dtype!r}")
        dt = np.dtype(DTYPES[dtype])
        if (not 0 <= begin <= end or base + end > size or end - begin != math.prod(shape) * dt.itemsize
                or min(shape, default=0) < 0):
            raise CheckpointError(f"{path}: corrupt safetensors header: tensor {name!r} {dtype}{list(shape)} has "
                                  f"byte range [{begin}, {end}) in a data section of {size - base} bytes")
        out[name] = Tensor(name, path, dt, shape, base + begin, end - begin)
    spans = sorted((t.offset, t.offset + t.nbytes, name) for name, t in out.items() if t.nbytes)
    for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
        if begin < end:  # two tensors sharing bytes: at least one of them is not what its name says
            raise CheckpointError(f"{path}: corrupt safetensors header: the byte ranges of tensors {a!r} and {b!r} "
                                  "overlap")
    return out


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _unique_keys(pairs: list) -> dict:
    """json.loads' object_pairs_hook: a dict, with a ValueError for a key given twice (json keeps the last)."""
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"key {k!r} appears twice")
        out[k] = v
    return out


def read_tensor(t: Tensor, fd: int) -> np.ndarray:
    """Read tensor t from the open file descriptor fd into a new array; a CheckpointError when it holds NaN or inf."""
    a = np.empty(t.shape, t.dtype)
    buf, pos = memoryview(a.reshape(-1).view(np.uint8)), t.offset
    while len(buf):
        n = os.preadv(fd, [buf], pos)
        if n == 0:
            raise CheckpointError(f"{t.file}: file ends inside a tensor (truncated?)")
        buf, pos = buf[n:], pos + n
    if bad := count_nonfinite(a):
        raise CheckpointError(f"tensor {t.name!r} ({os.path.basename(t.file)}) has {bad} non-finite value(s) (NaN "
                              f"or inf) of {a.size}: the source checkpoint is corrupt")
    return a


def count_nonfinite(a: np.ndarray) -> int:
    """The number of NaN / inf values of a float array (0 for integers), counted in chunks of NONFINITE_CHUNK."""
    if a.dtype.kind in "iub":
        return 0
    flat = a.reshape(-1)
    chunks = (flat[i:i + NONFINITE_CHUNK] for i in range(0, flat.size, NONFINITE_CHUNK))
    return sum(int(c.size - np.count_nonzero(np.isfinite(c))) for c in chunks)


# ---------------------------------------------------------------------------------------------------------------
# The source checkpoint
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Quantization:
    """What config.json's quantization_config says: method "none", "fp8" (block-scaled) or "int4"."""

    method: str = "none"
    group_size: int | None = None  # int4: the group along the input dimension
    block: tuple[int, int] = (128, 128)  # fp8: weight_scale_inv block [out, in]


def parse_quantization(q: dict | None) -> Quantization:
    """Quantization from a quantization_config dict; CheckpointError for a method or scheme we do not read."""
    if not q:
        return Quantization()
    method = q.get("quant_method")
    if method == "fp8":
        if q.get("fmt", "e4m3") != "e4m3":
            raise CheckpointError(f"unsupported fp8 format {q.get('fmt')!r} (only e4m3)")
        block = q.get("weight_block_size") or [128, 128]
        if not isinstance(block, list) or len(block) != 2 or not all(_is_int(b) and b > 0 for b in block):
            raise CheckpointError(f"unsupported fp8 weight_block_size {block!r} (need [out, in], two positive "
                                  "integers)")
        return Quantization("fp8", block=(block[0], block[1]))
    if method == "compressed-tensors":
        if q.get("format") != "pack-quantized":
            raise CheckpointError(f"unsupported compressed-tensors format {q.get('format')!r} (only pack-quantized)")
        groups = {json.dumps(g.get("weights"), sort_keys=True) for g in (q.get("config_groups") or {}).values()}
        if len(groups) != 1:
            raise CheckpointError(f"compressed-tensors: expected one weight scheme, found {len(groups)}")
        w = json.loads(groups.pop()) or {}
        want = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}
        bad = {k: w.get(k) for k, v in want.items() if w.get(k) != v}
        if bad or not w.get("group_size"):
            raise CheckpointError(f"unsupported compressed-tensors weight scheme {bad or w} (only 4-bit symmetric "
                                  "int with a group_size)")
        if not _is_int(w["group_size"]) or w["group_size"] < 1:
            raise CheckpointError(f"compressed-tensors group_size {w['group_size']!r} is not a positive integer")
        return Quantization("int4", group_size=w["group_size"])
    raise CheckpointError(f"unknown quantization method {method!r} in config.json quantization_config (supported: "
                          "fp8 block-scaled e4m3, compressed-tensors pack-quantized int4)")


class Source:
    """A Hugging Face checkpoint directory, read lazily: config, tensor headers, the language-model view.

    `tensors` maps every language-model tensor name, without the `language_model.` prefix, to where it lies;
    `skipped` maps each skipped tensor (source name) to the reason.
    """

    def __init__(self, path: str | os.PathLike):
        self.dir = os.path.abspath(path)
        if not os.path.isdir(self.dir):
            raise CheckpointError(f"{self.dir} is not a directory")
        config_path = os.path.join(self.dir, "config.json")
        if not os.path.exists(config_path):
            raise ConfigError(f"no config.json in {self.dir}")
        self.config = ckpt.read_json(config_path)
        try:
            check_hf_config(self.config)  # before anything reads a value: one of the wrong type is named
        except ConfigError as e:
            raise ConfigError(f"{config_path}: {e}") from None
        with config_errors(config_path):
            text = self.config.get("text_config", self.config)
            self.quant = parse_quantization(text.get("quantization_config") or self.config.get("quantization_config"))
            n, n_mtp = text.get("num_hidden_layers") or 0, text.get("num_nextn_predict_layers") or 0
        self.files = self._find_files()
        everything = self._read_headers()
        self.num_tensors = len(everything)
        self.prefix = LM_PREFIX if any(n.startswith(LM_PREFIX) for n in everything) else ""
        if self.prefix and (bare := sorted(n for n in everything if n.startswith(("model.", "lm_head.")))):
            raise CheckpointError(f"the safetensors mix names with the {LM_PREFIX!r} prefix and language-model names "
                                  f"without it ({len(bare)}, e.g. {bare[0]!r}): one checkpoint, one naming")
        # DeepSeek-V3's multi-token-prediction modules are extra layers after the last one, with an eh_proj (found
        # from the tensor names: nothing here is sized by the config's counts)
        mtp = {f"model.layers.{m[1]}." for name in everything if name.startswith(self.prefix)
               and (m := LAYER_RE.fullmatch(name[len(self.prefix):])) and m[2] == "eh_proj.weight"
               and n <= int(m[1]) < n + n_mtp}
        self.tensors: dict[str, Tensor] = {}
        self.skipped: dict[str, str] = {}
        for name, t in everything.items():
            lm = name[len(self.prefix):]
            m = LAYER_RE.fullmatch(lm)
            if not name.startswith(self.prefix) or not lm.startswith(("model.", "lm_head.")):
                self.skipped[name] = "not part of the language model"
            elif lm.endswith("rotary_emb.inv_freq"):
                self.skipped[name] = "stale rotary_emb.inv_freq buffer"
            elif m and f"model.layers.{m[1]}." in mtp:
                self.skipped[name] = "multi-token-prediction layer"
            else:
                self.tensors[lm] = t

    def _find_files(self) -> list[str]:
        index = os.path.join(self.dir, INDEX_FILE)
        if os.path.exists(index):
            try:
                weight_map = ckpt.read_json(index)["weight_map"]
                if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                    raise ValueError("weight_map is not an object of file names")
            except (ValueError, KeyError) as e:
                raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
            for name, f in weight_map.items():  # a shard is a file of the source directory, named without a path
                if os.path.isabs(f) or f in ("", ".", "..") or os.path.basename(f) != f:
                    raise CheckpointError(f"{index}: weight_map entry {name!r} names {f!r}, which is not a file name "
                                          f"in {self.dir} (shards are read from the source directory only)")
            self._weight_map = weight_map
            files = sorted(set(weight_map.values()))
            for f in files:
                if not os.path.exists(os.path.join(self.dir, f)):
                    raise CheckpointError(f"shard {f} listed in {INDEX_FILE} is missing from {self.dir}")
            return files
        self._weight_map = None
        files = sorted(f for f in os.listdir(self.dir) if f.endswith(".safetensors"))
        if not files:
            raise CheckpointError(f"no .safetensors files in {self.dir}")
        return files

    def _read_headers(self) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for f in self.files:
            for name, t in read_header(os.path.join(self.dir, f)).items():
                if name in out:
                    raise CheckpointError(f"tensor {name!r} is in both {os.path.basename(out[name].file)} and {f}")
                out[name] = t
        if self._weight_map is not None:
            for name, f in self._weight_map.items():
                if name not in out or os.path.basename(out[name].file) != f:
                    raise CheckpointError(f"missing tensor {name!r}: {INDEX_FILE} maps it to {f}, which does not "
                                          "hold it")
        return out

    def source_name(self, name: str) -> str:
        return self.prefix + name

    @property
    def has_int4_experts(self) -> bool:
        return any(n.endswith(".weight_packed") for n in self.tensors)

    @property
    def format(self) -> str:
        if self.quant.method == "int4" or self.has_int4_experts:
            return "int4 compressed-tensors"
        if self.quant.method == "fp8" or any(t.dtype in FP8 for t in self.tensors.values()):
            return "fp8 block-scaled"
        by_bytes = Counter()
        for t in self.tensors.values():
            by_bytes[t.dtype.name] += t.nbytes
        return by_bytes.most_common(1)[0][0] if by_bytes else "empty"

    def item_tensors(self, cfg: ModelConfig) -> dict[str, list[str]]:
        """The language-model tensor names each output item reads from (by name: model.layers.i.* for layer i)."""
        items: dict[str, list[str]] = {name: [] for name in ckpt.item_names(cfg)}
        for name in self.tensors:
            m = LAYER_RE.fullmatch(name)
            item = ckpt.layer_item(int(m[1])) if m else ckpt.TOP_ITEM
            items.setdefault(item, []).append(name)
        return items


@contextlib.contextmanager
def config_errors(path: str):
    """Turn what a config.json of unexpected content raises (a string where a number belongs, a list where an object
    does) into a ConfigError naming the file."""
    try:
        yield
    except (CheckpointError, ConfigError):
        raise
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{path}: unexpected content ({e})") from None


def check_structure(src: Source, cfg: ModelConfig) -> None:
    """Check the source against the config from the headers alone, before any tensor is read: the embedding's
    shape, the layer count, the routed experts of each layer, and that the layers of each kind (dense, MoE) hold
    the same tensor names with the same shapes, and that MoE layers have the router bias (every supported config
    routes with topk_method noaux_tc, which adds it). Exact shapes are checked per tensor as layers are converted."""
    for key in ("bos_token_id", "eos_token_id"):  # kj.load refuses them (an end token that never matches)
        if (value := getattr(cfg, key)) is not None and not 0 <= value < cfg.vocab_size:
            raise ConfigError(f"{os.path.join(src.dir, 'config.json')}: {key} {value} is outside the vocabulary "
                              f"[0, {cfg.vocab_size}) (kdtree_jax.load would refuse the checkpoint)")
    check_dtypes(src)
    embed = src.tensors.get("model.embed_tokens.weight")
    if embed is None:
        raise CheckpointError(f"missing tensor {src.source_name('model.embed_tokens.weight')!r}")
    if embed.shape != (cfg.vocab_size, cfg.hidden_size):
        raise ConfigError(f"config.json (vocab_size={cfg.vocab_size}, hidden_size={cfg.hidden_size}) does not match "
                          f"the tensors: {src.source_name('model.embed_tokens.weight')} is {list(embed.shape)}")
    top = {"model.norm.weight": (cfg.hidden_size,), "lm_head.weight": (cfg.vocab_size, cfg.hidden_size)}
    for name, shape in top.items():
        t = src.tensors.get(name)
        if t is None and not (name == "lm_head.weight" and cfg.tie_word_embeddings):
            raise CheckpointError(f"missing tensor {src.source_name(name)!r}")
        if t is not None and t.shape != shape:
            raise CheckpointError(f"tensor {src.source_name(name)!r} has shape {list(t.shape)}, expected "
                                  f"{list(shape)}")
    for name, t in src.tensors.items():
        if name.endswith(".weight_packed") and not EXPERT_RE.search(name):
            raise CheckpointError(f"tensor {src.source_name(name)!r} is INT4-packed, but only routed experts may be "
                                  "(compressed-tensors ignore list)")
        if t.dtype in FP8 and len(t.shape) != 2:
            raise CheckpointError(f"FP8 tensor {src.source_name(name)!r} has shape {list(t.shape)}: only 2-D "
                                  "weights are block-scaled")
        if t.dtype in FP8:
            (o, i), (bo, bi) = t.shape, src.quant.block
            scale = src.tensors[f"{name}_scale_inv"]  # present: check_dtypes
            if scale.shape != (-(-o // bo), -(-i // bi)):
                raise CheckpointError(f"tensor {src.source_name(name + '_scale_inv')!r} has shape "
                                      f"{list(scale.shape)}, expected {[-(-o // bo), -(-i // bi)]} (blocks of "
                                      f"{bo}x{bi} over {list(t.shape)}, config.json's weight_block_size)")
    layers: dict[int, dict[str, Tensor]] = {}
    for name, t in src.tensors.items():
        m = LAYER_RE.fullmatch(name)
        if m:
            layers.setdefault(int(m[1]), {})[m[2]] = t
    n = cfg.num_hidden_layers
    if n > len(layers):  # before anything sized by n: a config.json of 10**9 layers is refused at once
        raise ConfigError(f"config.json says num_hidden_layers={n}, but the safetensors hold weights of {len(layers)} "
                          f"layer(s) ({_ids(sorted(layers))})")
    if missing := [i for i in range(n) if i not in layers]:
        raise ConfigError(f"config.json says num_hidden_layers={n}, but the checkpoint has no tensors for layer(s) "
                          f"{_ids(missing)}")
    if extra := sorted(i for i in layers if i >= n):
        raise ConfigError(f"the checkpoint has tensors for layer(s) {_ids(extra)}, beyond config.json's "
                          f"num_hidden_layers={n} (and not multi-token-prediction layers)")
    for i, names in layers.items():
        experts = sorted({int(m[1]) for s in names if (m := EXPERT_RE.match(s))})
        if i < cfg.num_dense_layers and experts:
            raise ConfigError(f"config.json says first_k_dense_replace={cfg.first_k_dense_replace}, but layer {i} "
                              f"has routed experts")
        if i >= cfg.num_dense_layers and (len(experts) != cfg.n_routed_experts  # = 0..E-1, without building that
                                          or (experts and experts[-1] != len(experts) - 1)):
            raise ConfigError(f"config.json says n_routed_experts={cfg.n_routed_experts} and first_k_dense_replace="
                              f"{cfg.first_k_dense_replace}, but layer {i} has routed experts {_ids(experts)}")
    bias = "mlp.gate.e_score_correction_bias"
    if no_bias := [i for i in range(cfg.num_dense_layers, n) if bias not in layers[i]]:
        raise CheckpointError(f"missing tensor {src.source_name(f'model.layers.{no_bias[0]}.{bias}')!r} (config.json "
                              "routes with topk_method noaux_tc, which needs the router bias)")
    for kind, ids in (("dense", range(cfg.num_dense_layers)), ("MoE", range(cfg.num_dense_layers, n))):
        union = set().union(*(layers[i] for i in ids)) if ids else set()
        for i in ids:
            if missing := sorted(union - layers[i].keys()):
                raise CheckpointError(f"missing tensor {src.source_name(f'model.layers.{i}.{missing[0]}')!r} (the "
                                      f"other {kind} layers have it)")
    shapes: dict[str, Counter] = {}
    for names in layers.values():
        for s, t in names.items():
            shapes.setdefault(s, Counter())[t.shape] += 1
    for i, names in sorted(layers.items()):
        for s, t in names.items():
            common, count = shapes[s].most_common(1)[0]
            if t.shape != common:
                raise CheckpointError(f"tensor {src.source_name(f'model.layers.{i}.{s}')!r} has shape "
                                      f"{list(t.shape)}, expected {list(common)} (its shape in {count} other layers)")


def check_dtypes(src: Source) -> None:
    """Each language-model tensor's dtype against what it is, from the headers: INT4 `weight_packed` int32,
    `weight_shape` integers, scales (`weight_scale`, `weight_scale_inv`) float but not FP8, every other tensor float;
    an FP8 tensor has its `weight_scale_inv`. (An integer weight would be cast to float as if it held values.)"""
    for name, t in src.tensors.items():
        if name.endswith(".weight_packed"):
            ok, want = t.dtype == np.int32, "I32 (packed INT4)"
        elif name.endswith(".weight_shape"):
            ok, want = t.dtype.kind in "iu", "integer"
        elif name.endswith((".weight_scale", "_scale_inv")):
            ok, want = t.dtype in FLOATS and t.dtype not in FP8, "a float scale (F32, BF16, F16 or F64)"
        else:
            ok, want = t.dtype in FLOATS, "a float dtype (F32, BF16, F16, F64 or FP8 with its weight_scale_inv)"
        if not ok:
            raise CheckpointError(f"tensor {src.source_name(name)!r} ({os.path.basename(t.file)}) is "
                                  f"{t.dtype.name}, expected {want}")
        if t.dtype in FP8 and f"{name}_scale_inv" not in src.tensors:
            raise CheckpointError(f"FP8 tensor {src.source_name(name)!r} ({os.path.basename(t.file)}) has no "
                                  f"{src.source_name(name + '_scale_inv')!r}")


def _ids(ids: list[int]) -> str:
    """[0, 1, 2, 5] -> "0..2, 5" (and "none")."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(f"{a}..{b}" if b > a else f"{a}" for a, b in runs) or "none"


class _Reader:
    """`get` / `has` over a Source for kdtree_converters.hf: reads on demand, dequantizes FP8, counts what it read."""

    def __init__(self, src: Source, bar, tally: Counter):
        self.src, self.bar, self.tally = src, bar, tally
        self.fds: dict[str, int] = {}
        self.read_names: set[str] = set()
        self.bytes = 0
        self.seconds = 0.0

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def has(self, name: str) -> bool:
        return name in self.src.tensors

    def _read(self, name: str) -> np.ndarray:
        t = self.src.tensors[name]
        if t.file not in self.fds:
            self.fds[t.file] = os.open(t.file, os.O_RDONLY)
        start = time.perf_counter()
        a = read_tensor(t, self.fds[t.file])
        self.seconds += time.perf_counter() - start
        self.read_names.add(name)
        self.bytes += t.nbytes
        self.tally["read"] += 1
        self.bar.update(t.nbytes)
        self.bar.set_postfix_str(f"{self.tally['read']}/{self.tally['total']} tensors", refresh=False)
        return a

    def get(self, name: str) -> np.ndarray:
        if name not in self.src.tensors:
            if name.endswith(".weight") and f"{name}_packed" in self.src.tensors:
                raise CheckpointError(f"tensor {self.src.source_name(name)!r} is INT4-packed, but only routed "
                                      "experts may be (compressed-tensors ignore list)")
            raise KeyError(name)
        a = self._read(name)
        if a.dtype in FP8:
            scale_name = f"{name}_scale_inv"
            if scale_name not in self.src.tensors:
                raise CheckpointError(f"FP8 tensor {self.src.source_name(name)!r} has no {scale_name!r}")
            with np.errstate(over="ignore", invalid="ignore"):  # counted below, not warned about
                a = dequantize_fp8(a, self._read(scale_name), self.src.quant.block, self.src.source_name(name))
            if bad := count_nonfinite(a):  # finite values times finite scales can overflow fp32
                raise CheckpointError(f"FP8 tensor {self.src.source_name(name)!r} dequantizes to {bad} non-finite "
                                      f"value(s) of {a.size}: its {scale_name.rpartition('.')[2]} overflows float32 "
                                      "(the source checkpoint is corrupt)")
        return a


def prefetch(tensors: list[Tensor]) -> None:
    """Ask the kernel to start reading these tensors into the page cache (posix_fadvise WILLNEED) and return: the
    next item's reads then overlap this item's conversion and writes. Page cache is not resident memory."""
    by_file: dict[str, list[Tensor]] = {}
    for t in tensors:
        by_file.setdefault(t.file, []).append(t)
    for file, ts in by_file.items():
        fd = os.open(file, os.O_RDONLY)
        try:
            for t in ts:
                os.posix_fadvise(fd, t.offset, t.nbytes, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)


def release_freed_memory() -> None:
    """Hand freed heap memory back to the OS. glibc keeps what orbax's writer threads free in per-thread arenas; left
    there, it adds about a layer's worth of resident memory by the second layer. No-op without glibc."""
    trim = getattr(ctypes.CDLL(ctypes.util.find_library("c")), "malloc_trim", None)
    if trim is not None:
        trim(0)


def dequantize_fp8(w: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int], name: str) -> np.ndarray:
    """W [out, in] = fp8 values x the fp32 `weight_scale_inv` of their [block_out, block_in] block (DeepSeek-V3's
    `weight_dequant`), in fp32."""
    (o, i), (bo, bi) = w.shape, block
    want = (-(-o // bo), -(-i // bi))
    if scale_inv.shape != want:
        raise CheckpointError(f"tensor {name}_scale_inv has shape {list(scale_inv.shape)}, expected {list(want)} "
                              f"(blocks of {bo}x{bi} over {list(w.shape)})")
    s = np.repeat(np.repeat(scale_inv.astype(np.float32), bo, axis=0), bi, axis=1)[:o, :i]
    return w.astype(np.float32) * s


# ---------------------------------------------------------------------------------------------------------------
# Conversion
# ---------------------------------------------------------------------------------------------------------------


def _write_json(path: str, obj) -> None:
    """Write JSON atomically (a reader, or a rerun after SIGKILL, sees the old or the new file, never half)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def _check_out(out: str, overwrite: bool) -> None:
    """Refuse an existing out_dir unless overwrite is given and it is an empty directory or a checkpoint, and an
    out_dir whose parent is not a directory."""
    parent = os.path.dirname(out)
    if os.path.lexists(parent) and not os.path.isdir(parent):
        raise CheckpointError(f"cannot write {out}: {parent} is not a directory")
    if not os.path.lexists(out):
        return
    if not overwrite:
        raise CheckpointError(f"{out} already exists (pass --overwrite to replace it)")
    if os.path.isdir(out) and (not os.listdir(out) or os.path.exists(os.path.join(out, ckpt.MANIFEST_FILE))):
        return
    raise CheckpointError(f"refusing to overwrite {out}: it is not an empty directory or a kdtree-jax checkpoint")


def _check_apart(out: str, src_dir, drafter) -> None:
    """Refuse a source (or drafter) directory that is out_dir or lies inside it: --overwrite replaces out_dir whole,
    so the conversion would delete its own source once it had read it."""
    for name, path in (("SRC_DIR", src_dir), ("--drafter", drafter)):
        if path is not None and os.path.lexists(out) and os.path.commonpath([os.path.realpath(path), out]) == out:
            raise CheckpointError(f"{name} {os.fspath(path)} is inside OUT_DIR {out}: replacing OUT_DIR would delete "
                                  "it (give an OUT_DIR outside the source)")


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def _fault(stage: str) -> None:
    """The test hook of FAULT_ENV: signal this process at `stage` when the variable names it."""
    where, _, sig = os.environ.get(FAULT_ENV, "").rpartition("=")
    if where == stage:
        os.kill(os.getpid(), getattr(signal, f"SIG{sig}"))


class DrafterSource:
    """A DFlash drafter checkpoint (config.json with dflash_config, *.safetensors), checked against the target."""

    def __init__(self, path: str | os.PathLike, target: ModelConfig):
        self.dir = os.path.abspath(path)
        config = os.path.join(self.dir, "config.json")
        if not os.path.exists(config):
            raise CheckpointError(f"drafter: no config.json in {self.dir}")
        raw = ckpt.read_json(config)
        with config_errors(f"drafter {config}"):
            self.cfg = dataclasses.replace(drafter_config_from_hf(raw, target), dtype=target.dtype)
        files = sorted(f for f in os.listdir(self.dir) if f.endswith(".safetensors"))
        if not files:
            raise CheckpointError(f"drafter: no .safetensors files in {self.dir}")
        self.tensors = {}
        for f in files:
            for name, t in read_header(os.path.join(self.dir, f)).items():
                if name in self.tensors:
                    raise CheckpointError(f"drafter {self.dir}: tensor {name!r} is in both "
                                          f"{os.path.basename(self.tensors[name].file)} and {f}")
                self.tensors[name] = t
        self._check()

    def _check(self) -> None:
        """From the headers, before the target's layers are converted (a failure after them would discard that work):
        every tensor the conversion reads is present, float and of its shape, and no layer is beyond the config's."""
        pre = "model." if "model.fc.weight" in self.tensors else ""
        for name, shape in drafter_tensor_shapes(self.cfg, pre).items():
            t = self.tensors.get(name)
            where = f"drafter {self.dir}"
            if t is None:
                raise CheckpointError(f"{where}: missing tensor {name!r}")
            if t.dtype not in FLOATS or t.dtype in FP8:
                raise CheckpointError(f"{where}: tensor {name!r} is {t.dtype.name}, expected F32, BF16, F16 or F64")
            if t.shape != shape:
                raise CheckpointError(f"{where}: tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}")
        layer = re.compile(re.escape(pre) + r"layers\.(\d+)\.")
        n = self.cfg.num_layers
        if extra := sorted({int(m[1]) for name in self.tensors if (m := layer.match(name)) and int(m[1]) >= n}):
            raise ConfigError(f"drafter {self.dir}: the safetensors hold layer(s) {_ids(extra)}, beyond config.json's "
                              f"num_hidden_layers={self.cfg.num_layers}")

    def write(self, out: str) -> dict[str, str]:
        """Read, map and check every tensor, then write out/drafter_config.json and out/params.npz; return the
        checksums of the arrays."""
        fds: dict[str, int] = {}

        def get(name: str) -> np.ndarray:
            t = self.tensors[name]
            if t.file not in fds:
                fds[t.file] = os.open(t.file, os.O_RDONLY)
            return read_tensor(t, fds[t.file])

        try:
            params = drafter_from_hf(get, self.tensors.__contains__, self.cfg)
        finally:
            for fd in fds.values():
                os.close(fd)
        os.makedirs(out, exist_ok=True)
        ckpt.save_drafter(out, self.cfg, params)
        return ckpt.checksums(ckpt.flatten(params))


def convert(src_dir: str | os.PathLike, out_dir: str | os.PathLike, *, experts: str | None = None,
            dtype: str = "bfloat16", overwrite: bool = False, dry_run: bool = False, progress: bool = True,
            drafter: str | os.PathLike | None = None, log=print) -> dict:
    """Convert the Hugging Face checkpoint in src_dir into a kdtree-jax checkpoint at out_dir.

    experts: "int4" or "bf16" (dense arrays in `dtype`); default: int4 when the source's experts are INT4, else bf16.
    dtype: "bfloat16" or "float32", for every weight except the INT4 experts and the router bias (fp32).
    drafter: a DFlash drafter checkpoint directory, converted along into out_dir/drafter (checked first).
    overwrite: replace out_dir when it is a checkpoint (or empty); when out_dir is a symbolic link, its target.
    With dry_run, check the source from its headers and return the plan without reading tensors or writing.
    Returns the manifest (dry run: the plan), with a "stats" entry: seconds spent reading, converting, writing.
    Raises CheckpointError / ConfigError, leaving nothing in out_dir; other failures (a kill, a full disk) keep
    the partial work next to out_dir for a rerun to resume. A second conversion to the same out_dir while one
    runs fails at once with a CheckpointError naming the running one's pid.
    """
    out = os.path.realpath(out_dir)
    _check_out(out, overwrite)
    _check_apart(out, src_dir, drafter)
    src = Source(src_dir)
    if experts is None:
        experts = "int4" if src.has_int4_experts else "bf16"
    with config_errors(os.path.join(src.dir, "config.json")):
        cfg = ModelConfig.from_hf(src.config, dtype=dtype, expert_format=experts,
                                  group_size=src.quant.group_size or 32)
    check_structure(src, cfg)
    draft_src = DrafterSource(drafter, cfg) if drafter is not None else None
    items = src.item_tensors(cfg)
    item_bytes = {k: sum(src.tensors[n].nbytes for n in v) for k, v in items.items()}
    files = [{"name": f, "bytes": os.path.getsize(os.path.join(src.dir, f))} for f in src.files]
    manifest = {
        "format": ckpt.FORMAT, "format_version": ckpt.FORMAT_VERSION,
        "source": {"dir": src.dir, "format": src.format, "files": files,
                   "bytes": sum(f["bytes"] for f in files), "tensors": src.num_tensors,
                   "language_model_tensors": len(src.tensors), "prefix": src.prefix,
                   "largest_item_bytes": max(item_bytes.values())},
        "converted": {"experts": experts, "dtype": dtype, "items": list(items),
                      "bytes": sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize
                                   for a in jax.tree.leaves(abstract_params(cfg)))},
        "skipped": dict(sorted(src.skipped.items())),
    }
    if draft_src is not None:
        manifest["drafter"] = {"dir": draft_src.dir, "config": dataclasses.asdict(draft_src.cfg)}
    if dry_run:
        return manifest

    job = json.loads(json.dumps({"format_version": ckpt.FORMAT_VERSION, "source": manifest["source"],
                                 "converted": manifest["converted"],
                                 "drafter": manifest.get("drafter"),
                                 "mtimes": [os.stat(os.path.join(src.dir, f)).st_mtime_ns for f in src.files]}))
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with _exclusive(ckpt.sibling(out, "lock"), out):
        _recover(out, job, log)
        _check_out(out, overwrite)  # again: another conversion may have finished since the first check
        start = time.perf_counter()
        work = ckpt.sibling(out, "partial")
        done = _prepare_work(work, job, log)
        stats = {"read_s": 0.0, "convert_s": 0.0, "write_s": 0.0}
        if done is None:
            log(f"finishing {work}: a complete conversion that was stopped before it was moved to {out}")
            manifest = ckpt.read_json(os.path.join(work, ckpt.MANIFEST_FILE))
        else:
            if done:
                log(f"resuming {work}: {len(done)} of {len(items)} items already written")
            try:
                _write_items(src, cfg, items, work, done, stats, progress)
                read = set().union(*(d["tensors"] for d in done.values()))
                for name in sorted(set(src.tensors) - read):
                    manifest["skipped"][src.source_name(name)] = "not used by the conversion"
                manifest["skipped"] = dict(sorted(manifest["skipped"].items()))
                manifest["checksums"] = {k: done[k]["crc32"] for k in items}
                if draft_src is not None:
                    manifest["checksums"][ckpt.DRAFTER_DIR] = draft_src.write(os.path.join(work, ckpt.DRAFTER_DIR))
                _seal(src, cfg, work, manifest)
            except (CheckpointError, ConfigError):
                shutil.rmtree(work, ignore_errors=True)
                raise
            except BaseException as e:
                e.add_note(f"(the finished items are kept in {work}: rerun the same command to resume)")
                raise
        _publish(work, out)
    manifest["stats"] = {**stats, "total_s": time.perf_counter() - start}
    return manifest


@contextlib.contextmanager
def _exclusive(lock: str, out: str):
    """Hold an exclusive lock (flock) on the file `lock` while converting to `out`. When another process holds it,
    a CheckpointError naming that process at once. The file holds the holder's pid and is removed on release."""
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise CheckpointError(f"another kdtree-convert (pid {holder}) is writing {out}: wait for it to finish "
                                  f"(or stop it, then rerun to resume its work); lock {lock}") from None
        try:
            current = os.stat(lock)
        except FileNotFoundError:
            current = None
        if current is not None and os.path.samestat(current, os.fstat(fd)):
            break
        os.close(fd)  # the previous holder removed this file after we opened it: lock the new one
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.unlink(lock)
        os.close(fd)


def _write_items(src: Source, cfg: ModelConfig, items: dict[str, list[str]], work: str, done: dict, stats: dict,
                 progress: bool) -> None:
    """Convert and write the items not in `done`, recording each in done and work/progress.json once written:
    {item: {"tensors": source tensors it read, "crc32": {array: checksum}}}."""
    todo = [k for k in items if k not in done]
    bar = tqdm(total=sum(src.tensors[n].nbytes for k in todo for n in items[k]), unit="B", unit_scale=True,
               unit_divisor=1024, desc="kdtree-convert", disable=not progress, mininterval=1.0, dynamic_ncols=True)
    tally = Counter(total=sum(len(items[k]) for k in todo))
    if todo:
        prefetch([src.tensors[n] for n in items[todo[0]]])
    try:
        for n_written, item in enumerate(todo, 1):
            reader = _Reader(src, bar, tally)
            bar.set_description(f"kdtree-convert {item}")
            t0 = time.perf_counter()
            try:
                if item == ckpt.TOP_ITEM:
                    arrays, expected = ckpt.flatten(top_from_hf(reader.get, reader.has, cfg)), ckpt.top_struct(cfg)
                else:
                    i = int(item.removeprefix("layer_"))
                    arrays = ckpt.flatten(layer_from_hf(reader.get, reader.has, cfg, i))
                    expected = ckpt.layer_struct(cfg, i)
            finally:
                reader.close()
            ckpt.check_arrays(item, arrays, ckpt.flatten(expected))
            if n_written < len(todo):
                prefetch([src.tensors[n] for n in items[todo[n_written]]])
            t1 = time.perf_counter()
            sums = ckpt.save_item(os.path.join(work, ckpt.PARAMS_DIR, item), arrays, cfg, item)  # empties `arrays`
            release_freed_memory()
            stats["read_s"] += reader.seconds
            stats["convert_s"] += t1 - t0 - reader.seconds
            stats["write_s"] += time.perf_counter() - t1
            _fault(f"written:{n_written}")
            done[item] = {"tensors": sorted(reader.read_names), "crc32": sums}
            _write_json(os.path.join(work, "progress.json"), done)
    finally:
        bar.close()


def _complete(work: str, job: dict) -> bool:
    """Whether work holds a finished conversion of this job (its manifest is written last, see _seal)."""
    path = os.path.join(work, ckpt.MANIFEST_FILE)
    if not os.path.exists(path):
        return False
    manifest = ckpt.read_json(path)
    return all(manifest.get(k) == job[k] for k in ("format_version", "source", "converted", "drafter"))


def _prepare_work(work: str, job: dict, log) -> dict | None:
    """Create the work directory, or reopen one of the same job: {finished item: what _write_items records};
    None when it holds the finished conversion, to be published."""
    job_file, progress_file = os.path.join(work, "job.json"), os.path.join(work, "progress.json")
    if os.path.lexists(work):
        if _complete(work, job):
            return None
        finished = os.path.exists(os.path.join(work, ckpt.MANIFEST_FILE))
        if not finished and not os.path.exists(job_file):
            raise CheckpointError(f"{work} exists but is not a kdtree-convert work directory: remove it")
        if not finished and ckpt.read_json(job_file) == job:
            done = ckpt.read_json(progress_file) if os.path.exists(progress_file) else {}
            params = os.path.join(work, ckpt.PARAMS_DIR)
            for entry in os.listdir(params):  # items written but not recorded, and orbax's temporary directories
                if entry not in done:
                    shutil.rmtree(os.path.join(params, entry))
            return done
        log(f"discarding {work}: a conversion of another source or with other options")
        shutil.rmtree(work)
    os.makedirs(os.path.join(work, ckpt.PARAMS_DIR))
    _write_json(job_file, job)
    return {}


def _seal(src: Source, cfg: ModelConfig, work: str, manifest: dict) -> None:
    """Complete the work directory into a checkpoint: tokenizer files, config, then the manifest (which marks it
    finished: a rerun after a kill publishes it as it is), then remove the job's bookkeeping."""
    copied = []
    for f in TOKENIZER_FILES:
        if os.path.exists(os.path.join(src.dir, f)):
            with ckpt.open_regular(os.path.join(src.dir, f), "rb") as r, open(os.path.join(work, f), "wb") as w:
                shutil.copyfileobj(r, w)
            copied.append(f)
    try:
        load_tokenizer(work)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"tokenizer files of {src.dir} do not load: {e}") from None
    manifest["tokenizer_files"] = copied
    _write_json(os.path.join(work, ckpt.CONFIG_FILE), cfg.to_dict())
    _write_json(os.path.join(work, ckpt.MANIFEST_FILE), manifest)
    _fault("manifest")
    os.remove(os.path.join(work, "progress.json"))
    os.remove(os.path.join(work, "job.json"))
    _fault("sealed")


def _publish(work: str, out: str) -> None:
    """Move the finished work directory to out. A checkpoint at out is first renamed aside to `.OUT.old`, and
    renamed back if the move fails; after a kill in between, the next run's _recover completes or undoes this."""
    old = ckpt.sibling(out, "old")
    if os.path.lexists(out):
        os.rename(out, old)
        _fault("aside")
        try:
            os.rename(work, out)
        except BaseException:
            os.rename(old, out)
            raise
        _fault("landed")
    else:
        os.rename(work, out)
    if os.path.lexists(old):
        shutil.rmtree(old)


def _recover(out: str, job: dict, log) -> None:
    """After a run killed inside _publish: remove `.OUT.old` when out is in place, else leave it for this run to
    publish its finished work over, or (work unfinished, or of another job) rename it back to out."""
    old = ckpt.sibling(out, "old")
    if not os.path.lexists(old):
        return
    if os.path.lexists(out):
        shutil.rmtree(old)
    elif not _complete(ckpt.sibling(out, "partial"), job):
        os.rename(old, out)
        log(f"restored {out} from {old}: the conversion replacing it was stopped before it finished")


# ---------------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(  # errors on one line, as every other error of kdtree-convert
        prog="kdtree-convert",
        description="Convert a Hugging Face Kimi K2 / K2.5 / K2.6 or DeepSeek-V3 checkpoint (bf16/fp32, FP8\n"
                    "block-scaled, or compressed-tensors INT4; `language_model.` prefix handled) into a\n"
                    "kdtree-jax checkpoint for kdtree_jax.load. Streams one layer at a time; a killed\n"
                    "conversion resumes when rerun with the same arguments.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  kdtree-convert /models/Kimi-K2.6 /ckpt/k2.6                  # INT4 experts kept bit-exact\n"
               "  kdtree-convert /models/Kimi-K2-Instruct /ckpt/k2 --experts int4   # FP8 -> INT4 experts\n"
               "  kdtree-convert /models/Kimi-K2.6 /ckpt/k2.6 --dry-run        # check and print the plan\n"
               "  kdtree-convert --verify /ckpt/k2.6                           # check all that load reads\n")
    p.add_argument("src_dir", metavar="SRC_DIR", nargs="?",
                   help="Hugging Face checkpoint directory (config.json, *.safetensors or "
                        "model.safetensors.index.json, tokenizer files)")
    p.add_argument("out_dir", metavar="OUT_DIR", nargs="?",
                   help="output directory; created only when the conversion completes")
    p.add_argument("--drafter", metavar="DIR", help="a DFlash drafter checkpoint (z-lab/dflash format: config.json "
                                                     "with dflash_config, safetensors) to convert along")
    p.add_argument("--experts", choices=("int4", "bf16"), default=None,
                   help="routed experts: int4 (compressed-tensors group-32 values, repacked bit-exactly from INT4 "
                        "sources, quantized from float ones) or bf16 (dense, in --dtype). Default: int4 for INT4 "
                        "sources, bf16 otherwise")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                   help="dtype of the weights other than the INT4 experts (the router bias stays fp32). "
                        "Default: bfloat16")
    p.add_argument("--dry-run", action="store_true",
                   help="check the source against its config from the safetensors headers and print the plan; "
                        "reads no tensor data and writes nothing")
    p.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it is a kdtree-jax checkpoint")
    p.add_argument("--verify", metavar="CKPT", help="instead of converting, check everything kdtree_jax.load reads of "
                                                    "the checkpoint CKPT: every array against its manifest's "
                                                    "checksums, config.json and the arrays' shapes, the drafter, the "
                                                    "tokenizer files")
    p.add_argument("--debug", action="store_true", help="on an error, show the traceback")
    return p


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    for name, value in (("SRC_DIR", args.src_dir), ("OUT_DIR", args.out_dir), ("--verify", args.verify),
                        ("--drafter", args.drafter)):
        if value is not None and not value.strip():  # not the working directory's name in the error that follows
            p.error(f"{name}: expected a directory, got {value!r}")
    if args.verify is not None and (args.src_dir or args.out_dir):
        p.error("--verify CKPT takes no SRC_DIR or OUT_DIR")
    conversion = [flag for flag, given in (("--drafter", args.drafter is not None), ("--experts", args.experts),
                                           ("--dtype", args.dtype), ("--dry-run", args.dry_run),
                                           ("--overwrite", args.overwrite)) if given]
    if args.verify is not None and conversion:  # they would be ignored
        several = len(conversion) > 1
        p.error(f"--verify CKPT checks a checkpoint as it is; {', '.join(conversion)} "
                f"{'shape' if several else 'shapes'} a conversion (drop {'them' if several else 'it'})")
    if args.verify is None and not args.out_dir:
        p.error("the following arguments are required: SRC_DIR OUT_DIR")
    return report_errors("kdtree-convert", lambda: _command(args), args.debug, status=1)


def verify(path: str) -> str:
    """`kdtree-convert --verify`: check everything `kj.load` reads, placing nothing on a device: every array against
    the checksum its manifest records (`checkpoint.verify_checksums`), config.json as a ModelConfig, each item's arrays
    against that config's shapes, the drafter (its config, its weights, its target), the tokenizer files the manifest
    lists (present, and loading). Returns the line to print; a CheckpointError names the first problem."""
    n = ckpt.verify_checksums(path)
    path = os.path.abspath(path)
    manifest = ckpt.read_json(os.path.join(path, ckpt.MANIFEST_FILE))
    config = os.path.join(path, ckpt.CONFIG_FILE)
    if not os.path.lexists(config):  # (a directory, a FIFO or a symlink loop: read_json names what it is)
        raise CheckpointError(f"{path}: {ckpt.CONFIG_FILE} is missing (kj.load reads the model's config from it)")
    try:
        cfg = ModelConfig.from_dict(ckpt.read_json(config))
    except CheckpointError:
        raise
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{config}: {e}") from None
    ckpt.check_layer_count(path, cfg, manifest)  # before anything per layer is built
    structs = [ckpt.top_struct(cfg), *(ckpt.layer_struct(cfg, i) for i in range(cfg.num_hidden_layers))]
    for item, expected in zip(ckpt.item_names(cfg), structs):
        ckpt.check_arrays(f"{item} (against {config})", ckpt.stored_arrays(path, item), ckpt.flatten(expected))
    drafter_dir = os.path.join(path, ckpt.DRAFTER_DIR)
    has_drafter = os.path.isdir(drafter_dir)
    if has_drafter:
        try:
            ckpt.load_drafter(drafter_dir).cfg.check_target(cfg)
        except CheckpointError:
            raise
        except ValueError as e:
            raise CheckpointError(f"{drafter_dir}: {e}") from None
    ckpt.checkpoint_tokenizer(path, manifest)  # what kj.load reads: each listed file, then the tokenizer
    return (f"verified {path}: all {n} arrays match the checksums of its manifest; the config, the arrays' shapes"
            + (", the drafter" if has_drafter else "") + " and the tokenizer load")


def _command(args) -> int:
    if args.verify is not None:
        print(verify(args.verify))
        return 0
    log = lambda msg: print(msg, file=sys.stderr)
    m = convert(args.src_dir, args.out_dir, experts=args.experts, dtype=args.dtype or "bfloat16",
                overwrite=args.overwrite, dry_run=args.dry_run, drafter=args.drafter, log=log)
    s, c = m["source"], m["converted"]
    reasons = Counter(m["skipped"].values())
    skipped = ", ".join(f"{n} {r}" for r, n in sorted(reasons.items())) or "none"
    print(f"source   {s['dir']}: {s['format']}, {len(s['files'])} file(s), {_gb(s['bytes'])}, {s['tensors']} "
          f"tensors; largest item {_gb(s['largest_item_bytes'])}")
    print(f"output   {os.path.realpath(args.out_dir)}: {len(c['items'])} items, experts {c['experts']}, dtype "
          f"{c['dtype']}, {_gb(c['bytes'])}")
    print(f"skipped  {skipped}")
    if args.dry_run:
        print("dry run: the source is consistent with its config.json; nothing was written")
        return 0
    st = m["stats"]
    print(f"done in {st['total_s']:.1f} s ({s['bytes'] / 1e9 / st['total_s']:.2f} GB/s): read {st['read_s']:.1f} s, "
          f"convert {st['convert_s']:.1f} s, write {st['write_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
