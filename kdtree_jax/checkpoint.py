"""This project's checkpoint on disk (what `kdtree-convert` writes) and `load`, which restores it onto a mesh.

A checkpoint is a directory:

    config.json        ModelConfig.to_dict()
    manifest.json      what it was converted from: source files and sizes, tensor count, format, skipped tensors;
                       "checksums": {item: {array path: CRC-32 of its bytes}} (checked by `verify`)
    params/top         item: embed [V, D], final_norm [D], lm_head [D, V]
    params/layer_000   item: decoder layer 0, unstacked (the fields of model.Layer as nested dicts)
    ...                one item per decoder layer
    tiktoken.model, tokenizer_config.json   the tokenizer files, when the source had them

An item is a directory of orbax checkpoints `part_000`, `part_001`, ... that together hold its arrays: the arrays
are written in parts of about PART_BYTES (a larger array alone), each freed once written, because orbax buffers
about half of what one save writes. Layers are stored one item each so that the converter streams (one layer in
memory) and resumes per layer; `load` restores each layer straight into its sharding as one of `model.Params`'s
layers (the model keeps every layer in arrays of its own).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import inspect
import json
import logging
import os
import re
import stat
import sys
import zipfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax.traverse_util import unflatten_dict
from jax.sharding import SingleDeviceSharding
from orbax.checkpoint import type_handlers

from .config import ModelConfig
from .builtin import load_builtin, load_npz, save_npz
from .distributed import check_same
from .drafter import Drafter, DrafterConfig, drafter_info, shard_drafter
from .model import Model, Params, abstract_params, param_info, param_shardings, shard_params
from .tokenizer import load_tokenizer
from .validate import path_problem, shown

FORMAT = "kdtree-jax-checkpoint"
FORMAT_VERSION = 3  # 2: q_a and kv_a stored as one weight (attn.qkv_a), the MLPs' gate and up as one (gate_up),
#                      the router in the model's dtype; 3: attn.q_b [H, dn + dr, Rq] and attn.v_b [H, dv, R], their
#                      input axis last (a decode's matmul reads them as XLA's fastest small-M dot does)
CONFIG_FILE = "config.json"
MANIFEST_FILE = "manifest.json"
PARAMS_DIR = "params"
DRAFTER_DIR = "drafter"
DRAFTER_CONFIG_FILE = "drafter_config.json"  # in DRAFTER_DIR, with the weights in DRAFTER_PARAMS_FILE
DRAFTER_PARAMS_FILE = "params.npz"
TOP_ITEM = "top"
TOP_FIELDS = ("embed", "final_norm", "lm_head")

# Orbax write settings: uncompressed (weights do not compress), chunks of at most 64 MiB in OCDBT data files of
# 256 MiB, and routed experts stored one expert per chunk, so that a device restoring its experts (split over
# the "ep" mesh axis) reads just those.
CHUNK_BYTES = 64 << 20
OCDBT_FILE_BYTES = 256 << 20
PART_BYTES = 1 << 30
PART_PREFIX = "part_"


class CheckpointError(ValueError):
    """A checkpoint (a source or a converted one) cannot be read or written as asked: a tensor is missing, has the
    wrong shape or bad values, a file is corrupt, or another conversion holds the output."""


def layer_item(i: int) -> str:
    """The item name of decoder layer i."""
    return f"layer_{i:03d}"


def item_names(cfg: ModelConfig) -> list[str]:
    """Every item of a checkpoint of cfg, in the order the converter writes them."""
    return [TOP_ITEM] + [layer_item(i) for i in range(cfg.num_hidden_layers)]


LAYER_ITEM_RE = re.compile(r"layer_\d{3,}")


def check_layer_count(path: str, cfg: ModelConfig, manifest: dict) -> None:
    """Raise CheckpointError when config.json's num_hidden_layers is not the number of decoder layers the checkpoint
    at (absolute) path holds (the layer items its manifest lists, `converted.items`, or without that list the layer
    items under params/), or its bos or eos id is outside the vocabulary. Checked before anything is built per layer:
    a config.json edited to say 10**9 layers would otherwise have `load` and `kdtree-convert --verify` build 10**9
    layer structures (unbounded time and memory) before finding the first item missing."""
    converted = manifest.get("converted")
    items = converted.get("items") if isinstance(converted, dict) else None
    where = "its manifest lists"
    if not isinstance(items, list):
        params = os.path.join(path, PARAMS_DIR)
        items, where = (os.listdir(params) if os.path.isdir(params) else []), f"{params} has"
    held = sum(1 for k in items if isinstance(k, str) and LAYER_ITEM_RE.fullmatch(k))
    if cfg.num_hidden_layers != held:
        raise CheckpointError(f"{os.path.join(path, CONFIG_FILE)} says {cfg.num_hidden_layers} layers "
                              f"(num_hidden_layers) but the checkpoint holds {held} ({where} {held} layer items)")
    for name in ("bos_token_id", "eos_token_id"):  # a special id outside the vocabulary would never match
        value = getattr(cfg, name)
        if value is not None and not 0 <= value < cfg.vocab_size:
            raise CheckpointError(f"{os.path.join(path, CONFIG_FILE)}: {name} {value} is outside the vocabulary "
                                  f"[0, {cfg.vocab_size})")


# ---------------------------------------------------------------------------------------------------------------
# Pytrees <-> the nested dicts orbax stores
# ---------------------------------------------------------------------------------------------------------------


def _key_name(k) -> str:
    for attr in ("name", "key", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    raise TypeError(f"unexpected pytree key {k!r}")


Path = tuple[str, ...]


def flatten(tree) -> dict[Path, Any]:
    """{path of field names: leaf} of a pytree (a Layer, an Int4Array, nested dicts), in jax's leaf order (the order
    the parts are written in). flax's `traverse_util.flatten_dict` takes nested dicts only."""
    return {tuple(_key_name(k) for k in path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def from_flat(flat: dict[Path, Any], like):
    """The leaves of `flat`, arranged in the structure of `like` (whose paths are the keys)."""
    return jax.tree.unflatten(jax.tree.structure(like), [flat[p] for p in flatten(like)])


def layer_struct(cfg: ModelConfig, i: int):
    """ShapeDtypeStructs of decoder layer i as stored (a Layer pytree)."""
    return abstract_params(cfg).layers[i]


def top_struct(cfg: ModelConfig) -> dict:
    """ShapeDtypeStructs of the top item: embed, final_norm, lm_head."""
    params = abstract_params(cfg)
    return {k: getattr(params, k) for k in TOP_FIELDS}


def _expert_arrays(cfg: ModelConfig, item: str) -> set[Path]:
    """Paths (in the item's nested dict) of the arrays whose first axis is the routed experts (from model.param_info;
    an INT4 weight's path is the prefix of its packed and scale arrays)."""
    info = param_info(cfg)
    if item == TOP_ITEM:
        return set()
    layer = info.layers[int(item.removeprefix("layer_"))]
    return {p for p, a in flatten(layer).items() if a.axes[:1] == ("experts",)}


def check_arrays(what: str, found: dict[Path, Any], expected: dict[Path, Any]) -> None:
    """Raise CheckpointError naming the array when `found` ({path: anything with .shape and .dtype}) lacks an
    array of `expected`, has one more, or has one of another shape or dtype."""
    f, e = ({".".join(p): x for p, x in t.items()} for t in (found, expected))
    if missing := sorted(e.keys() - f.keys()):
        raise CheckpointError(f"{what}: array {missing[0]!r} is missing")
    if extra := sorted(f.keys() - e.keys()):
        raise CheckpointError(f"{what}: unexpected array {extra[0]!r}")
    for name, want in e.items():
        got = f[name]
        if tuple(got.shape) != tuple(want.shape) or np.dtype(got.dtype) != np.dtype(want.dtype):
            raise CheckpointError(f"{what}: array {name!r} has shape {tuple(got.shape)} {np.dtype(got.dtype)}, "
                                  f"expected {tuple(want.shape)} {np.dtype(want.dtype)}")


# ---------------------------------------------------------------------------------------------------------------
# Writing (used by kdtree_converters.convert)
# ---------------------------------------------------------------------------------------------------------------


def _numpy_handler():
    """orbax's NumpyHandler writing numpy arrays as they are, without its defensive deep copy (the converter does not
    touch them while they are written; the copy would double the converter's peak memory), where the installed orbax
    has that switch (`deepcopy_host_arrays`, not in orbax-checkpoint 0.12.4 for one: there it is the default
    handler, whose copy costs memory, not correctness)."""
    if "deepcopy_host_arrays" in inspect.signature(type_handlers.NumpyHandler.__init__).parameters:
        return type_handlers.NumpyHandler(deepcopy_host_arrays=False)
    return type_handlers.NumpyHandler()


def _writer() -> ocp.Checkpointer:
    registry = type_handlers.create_type_handler_registry(
        (np.ndarray, _numpy_handler()), (jax.Array, type_handlers.get_type_handler(jax.Array)))
    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False, type_handler_registry=registry))


