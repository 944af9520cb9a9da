"""Memory plan: what one GPU holds to serve a model on a mesh with a workload, from shapes alone (no devices, no
weights read).

Per GPU (docs/plan.md explains each term):
  weights        every declared weight (`model.param_info`) divided by the mesh axes its logical axes map to under
                 `sharding.RULES`; INT4 experts as packed int32 words [.., in/8] plus bf16 scales [.., in/group].
                 A drafter's weights are split the same way where the mesh divides them, else replicated
                 (`drafter.drafter_shardings`). Totals in closed form: every decoder layer of a kind (dense
                 MLP, MoE) has the same arrays, so one layer of each kind is declared and counted (`layer_kinds`).
  latent cache   (kv_lora_rank + qk_rope_head_dim) values per token per layer in the model dtype, replicated over the
                 model axes ep x tp (every head reads all of it) and split over dp along the batch only when dp
                 divides the batch; generate sizes it at context + budget + 1 slots, rounded up to CACHE_ALIGN.
                 A drafter's context cache (keys and values per drafter layer) has the same rows and slots rounded
                 up to a multiple of 256 (drafter.draft_slots), its key/value heads split over ep x tp where they
                 divide.
  activations    an estimate of the largest live buffers of one DDTree verify step over concurrency x (budget + 1)
                 tokens, with the custom calls (kernels="ffi"): every layer's output (kept for the drafter), working
                 hidden states, one layer's attention and routed-expert buffers, the vocabulary-sharded fp32 logits.
  workspace      WORKSPACE_FRACTION of the GPU: XLA scratch, fragmentation, the runtime.
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import jax.numpy as jnp

from . import configs
from .builtin import PACKAGE_DIR
from .checkpoint import read_json
from .config import ModelConfig
from .drafter import DrafterConfig, draft_slots, drafter_info
from .model import ArrayInfo, Layer, Params, check_model_fits, param_info
from .sharding import MESH_AXES, ShardingError, logical_to_spec

GB = 1e9
WORKSPACE_FRACTION = 0.08
CACHE_ALIGN = 64  # generate rounds the cache length up to a multiple of 64 slots
MAX_BUDGET = 4096  # the CUDA tree_build kernel keeps at most 4096 nodes
WORKING_HIDDEN_COPIES = 8  # fp32 [tokens, D] buffers live at once in a layer (residual, norm, outputs, all-reduce)
PRESETS = ("builtin", "k2_6", "tiny")


def load_config(model: str) -> tuple[ModelConfig, DrafterConfig | None, str]:
    """(config, drafter config or None, description) of a preset name or a checkpoint directory (its config.json,
    and drafter/drafter_config.json or drafter_config.json when present); no weights are read."""
    if model == "k2_6":
        return configs.k2_6(), None, "the Kimi K2.6 preset, no drafter"
    if model == "tiny":
        return configs.tiny(), None, "the tiny preset, no drafter"
    directory = str(PACKAGE_DIR) if model == "builtin" else model
    config = directory if os.path.isfile(directory) else os.path.join(directory, "config.json")
    if not model or not os.path.isfile(config):
        raise ValueError(f"--model {model!r}: not a preset ({', '.join(PRESETS)}) and no config.json at {config}")
    raw = read_json(config)  # malformed JSON: an error naming the file
    try:
        cfg = ModelConfig.from_dict(raw) if "expert_format" in raw else ModelConfig.from_hf(raw)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{config}: {e}") from None
    folder = os.path.dirname(config)
    dcfg = None
    for candidate in (os.path.join(folder, "drafter", "drafter_config.json"),
                      os.path.join(folder, "drafter_config.json")):
        if os.path.isfile(candidate):
            draw = read_json(candidate)
            try:
                dcfg = DrafterConfig(**{**draw, "target_layer_ids": tuple(draw["target_layer_ids"])})
                dcfg.check_target(cfg)
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{candidate}: not a drafter config of this model ({e})") from None
            break
    name = "the embedded model" if model == "builtin" else f"checkpoint {directory}"
    return cfg, dcfg, name + (" with its drafter" if dcfg else ", no drafter")


def check_mesh(cfg: ModelConfig, mesh: dict[str, int]) -> dict[str, int]:
    """{"dp", "ep", "tp"} sizes (absent axes 1), raising ShardingError under the rules `sharding` applies to a real
    mesh: heads divisible by ep x tp, routed experts by ep, and every sharded weight dimension by its axes."""
    unknown = set(mesh) - set(MESH_AXES)
    if unknown:
        raise ShardingError(f"unknown mesh axes {sorted(unknown)} (axes: {', '.join(MESH_AXES)})")
    sizes = {a: mesh.get(a, 1) for a in MESH_AXES}
    for a, n in sizes.items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ShardingError(f"mesh axis {a} must be an integer >= 1, got {n!r}")
    check_model_fits(cfg, sizes["ep"], sizes["tp"])
    model_weight_bytes(cfg, sizes)  # every weight dimension divides its mesh axes
    return sizes


def check_hosts(mesh: dict[str, int], hosts: int) -> dict:
    """How a (dp, ep, tp) mesh lies over `hosts` hosts of equal GPU count, as `kj.make_mesh` lays it (devices in
    process order, tp innermost): raise ShardingError when the GPUs do not split evenly or a tp group would span
    hosts; else {"hosts", "gpus_per_host", "crossing": the mesh axes whose groups span hosts}."""
    devices = math.prod(mesh.values())
    if isinstance(hosts, bool) or not isinstance(hosts, int) or hosts < 1 or devices % hosts:
        raise ShardingError(f"the mesh's {devices} GPUs do not split evenly over {hosts!r} hosts")
    per_host = devices // hosts
    # in closed form, not over an array of the devices (a mesh of 10**12 GPUs is planned at once): an axis' groups
    # are its strides through aligned blocks of `block` devices (tp: tp; ep: ep x tp; dp: all), and a group spans
    # hosts where a host's first device (a multiple of per_host) falls inside a block
    block = {"dp": devices, "ep": mesh["ep"] * mesh["tp"], "tp": mesh["tp"]}
    crossing = [a for a in MESH_AXES if mesh[a] > 1 and per_host % block[a]]
    if "tp" in crossing:
        raise ShardingError(f"tp = {mesh['tp']} would put a tensor-parallel group on several hosts of {per_host} GPUs; "
                            "keep tp inside a host")
    return dict(hosts=hosts, gpus_per_host=per_host, crossing=crossing)


def _stored(a: ArrayInfo, group: int) -> list[tuple[str, tuple[int, ...], int]]:
    """(what, shape, bytes per element) of the arrays that hold declaration `a` (INT4: packed words and scales)."""
    if a.init == "int4":
        *lead, n_in = a.shape
        return [(f"INT4 weight {a.shape}", (*lead, n_in // 8), 4), (f"INT4 scale {a.shape}", (*lead, n_in // group), 2)]
    return [(f"weight {a.shape} axes {a.axes}", a.shape, jnp.dtype(a.dtype).itemsize)]


def leaf_bytes(a: ArrayInfo, mesh: dict[str, int], group: int, fitting: bool = False) -> int:
    """Bytes of declaration `a` held by one device; with `fitting`, a dimension its mesh axes do not divide is
    replicated (`sharding.fitting_sharding`, as the drafter is placed) instead of an error."""
    spec = logical_to_spec(a.axes)
    total = 0
    for what, shape, itemsize in _stored(a, group):
        elems = math.prod(shape)
        for dim, entry in zip(shape, spec):
            names = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
            n = math.prod(mesh[m] for m in names)
            if dim % n and not fitting:
                raise ShardingError(f"{what}: dimension {dim} of {shape} is not divisible by the {n} devices of "
                                    f"mesh axes {entry}")
            elems //= n if dim % n == 0 else 1
        total += elems * itemsize
    return total


def weight_bytes(infos, mesh: dict[str, int], group: int, fitting: bool = False) -> int:
    """Bytes per device of a pytree of ArrayInfo declarations (`fitting`: see leaf_bytes)."""
    leaves = jax.tree.leaves(infos, is_leaf=lambda x: isinstance(x, ArrayInfo))
    return sum(leaf_bytes(a, mesh, group, fitting) for a in leaves)


def layer_kinds(cfg: ModelConfig) -> tuple[Params, list[tuple[int, Layer]]]:
    """(the declarations of a model of one decoder layer of each kind, [(layers of that kind in cfg, the declaration
    of one)]): every dense layer has the same arrays, and so has every MoE layer, so that a total over the layers is
    a sum over (at most) two kinds, whatever num_hidden_layers is."""
    counts = [n for n in (cfg.num_dense_layers, cfg.num_moe_layers) if n]
    one_each = dataclasses.replace(cfg, num_hidden_layers=len(counts),
                                   first_k_dense_replace=int(cfg.num_dense_layers > 0))
    info = param_info(one_each)
    return info, list(zip(counts, info.layers))


def model_weight_bytes(cfg: ModelConfig, mesh: dict[str, int]) -> int:
    """Bytes per device of the model's weights, in closed form (`layer_kinds`): the same as weight_bytes over
    param_info(cfg), in time that does not grow with the layer count."""
    info, kinds = layer_kinds(cfg)
    top = weight_bytes((info.embed, info.final_norm, info.lm_head), mesh, cfg.group_size)
    return top + sum(n * weight_bytes(layer, mesh, cfg.group_size) for n, layer in kinds)


def cache_slots(context: int, budget: int) -> int:
    """Cache slots per row: the context plus the tree's budget + 1 nodes, rounded up like generate does."""
    return -(-(context + budget + 1) // CACHE_ALIGN) * CACHE_ALIGN


def rows_per_device(concurrency: int, dp: int) -> int:
    """Cache and activation rows one device holds: the batch splits over dp only when dp divides it."""
    return concurrency // dp if concurrency % dp == 0 else concurrency


@dataclasses.dataclass(frozen=True)
class Plan:
    """Bytes per GPU of each part, the workload and the verdict."""

    model: str
    mesh: dict[str, int]
    context: int
    concurrency: int
    budget: int
    gpu_bytes: int
    rows: int  # cache rows per GPU
    slots: int  # cache slots per row
    weights: int
    drafter_weights: int
    latent_cache: int
    drafter_cache: int
    activations: dict[str, int]
    workspace: int
    sharded_cache: int  # the latent cache under cache_sharding="sequence" (slots split over ep x tp) + drafter cache
    notes: tuple[str, ...]
    context_limit: int = 2**62  # the longest context the model's positions allow at this budget (`context_limit`)

    @property
    def total(self) -> int:
        return (self.weights + self.drafter_weights + self.latent_cache + self.drafter_cache
                + sum(self.activations.values()) + self.workspace)

    @property
    def free(self) -> int:
        return self.gpu_bytes - self.total

    @property
    def fits(self) -> bool:
        """It fits in memory, and the model's positions hold the context (generate refuses a longer one)."""
        return self.free >= 0 and self.context <= self.context_limit

    @property
    def sharded_total(self) -> int:
        return self.total - self.latent_cache - self.drafter_cache + self.sharded_cache


def activation_bytes(cfg: ModelConfig, dcfg: DrafterConfig | None, mesh: dict[str, int], rows: int,
                     budget: int) -> dict[str, int]:
    """Estimated largest live buffers of one verify step over rows x (budget + 1) tokens on one device."""
    t = rows * (budget + 1)
    dt = cfg.jnp_dtype.itemsize
    d, mp = cfg.hidden_size, mesh["ep"] * mesh["tp"]
    heads = cfg.num_attention_heads // mp
    out = {
        "layer outputs": cfg.num_hidden_layers * t * d * dt,  # [L, B, T, D]: the step returns every layer's
        "working hidden states": WORKING_HIDDEN_COPIES * t * d * 4,
        "attention": t * heads * (cfg.kv_lora_rank * (dt + 4)  # q_lat [T, H, R] and its fp32 output
                                  + (cfg.qk_head_dim + cfg.v_head_dim) * dt),  # q, o per head
        "routed experts": (t * cfg.num_experts_per_tok  # slots x (input, fp32 output, fp32 gate and up)
                           * (d * (dt + 4) + 2 * cfg.moe_intermediate_size // mesh["tp"] * 4)
                           if cfg.num_moe_layers else 0),
        "logits": t * cfg.vocab_size // mp * 4,  # fp32 [T, V / (ep*tp)]
    }
    if dcfg is not None:  # the drafter's block and its per-depth logits
        out["drafter step"] = rows * dcfg.block_size * (WORKING_HIDDEN_COPIES * d * 4 + cfg.vocab_size // mp * 4)
    return out


def plan(cfg: ModelConfig, dcfg: DrafterConfig | None, mesh: dict[str, int], context: int, concurrency: int,
         budget: int, gpu_bytes: int, model: str = "") -> Plan:
    """The memory plan of serving `concurrency` rows of `context` tokens with DDTree budget `budget` on `mesh`."""
    for name, value in (("context", context), ("concurrency", concurrency)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"--{name} must be a positive integer, got {value!r}")
    if isinstance(budget, bool) or not isinstance(budget, int) or not 1 <= budget <= MAX_BUDGET:
        raise ValueError(f"--budget must be in 1..{MAX_BUDGET} (the CUDA tree kernel's limit), got {budget!r}")
    if dcfg is not None and budget > dcfg.depth * cfg.vocab_size:
        raise ValueError(f"--budget {budget} exceeds the drafter's {dcfg.depth} x {cfg.vocab_size} (depth, token) "
                         "choices")
    if not (math.isfinite(gpu_bytes) and gpu_bytes > 0):
        raise ValueError(f"--gpu-memory-gb must be a positive number, got {gpu_bytes / GB:g}")
    gpu_bytes = int(gpu_bytes)
    mesh = check_mesh(cfg, mesh)
    rows, slots = rows_per_device(concurrency, mesh["dp"]), cache_slots(context, budget)
    dt = cfg.jnp_dtype.itemsize
    per_row = slots * cfg.num_hidden_layers * cfg.kv_cache_dim * dt
    d_per_row = 0
    if dcfg is not None:  # its key/value heads split over ep x tp where they divide, as init_draft_cache places them
        split = mesh["ep"] * mesh["tp"] if dcfg.num_kv_heads % (mesh["ep"] * mesh["tp"]) == 0 else 1
        d_per_row = (2 * dcfg.num_layers * draft_slots(slots) * dcfg.num_kv_heads // split * dcfg.head_dim
                     * jnp.dtype(dcfg.dtype).itemsize)
    notes = []
    if rows == concurrency and mesh["dp"] > 1:
        notes.append(f"concurrency {concurrency} is not divisible by dp={mesh['dp']}: the batch is replicated")
    limit = context_limit(cfg, budget)
    if context > limit:
        notes.append(f"context {context:,} + budget {budget} + 1 exceeds the model's {cfg.max_position_embeddings:,} "
                     f"positions: generate refuses it (at most {limit:,} at this budget)")
    if dcfg is None:
        notes.append("no drafter in this config: a drafter's weights and context cache are not counted")
    return Plan(model=model, mesh=mesh, context=context, concurrency=concurrency, budget=budget, gpu_bytes=gpu_bytes,
                context_limit=limit,
                rows=rows, slots=slots, weights=model_weight_bytes(cfg, mesh),
                drafter_weights=weight_bytes(drafter_info(dcfg), mesh, cfg.group_size, fitting=True) if dcfg else 0,
                latent_cache=rows * per_row, drafter_cache=rows * d_per_row,
                activations=activation_bytes(cfg, dcfg, mesh, rows, budget),
                workspace=int(WORKSPACE_FRACTION * gpu_bytes),
                sharded_cache=-(-rows * per_row // (mesh["ep"] * mesh["tp"])) + rows * d_per_row,
                notes=tuple(notes))


def _largest(fits, hi_limit: int) -> int:
    """The largest n in 1..hi_limit with fits(n) (fits is monotone), or 0 when fits(1) is false."""
    if hi_limit < 1 or not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= hi_limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, hi_limit + 1)  # fits(lo), not fits(hi) (or hi past the limit)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def largest_concurrency(cfg, dcfg, p: Plan, limit: int = 1 << 20) -> int:
    """The largest concurrency (a multiple of dp, so that the batch splits) that fits at p's context, or 0."""
    dp = p.mesh["dp"]
    ok = lambda rows: plan(cfg, dcfg, p.mesh, p.context, rows * dp, p.budget, p.gpu_bytes).fits
    return _largest(ok, max(1, limit // dp)) * dp  # one row per dp group at least, however wide dp is


def context_limit(cfg: ModelConfig, budget: int) -> int:
    """The longest context generate accepts: the model's positions less the tree's budget + 1 slots."""
    return cfg.max_position_embeddings - budget - 1


def largest_context(cfg, dcfg, p: Plan) -> int:
    """The largest context that fits at p's concurrency, within `context_limit`, or 0."""
    ok = lambda ctx: plan(cfg, dcfg, p.mesh, ctx, p.concurrency, p.budget, p.gpu_bytes).fits
    return _largest(ok, context_limit(cfg, p.budget))


def report(cfg: ModelConfig, dcfg: DrafterConfig | None, p: Plan) -> dict:
    """The plan as a JSON-able dict, sizes in GB (1e9 bytes) rounded to 2 decimals."""
    g = lambda n: round(n / GB, 2)
    return dict(
        model=p.model, mesh=p.mesh, devices=math.prod(p.mesh.values()), context=p.context,
        concurrency=p.concurrency, budget=p.budget, gpu_memory_gb=g(p.gpu_bytes), drafter=dcfg is not None,
        cache_rows_per_gpu=p.rows, cache_slots_per_row=p.slots,
        per_gpu_gb=dict(weights=g(p.weights), drafter_weights=g(p.drafter_weights), latent_cache=g(p.latent_cache),
                        drafter_cache=g(p.drafter_cache), activations=g(sum(p.activations.values())),
                        workspace=g(p.workspace), total=g(p.total), free=g(p.free)),
        activations_gb={k: g(v) for k, v in p.activations.items()},
        cache_layout="replicated over ep x tp, split over dp along the batch",
        fits=p.fits, largest_concurrency=largest_concurrency(cfg, dcfg, p),
        largest_context=largest_context(cfg, dcfg, p), context_limit=context_limit(cfg, p.budget),
        sequence_sharded=dict(cache_gb=g(p.sharded_cache), total_gb=g(p.sharded_total),
                                         fits=p.sharded_total <= p.gpu_bytes),
        notes=list(p.notes))


def format_report(r: dict) -> str:
    """The human-readable form of `report`'s dict."""
    m, gb = r["mesh"], r["per_gpu_gb"]
    mesh = " ".join(f"{a}={m[a]}" for a in MESH_AXES)
    lines = [f"model: {r['model']}",
             f"mesh: {mesh} ({r['devices']} GPU{'s' * (r['devices'] > 1)} of {r['gpu_memory_gb']:.2f} GB)",
             f"workload: concurrency {r['concurrency']} x context {r['context']:,}, DDTree budget {r['budget']} "
             f"(verify step: {r['concurrency']} x {r['budget'] + 1} tokens)",
             "",
             f"{'per GPU':52s}{'GB':>9s}"]
    row = lambda label, v, extra="": lines.append(f"  {label:50s}{v:9.2f}" + (f"   {extra}" if extra else ""))
    row("weights (sharded by the rules)", gb["weights"])
    if r["drafter"]:
        row("drafter weights (replicated)", gb["drafter_weights"])
    row("latent cache (REPLICATED over ep x tp)", gb["latent_cache"],
        f"{r['cache_rows_per_gpu']} rows x {r['cache_slots_per_row']:,} slots")
    if r["drafter"]:
        row("drafter context cache (replicated over ep x tp)", gb["drafter_cache"])
    row("verify-step activations (estimate)", gb["activations"])
    row(f"workspace margin ({WORKSPACE_FRACTION:.0%} of the GPU)", gb["workspace"])
    row("total", gb["total"])
    row("free", gb["free"])
    lines.append("")
    lines.append("note: the latent cache is REPLICATED over the model axes ep x tp today (every head reads all of "
                 "it); only dp splits it, along the batch")
    for note in r["notes"]:
        lines.append(f"note: {note}")
    ctx, conc = r["largest_context"], r["largest_concurrency"]
    at_ctx = f"largest concurrency that fits at context {r['context']:,}: " + (
        f"{conc}" if conc else "none (not even 1)")
    at_conc = f"largest context that fits at concurrency {r['concurrency']}: " + (
        f"{ctx:,}" + (" (the model's limit at this budget)" if ctx == r["context_limit"] else "") if ctx
        else "none (not even 1 token)")
    if r["context"] > r["context_limit"]:
        lines.append(f"DOES NOT FIT: context {r['context']:,} exceeds the model's limit of {r['context_limit']:,} "
                     "tokens at this budget" + (f" (and memory: {-gb['free']:.2f} GB short per GPU)"
                                                if gb["free"] < 0 else ""))
    elif r["fits"]:
        lines.append(f"FITS: {gb['free']:.2f} GB free per GPU")
    else:
        lines.append(f"DOES NOT FIT: this workload needs {-gb['free']:.2f} GB more per GPU than there is")
    lines += [f"  {at_ctx}", f"  {at_conc}"]
    if not conc and not ctx:
        lines.append("  the weights alone leave no room: use more devices (a larger ep or tp)")
    s = r["sequence_sharded"]
    lines.append(f"with cache_sharding=\"sequence\" (each of the ep x tp devices holds "
                 f"1/{r['mesh']['ep'] * r['mesh']['tp']} "
                 "of every row's slots; tested on simulated devices, not yet measured on GPUs): "
                 f"{s['cache_gb']:.2f} GB of cache per GPU, "
                 f"total {s['total_gb']:.2f} GB: " + ("would not fit either" if not s["fits"] else "would fit"
                                                          + (" in memory (the context is still past the model's)"
                                                             if r["context"] > r["context_limit"] else "")))
    return "\n".join(lines)