def _parts(flat: dict[Path, np.ndarray]) -> list[list[Path]]:
    """The paths grouped, in order, into parts of at most PART_BYTES (an array larger than that alone)."""
    parts: list[list[Path]] = [[]]
    size = 0
    for path, a in flat.items():
        if parts[-1] and size + a.nbytes > PART_BYTES:
            parts.append([])
            size = 0
        parts[-1].append(path)
        size += a.nbytes
    return parts


@functools.cache
def _native_crc32():
    """`KdCrc32` of the C++ library (ffi/crc32.cc: zlib's CRC-32, folded with carry-less multiplies, ~6x faster
    than zlib 1.2's on one core; ctypes releases the GIL), or None where the library is missing or predates it."""
    try:
        from .kernels._registry import cpu_library
        fn = cpu_library().KdCrc32
    except (RuntimeError, OSError, AttributeError):
        return None
    fn.restype, fn.argtypes = ctypes.c_uint32, [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_uint64]
    return fn


def crc32_update(flat: np.ndarray, crc: int = 0) -> int:
    """zlib.crc32(flat, crc) of a contiguous uint8 array, by the native function where there is one."""
    fn = _native_crc32()
    return zlib.crc32(flat, crc) if fn is None else int(fn(crc, flat.ctypes.data, flat.nbytes))


def crc32(a: np.ndarray) -> str:
    """The CRC-32 of an array's bytes (C order), as 8 hex digits: what the manifest records per array."""
    return f"{crc32_update(np.ascontiguousarray(a).reshape(-1).view(np.uint8)):08x}"


# Checked loads split a large array's CRC-32 into pieces the worker threads compute side by side (the CRC releases
# the GIL), then join them: crc(A B) = shift_|B|(crc(A)) ^ crc(B), where shift_n is the linear map (over GF(2)) that
# appends n zero bytes to a CRC-32. Every piece after the first is CRC_PIECE bytes, so one shift serves them all.
CRC_PIECE = 64 << 20


def _gf2_apply(op: tuple[int, ...], v: int) -> int:
    """op (32 columns) times the 32-bit vector v over GF(2)."""
    out, i = 0, 0
    while v:
        if v & 1:
            out ^= op[i]
        v >>= 1
        i += 1
    return out


@functools.lru_cache(maxsize=8)
def _crc_shift(nbytes: int) -> tuple[int, ...]:
    """The operator that appends `nbytes` zero bytes to a CRC-32 (zlib's crc32_combine, as a matrix)."""
    one_bit = (0xEDB88320, *(1 << (n - 1) for n in range(1, 32)))  # the reflected polynomial: one zero bit
    op = one_bit
    for _ in range(3):  # 8 zero bits: one byte
        op = tuple(_gf2_apply(op, c) for c in op)
    total = tuple(1 << n for n in range(32))  # identity
    while nbytes:
        if nbytes & 1:
            total = tuple(_gf2_apply(op, c) for c in total)
        nbytes >>= 1
        if nbytes:
            op = tuple(_gf2_apply(op, c) for c in op)
    return total


def crc32_pieces(a: np.ndarray, submit, piece: int | None = None):
    """`crc32(a)` computed in pieces: submit(fn, *args) -> future (a thread pool's submit) runs each piece's
    `crc32_update`; returns a function that waits for them and joins them into the 8 hex digits `crc32` gives. The
    first piece takes the remainder, so that every later one is `piece` bytes long (default CRC_PIECE)."""
    piece = piece or CRC_PIECE
    flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    head = flat.size % piece or min(piece, flat.size)
    futures = [submit(crc32_update, flat[:head])]
    futures += [submit(crc32_update, flat[i:i + piece]) for i in range(head, flat.size, piece)]

    def join() -> str:
        crc = futures[0].result()
        if len(futures) > 1:
            shift = _crc_shift(piece)
            for f in futures[1:]:
                crc = _gf2_apply(shift, crc) ^ f.result()
        return f"{crc:08x}"

    return join


def checksums(flat: dict[Path, Any]) -> dict[str, str]:
    """{dotted array path: crc32} of a flat pytree of arrays."""
    return {".".join(p): crc32(np.asarray(a)) for p, a in flat.items()}


def save_item(directory: str | os.PathLike, flat: dict[Path, np.ndarray], cfg: ModelConfig,
              item: str) -> dict[str, str]:
    """Write one item ({path: numpy array}) as orbax checkpoints directory/part_000, ..., synchronously; return
    the checksums of its arrays.

    The arrays are written part by part and popped from `flat` once written: when `flat` holds the only
    references, memory shrinks while the item is written. Orbax writes each part into a temporary directory and
    renames it into place when complete.
    """
    experts = _expert_arrays(cfg, item)
    os.makedirs(directory, exist_ok=True)
    sums = {}
    for k, paths in enumerate(_parts(flat)):
        part = {p: flat.pop(p) for p in paths}
        sums.update(checksums(part))
        save_args = {p: ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES,
                                     shard_axes=(0,) if p in experts or p[:-1] in experts else ()) for p in paths}
        with _orbax_call():
            _writer().save(os.path.join(directory, f"{PART_PREFIX}{k:03d}"),
                           args=ocp.args.PyTreeSave(unflatten_dict(part), save_args=unflatten_dict(save_args),
                                                    ocdbt_target_data_file_size=OCDBT_FILE_BYTES))
        del part
    return sums


def _part_dirs(directory: str) -> list[str]:
    """The finished parts of an item (orbax renames a part into place when it is complete)."""
    if not os.path.isdir(directory):
        return []
    return [os.path.join(directory, d) for d in sorted(os.listdir(directory))
            if d.startswith(PART_PREFIX) and os.path.exists(os.path.join(directory, d, "_CHECKPOINT_METADATA"))]


# ---------------------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------------------


def save_drafter(directory: str, dcfg, params) -> None:
    """A drafter as directory/drafter_config.json + directory/params.npz (small enough to write in one go)."""
    save_npz(os.path.join(directory, DRAFTER_PARAMS_FILE), params, compress=False)
    with open(os.path.join(directory, DRAFTER_CONFIG_FILE), "w") as f:
        json.dump(dataclasses.asdict(dcfg), f, indent=1)


def load_drafter(directory: str, mesh: jax.sharding.Mesh | None = None):
    """The Drafter saved by save_drafter (split over the mesh like the target when one is given: `drafter_shardings`),
    every shape checked. A CheckpointError names the drafter's directory when it is missing or not a directory (a file,
    a symlink loop), or one of its two files is missing."""
    why = path_problem(directory, want_dir=True)
    if why is not None:
        if why == "is not a directory":
            why += f" (a drafter is a directory of {DRAFTER_CONFIG_FILE} and {DRAFTER_PARAMS_FILE})"
        raise CheckpointError(f"the checkpoint's drafter {directory} {why}")
    config, weights = (os.path.join(directory, name) for name in (DRAFTER_CONFIG_FILE, DRAFTER_PARAMS_FILE))
    _drafter_file(directory, config)
    raw = read_json(config)
    try:
        dcfg = DrafterConfig(**{**raw, "target_layer_ids": tuple(raw["target_layer_ids"])})
        like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), drafter_info(dcfg),
                            is_leaf=lambda x: hasattr(x, "fan_in_axes"))
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{config}: not a drafter config ({_one_line(e)})") from None
    _drafter_file(directory, weights)
    try:
        params = load_npz(weights, like)
    except (KeyError, ValueError, OSError, EOFError, zipfile.BadZipFile) as e:
        raise CheckpointError(f"drafter: {_one_line(e)}") from None
    drafter = Drafter(params=params, cfg=dcfg)
    return drafter if mesh is None else shard_drafter(drafter, mesh)


def _drafter_file(directory: str, path: str) -> None:
    """A CheckpointError naming the drafter when one of its files is missing (an empty drafter/ directory too)."""
    if not os.path.lexists(path):
        why = (f" (the directory is empty; a checkpoint without a drafter has no {DRAFTER_DIR}/ directory)"
               if not os.listdir(directory) else "")
        raise CheckpointError(f"the checkpoint's drafter {directory} is incomplete: {os.path.basename(path)} is "
                              f"missing{why}")


def sibling(path: str, suffix: str) -> str:
    """The hidden sibling `.NAME.suffix` of path NAME: kdtree-convert's work directory ("partial"), lock file
    ("lock") and the checkpoint an --overwrite replaces, kept until the new one is in place ("old")."""
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{suffix}")


def open_regular(path: str | os.PathLike, mode: str = "r"):
    """open(path, mode) for reading, with a CheckpointError when path is missing or is not a regular file (a FIFO
    would block)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except OSError as e:  # a symlink loop, no permission
        raise CheckpointError(f"{path} does not open: {e.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CheckpointError(f"{path} is not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, mode)
    except BaseException:
        os.close(fd)
        raise


def read_json(path: str | os.PathLike) -> dict:
    """The JSON object in a file, with a CheckpointError naming the file when it holds anything else."""
    with open_regular(path) as f:
        try:
            obj = json.load(f)
        except (UnicodeDecodeError, ValueError) as e:
            raise CheckpointError(f"{path}: not valid JSON ({e})") from None
        except RecursionError:
            raise CheckpointError(f"{path}: not valid JSON (nested too deeply)") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: expected a JSON object, found a JSON {type(obj).__name__}")
    return obj


def read_manifest(path: str) -> dict:
    """The manifest of the checkpoint at (absolute) path, with a CheckpointError when path is not a checkpoint of
    this format."""
    if not os.path.exists(os.path.join(path, MANIFEST_FILE)):
        old = sibling(path, "old")
        if not os.path.lexists(path) and os.path.isdir(old):
            raise CheckpointError(f"{path} does not exist, but {old} holds the checkpoint a `kdtree-convert "
                                  "--overwrite` was replacing when it stopped: rerun that command to finish it")
        if not os.path.exists(path):
            raise CheckpointError(f"{path} is not a kdtree-jax checkpoint: no such file or directory")
        if not os.path.isdir(path):
            raise CheckpointError(f"{path} is not a kdtree-jax checkpoint: it is a file; give the checkpoint's "
                                  "directory (what kdtree-convert wrote)")
        raise CheckpointError(f"{path} is not a kdtree-jax checkpoint (no {MANIFEST_FILE}); "
                              "convert a Hugging Face checkpoint with kdtree-convert")
    manifest = read_json(os.path.join(path, MANIFEST_FILE))
    old = {1: "q_a and kv_a, gate and up as separate weights", 2: "attn.q_b and attn.v_b with their input axis first"}
    if manifest.get("format") == FORMAT and manifest.get("format_version") in old:
        raise CheckpointError(f"{path} was written by an older kdtree-convert (format {manifest['format_version']}: "
                              f"{old[manifest['format_version']]}); convert the Hugging Face checkpoint again (this "
                              f"is format {FORMAT_VERSION})")
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: unsupported checkpoint format {manifest.get('format')!r} version "
                              f"{manifest.get('format_version')!r} (this is {FORMAT} {FORMAT_VERSION})")
    where = os.path.join(path, MANIFEST_FILE)
    sums = manifest.get("checksums")
    if sums is not None and not isinstance(sums, dict):
        raise CheckpointError(f"{where}: \"checksums\" must map each item to {{array: CRC-32}}, got {shown(sums)}")
    for item, arrays in (sums or {}).items():
        if not isinstance(arrays, dict) or not all(isinstance(c, str) for c in arrays.values()):
            raise CheckpointError(f"{where}: the checksums of {item!r} must map each array to its CRC-32 (hex text), "
                                  f"got {shown(arrays)}")
    files = manifest.get("tokenizer_files", [])
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        raise CheckpointError(f"{where}: \"tokenizer_files\" must be a list of file names, got "
                              f"{shown(files)}")
    outside = [f for f in files if not f or os.path.isabs(f) or os.pardir in f.replace("\\", "/").split("/")]
    if outside:  # the converter copies tokenizer files into the checkpoint itself
        raise CheckpointError(f"{where}: tokenizer file {outside[0]!r} is not inside the checkpoint")
    return manifest


def load(path: str | os.PathLike, mesh: jax.sharding.Mesh | None = None, *, verify: bool | None = None) -> Model:
    """Load a checkpoint written by `kdtree-convert` (or "builtin": the embedded default model).

    Every array is checked against `model.abstract_params(cfg)` (shape and dtype) before it is read, and, as it is
    read, against the CRC-32 the manifest records (checked loads: a flipped byte anywhere is a CheckpointError
    naming the array; the checksums run in pieces on worker threads while the next part is read, and each item's
    are compared once the next item is read). Each array then goes to its
    sharding (`kdtree_jax.model.param_shardings`; without a mesh, to the first device), layer by layer, so no device
    ever holds more than its share. verify=False skips the checksums: on a mesh each device then reads only its
    shard. The default (None) checks them on a single process; over several processes it does not, since a whole-array
    checksum needs the whole array on every host (verify=True forces it; `kdtree-convert --verify` checks a
    checkpoint on its own). Over several processes, all must load the same checkpoint onto the same mesh (checked: a
    clear error, not a hang).
    """
    path = os.fspath(path) if isinstance(path, (str, os.PathLike)) else path
    if not isinstance(path, str):
        raise TypeError(f"path must be a checkpoint directory (a str or os.PathLike) or 'builtin', got "
                        f"{type(path).__name__}")
    if not path.strip():  # os.path.abspath would make it the working directory
        raise CheckpointError("path is empty: give a checkpoint directory or 'builtin'")
    if mesh is not None and not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"mesh must be None or a jax.sharding.Mesh (kj.make_mesh), got {type(mesh).__name__}")
    if verify is not None and not isinstance(verify, (bool, np.bool_)):  # "no" would be true
        raise TypeError(f"verify must be None, True or False, got {verify!r}")
    if path == "builtin":  # the embedded default model shipped in the package
        model = load_builtin()
        check_same("the model (builtin) and mesh", ["builtin", None if mesh is None else dict(mesh.shape)])
        if mesh is not None:
            model = dataclasses.replace(model, params=shard_params(model.params, model.cfg, mesh),
                                        drafter=shard_drafter(model.drafter, mesh))
        return model
    path = os.path.abspath(path)  # orbax takes absolute paths only
    manifest = read_manifest(path)
    sums = None
    if verify or (verify is None and jax.process_count() == 1):
        sums = manifest.get("checksums")
        if not sums:
            raise CheckpointError(f"{path}: the manifest records no checksums (converted by an older kdtree-convert); "
                                  "convert it again, or load it with verify=False")
    raw = read_json(os.path.join(path, CONFIG_FILE))  # a CheckpointError naming the file when missing or malformed
    try:
        cfg = ModelConfig.from_dict(raw)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{os.path.join(path, CONFIG_FILE)}: {e}") from None
    check_layer_count(path, cfg, manifest)  # before anything per layer is built
    check_same(f"the checkpoint {path} (its config and manifest) or the mesh",
               [cfg.to_dict(), manifest, None if mesh is None else dict(mesh.shape)])
    abstract = abstract_params(cfg)
    if mesh is None:
        device = SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: device, abstract)
    else:
        shardings = param_shardings(cfg, mesh)
    params_dir = os.path.join(path, PARAMS_DIR)
    item_sums = (lambda item: sums.get(item, {})) if sums else (lambda item: None)
    checks = []  # the items' checksum comparisons, each run once the next item is read (its last pieces' CRCs
    # overlap that read; a corrupt item is still reported one item later, not at the end of a long load)

    def restored(tree):
        while len(checks) > 1:
            checks.pop(0)()  # a CheckpointError names the item and array; nothing is returned
        return tree

    with ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 2))) as pool:
        top = restored(_restore(os.path.join(params_dir, TOP_ITEM), TOP_ITEM,
                                {k: getattr(abstract, k) for k in TOP_FIELDS},
                                {k: getattr(shardings, k) for k in TOP_FIELDS}, item_sums(TOP_ITEM), pool, checks))
        layers = tuple(restored(_restore(os.path.join(params_dir, layer_item(i)), layer_item(i), abstract.layers[i],
                                         shardings.layers[i], item_sums(layer_item(i)), pool, checks))
                       for i in range(cfg.num_hidden_layers))
        for check in checks:
            check()
    params = Params(layers=layers, **top)
    drafter_dir = os.path.join(path, DRAFTER_DIR)
    drafter = load_drafter(drafter_dir) if os.path.lexists(drafter_dir) else None  # (a file or a loop: named)
    if drafter is not None and sums:  # checked where it was read, before it is split over the mesh
        check_sums(DRAFTER_DIR, item_sums(DRAFTER_DIR), checksums(flatten(drafter.params)))
    if drafter is not None and mesh is not None:
        drafter = shard_drafter(drafter, mesh)
    return Model(cfg=cfg, params=params, drafter=drafter, tokenizer=checkpoint_tokenizer(path, manifest),
                 manifest=manifest)


def checkpoint_tokenizer(path: str, manifest: dict):
    """The tokenizer of the checkpoint at path, after every tokenizer file its manifest lists is found to be a
    regular file: without one, `load_tokenizer` would fall back to bytes (no tiktoken.model) or to no special tokens
    (no tokenizer_config.json) without a word. A CheckpointError names the file, or says why the files do not load."""
    for name in manifest.get("tokenizer_files", []):
        why = path_problem(os.path.join(path, name))
        if why is not None:
            raise CheckpointError(f"{path}: tokenizer file {name} {why} (the manifest lists it; without it the "
                                  "checkpoint's tokenizer would be another)")
    try:
        return load_tokenizer(path)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"the tokenizer files of {path} do not load: {e}") from None


def verify_checksums(path: str | os.PathLike) -> int:
    """Read every array of the checkpoint at path to the host, one part at a time, and check it against the CRC-32
    that its manifest records; return the number of arrays checked. A CheckpointError names the first array
    that differs (flipped bytes), is missing or is not recorded, and a checkpoint without checksums."""
    path = os.path.abspath(path)
    sums = read_manifest(path).get("checksums")
    if not sums:
        raise CheckpointError(f"{path}: the manifest records no checksums (converted by an older kdtree-convert); "
                              "convert it again to verify it")
    params = os.path.join(path, PARAMS_DIR)
    stored = [i for i in (sorted(os.listdir(params)) if os.path.isdir(params) else [])
              if i == TOP_ITEM or LAYER_ITEM_RE.fullmatch(i)]
    if os.path.lexists(os.path.join(path, DRAFTER_DIR)):  # (a file or a loop: load_drafter names it)
        stored.append(DRAFTER_DIR)
    # an item the manifest records no checksums for is checked too: its arrays are "not in the manifest", as `load`
    # finds (verify passed a checkpoint that load refused)
    sums = {**sums, **{i: {} for i in stored if i not in sums}}
    for item, want in sums.items():
        if item == DRAFTER_DIR:
            got = checksums(flatten(load_drafter(os.path.join(path, DRAFTER_DIR)).params))
        else:
            got = {}
            for part in _item_parts(os.path.join(path, PARAMS_DIR, item), item):
                meta = _part_metadata(part, item)
                args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta)
                got.update(checksums(flatten(_read_part(part, item, args))))
        check_sums(item, want, got)
    return sum(len(v) for v in sums.values())


def check_sums(item: str, want: dict[str, str], got: dict[str, str]) -> None:
    """Raise CheckpointError when the checksums `got` ({dotted array path: crc32}) of an item's arrays differ from
    those its manifest records (`want`), naming the first array that differs, is missing or is not recorded."""
    if missing := sorted(want.keys() - got.keys()):
        raise CheckpointError(f"{item}: array {missing[0]!r} is missing (the manifest records it)")
    if extra := sorted(got.keys() - want.keys()):
        raise CheckpointError(f"{item}: array {extra[0]!r} is not in the manifest")
    if bad := sorted(k for k in want if want[k] != got[k]):
        raise CheckpointError(f"{item}: array {bad[0]!r} does not match its checksum (crc32 {got[bad[0]]}, the "
                              f"manifest records {want[bad[0]]}): the checkpoint is corrupt"
                              + (f", as are {len(bad) - 1} other array(s)" if len(bad) > 1 else ""))


def stored_arrays(path: str, item: str) -> dict[Path, Any]:
    """{array path: its orbax metadata (shape, dtype)} of one item of the checkpoint at (absolute) path, as `load`
    checks them before reading (`kdtree-convert --verify` checks them against the config too)."""
    return {k: v for part in _item_parts(os.path.join(path, PARAMS_DIR, item), item)
            for k, v in flatten(_part_metadata(part, item)).items()}


def _item_parts(directory: str, what: str) -> list[str]:
    parts = _part_dirs(directory)
    if not parts:
        raise CheckpointError(f"{what}: item {directory} is missing or incomplete")
    return parts


# While orbax reads or writes, and for the rest of the process once a read or write has failed, its own reports of a
# failure stay off stderr: the failure reaches the caller as one exception (a CheckpointError, or the OSError of a full
# disk), and these would repeat it as tracebacks, some after the call has returned. They are absl ERROR records from
# orbax's threads, asyncio's "exception was never retrieved" for orbax's tasks, and unraisable exceptions: of orbax's
# coroutines left running, and of tensorstore's callbacks into orbax's event loop after it closed.
_ORBAX = {"calls": 0, "failed": False, "installed": False}


def _orbax_noise() -> bool:
    return _ORBAX["calls"] > 0 or _ORBAX["failed"]


_ORBAX_MARKS = ("orbax", "tensorstore", "ocdbt")  # in the file, message or exception of a record of orbax's (any case)


class _OrbaxRecords(logging.Filter):
    """Drops orbax's WARNING and ERROR records (absl's, and asyncio's about orbax's tasks and tensorstore's futures)
    while `_orbax_noise()`."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or not _orbax_noise():  # ("Failed to get item metadata": a warning)
            return True
        text = f"{record.pathname} {record.getMessage()} {record.exc_info[1] if record.exc_info else ''}".lower()
        return not any(mark in text for mark in _ORBAX_MARKS)


def _orbax_unraisable(hook):
    """sys.unraisablehook that drops orbax's unraisable exceptions while `_orbax_noise()`, else calls `hook`."""

    def quiet(u) -> None:
        code = getattr(u.object, "cr_code", None) or getattr(getattr(u.object, "get_coro", lambda: None)(),
                                                             "cr_code", None)
        from_orbax = code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename
        closed_loop = u.object is None and isinstance(u.exc_value, RuntimeError) and \
            str(u.exc_value) == "Event loop is closed"
        if not (_orbax_noise() and (from_orbax or closed_loop)):
            hook(u)

    return quiet


@contextlib.contextmanager
def _orbax_call():
    """Around a call into orbax: keeps its own reports of a failure off stderr (see _ORBAX)."""
    if not _ORBAX["installed"]:
        for name in ("absl", "asyncio"):
            logging.getLogger(name).addFilter(_OrbaxRecords())
        sys.unraisablehook = _orbax_unraisable(sys.unraisablehook)
        _ORBAX["installed"] = True
    _ORBAX["calls"] += 1
    try:
        yield
    except BaseException:
        _ORBAX["failed"] = True
        raise
    finally:
        _ORBAX["calls"] -= 1


def _one_line(e: BaseException, limit: int = 300) -> str:
    """The message of e (of its cause when it has one: orbax wraps tensorstore's errors), on one line."""
    text = " ".join(str(e.__cause__ or e).split())
    return text if len(text) <= limit else text[:limit] + "..."


def _part_metadata(part: str, what: str):
    """The tree of array metadata of one orbax part, with a CheckpointError when it does not read."""
    try:
        with _orbax_call():
            meta = ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).metadata(part).item_metadata
    except Exception as e:  # orbax and tensorstore raise plain Exceptions
        raise CheckpointError(f"{what}: {part} is corrupt ({_one_line(e)})") from None
    if meta is None:
        raise CheckpointError(f"{what}: {part} is corrupt or truncated (its orbax metadata does not read)")
    return meta.tree


def _read_part(part: str, what: str, restore_args):
    """Restore one orbax part, with a CheckpointError when its data files are corrupt or truncated."""
    try:
        with _orbax_call():
            return ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).restore(
                part, args=ocp.args.PyTreeRestore(restore_args=restore_args))
    except Exception as e:  # orbax and tensorstore raise plain Exceptions
        raise CheckpointError(f"{what}: {part} is corrupt or truncated ({_one_line(e)})") from None


def _restore(directory: str, what: str, expected, shardings, sums: dict[str, str] | None, pool: ThreadPoolExecutor,
             checks: list | None = None):
    """Restore one item into `shardings` after checking its arrays against `expected` (same structure).

    With `sums` (the manifest's {dotted array path: crc32} of the item), each part is read to the host, its arrays'
    checksums computed in `pool` in pieces (`crc32_pieces`) while the next part is read, and each array placed in its
    sharding; the checksums are compared before returning, or, with `checks` (a list), the comparison is appended to
    it for the caller to run later (`load` runs it after the next item is read, so that no item's last checksums
    hold up the next item's reading). Without `sums`, each device reads only its shard, except where every array
    goes to one device: then each part is read to the host as with sums, its checksums left out (on one device that
    reader was 2.5x faster from the page cache, 2026-12-05: docs/reliability.md)."""
    parts = _item_parts(directory, what)
    stored = [flatten(_part_metadata(p, what)) for p in parts]
    check_arrays(what, {k: v for part in stored for k, v in part.items()}, flatten(expected))
    want, where = flatten(expected), flatten(shardings)
    sharded = sums is None and not all(isinstance(s, SingleDeviceSharding) for s in where.values())
    out, pending = {}, {}
    for part, paths in zip(parts, stored):
        if sharded:
            args = {p: ocp.ArrayRestoreArgs(sharding=where[p], global_shape=want[p].shape, dtype=want[p].dtype)
                    for p in paths}
            out.update(flatten(_read_part(part, what, unflatten_dict(args))))
            continue
        host = flatten(_read_part(part, what, unflatten_dict({p: ocp.RestoreArgs(restore_type=np.ndarray)
                                                              for p in paths})))
        for p, a in host.items():
            if sums is not None:
                pending[".".join(p)] = crc32_pieces(a, pool.submit)
            out[p] = jax.device_put(a, where[p])
    if sums is not None:
        def check():
            check_sums(what, sums, {k: join() for k, join in pending.items()})

        if checks is None:
            check()
        else:
            checks.append(check)
    return from_flat(out, expected)
