"""Benchmark kdtree-convert on a synthetic INT4 checkpoint of K2's shapes: throughput and peak resident memory.

The checkpoint is generated on the fly in a temporary directory: Kimi K2 dimensions (hidden 7168, 64 heads, MLA
ranks 1536 / 512, routed experts 2048 wide as compressed-tensors INT4 group 32, a dense first layer of 18432), with
fewer layers, experts and a smaller vocabulary so that it is several GB rather than 594. Each layer is one shard
file, named and indexed as K2-Thinking's are. The source is written, synced and evicted from the page cache
(posix_fadvise DONTNEED on its own files) before the conversion, so the conversion reads it from disk.

The conversion runs in a subprocess that reports its own peak RSS (VmHWM of /proc/self/status: the peak of the
process after exec, unlike getrusage, whose ru_maxrss also counts the parent's memory at fork), and so does a
process that only imports the same modules. The disk's own sequential read and write speed is measured
on a scratch file of the same size class for comparison.

    python benchmarks/convert.py                       # 2 MoE layers x 128 experts (about 9 GB)
    python benchmarks/convert.py --moe-layers 1 --experts 64 --dir /big/disk/tmp
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

import ml_dtypes
import numpy as np

K2 = dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_attention_heads=64,
          num_key_value_heads=64, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
          v_head_dim=128, n_shared_experts=1, num_experts_per_tok=8, n_group=1, topk_group=1,
          first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.827, rms_norm_eps=1e-6,
          rope_theta=50000.0, max_position_embeddings=131072, tie_word_embeddings=False, bos_token_id=163584,
          eos_token_id=163585, num_nextn_predict_layers=0, model_type="kimi_k2",
          architectures=["DeepseekV3ForCausalLM"],
          rope_scaling={"type": "yarn", "factor": 32.0, "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0,
                        "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096},
          quantization_config={
              "quant_method": "compressed-tensors", "format": "pack-quantized",
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                  "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}},
              "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                         "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]})

ST_DTYPES = {np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(np.float32): "F32", np.dtype(np.int32): "I32"}


class Pool:
    """A few random arrays per (shape, dtype), handed out in turn: realistic bytes without generating GBs."""

    def __init__(self, seed: int = 0, variants: int = 2):
        self.rng, self.variants, self.cache, self.turn = np.random.default_rng(seed), variants, {}, 0

    def get(self, shape, dtype) -> np.ndarray:
        key = (tuple(shape), np.dtype(dtype))
        if key not in self.cache:
            self.cache[key] = [self._make(shape, np.dtype(dtype)) for _ in range(self.variants)]
        self.turn += 1
        return self.cache[key][self.turn % self.variants]

    def _make(self, shape, dtype):
        if dtype == np.int32:  # any bit pattern is a valid packed INT4 word
            return self.rng.integers(-2**31, 2**31, size=shape, dtype=np.int64).astype(np.int32)
        return (self.rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(dtype)


def write_safetensors(path: str, tensors: dict[str, np.ndarray]) -> int:
    """A safetensors file written tensor by tensor (no copy of the whole shard in memory)."""
    header, offset = {}, 0
    for name, a in tensors.items():
        header[name] = {"dtype": ST_DTYPES[a.dtype], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for a in tensors.values():
            f.write(memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8)))
        f.flush()
        os.fsync(f.fileno())
    return 8 + len(raw) + offset


def evict(path: str) -> None:
    """Drop a file's clean pages from the page cache (only this file; needs no privileges)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def layer_tensors(cfg: dict, i: int, pool: Pool):
    """(name, array) of decoder layer i in the Hugging Face layout, routed experts as compressed-tensors INT4."""
    bf16 = ml_dtypes.bfloat16
    d, h, rq, r = cfg["hidden_size"], cfg["num_attention_heads"], cfg["q_lora_rank"], cfg["kv_lora_rank"]
    dn, dr, dv, f = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["moe_intermediate_size"]
    p = f"model.layers.{i}"
    yield f"{p}.input_layernorm.weight", pool.get((d,), bf16)
    yield f"{p}.post_attention_layernorm.weight", pool.get((d,), bf16)
    a = f"{p}.self_attn"
    yield f"{a}.q_a_proj.weight", pool.get((rq, d), bf16)
    yield f"{a}.q_a_layernorm.weight", pool.get((rq,), bf16)
    yield f"{a}.q_b_proj.weight", pool.get((h * (dn + dr), rq), bf16)
    yield f"{a}.kv_a_proj_with_mqa.weight", pool.get((r + dr, d), bf16)
    yield f"{a}.kv_a_layernorm.weight", pool.get((r,), bf16)
    yield f"{a}.kv_b_proj.weight", pool.get((h * (dn + dv), r), bf16)
    yield f"{a}.o_proj.weight", pool.get((d, h * dv), bf16)
    if i < cfg["first_k_dense_replace"]:
        fd = cfg["intermediate_size"]
        for proj, shape in (("gate", (fd, d)), ("up", (fd, d)), ("down", (d, fd))):
            yield f"{p}.mlp.{proj}_proj.weight", pool.get(shape, bf16)
        return
    e, g = cfg["n_routed_experts"], 32
    yield f"{p}.mlp.gate.weight", pool.get((e, d), bf16)
    yield f"{p}.mlp.gate.e_score_correction_bias", pool.get((e,), np.float32)
    for proj, shape in (("gate", (f, d)), ("up", (f, d)), ("down", (d, f))):
        yield f"{p}.mlp.shared_experts.{proj}_proj.weight", pool.get(shape, bf16)
    for j in range(e):
        for proj, (o, k) in (("gate", (f, d)), ("up", (f, d)), ("down", (d, f))):
            m = f"{p}.mlp.experts.{j}.{proj}_proj"
            yield f"{m}.weight_packed", pool.get((o, k // 8), np.int32)
            yield f"{m}.weight_scale", pool.get((o, k // g), bf16)
            yield f"{m}.weight_shape", np.array([o, k], np.int32)


def make_checkpoint(path: str, moe_layers: int, experts: int, vocab: int) -> dict:
    """Write the synthetic checkpoint; returns {"bytes": ..., "files": ..., "tensors": ...}."""
    cfg = {**K2, "num_hidden_layers": 1 + moe_layers, "n_routed_experts": experts, "vocab_size": vocab}
    if vocab <= K2["eos_token_id"]:  # the special tokens' ids must lie inside a reduced vocabulary (load checks them)
        cfg.update(bos_token_id=vocab - 2, eos_token_id=vocab - 1)
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=1)
    pool, n_files = Pool(), cfg["num_hidden_layers"] + 1
    weight_map, total = {}, 0
    groups = [[("model.embed_tokens.weight", pool.get((vocab, K2["hidden_size"]), ml_dtypes.bfloat16)),
               ("model.norm.weight", pool.get((K2["hidden_size"],), ml_dtypes.bfloat16)),
               ("lm_head.weight", pool.get((vocab, K2["hidden_size"]), ml_dtypes.bfloat16))]]
    groups += [layer_tensors(cfg, i, pool) for i in range(cfg["num_hidden_layers"])]
    for k, group in enumerate(groups):
        fname = f"model-{k + 1:05d}-of-{n_files:06d}.safetensors"
        tensors = dict(group)
        total += write_safetensors(os.path.join(path, fname), tensors)
        weight_map.update(dict.fromkeys(tensors, fname))
        evict(os.path.join(path, fname))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh)
    return {"bytes": total, "files": n_files, "tensors": len(weight_map)}


def disk_speed(directory: str, nbytes: int) -> tuple[float, float]:
    """Sequential (write, read) GB/s of a scratch file in directory: written and fsynced, evicted, read back."""
    path = os.path.join(directory, "disk_speed.tmp")
    block = np.random.default_rng(1).integers(0, 255, size=64 << 20, dtype=np.uint8)
    t = time.perf_counter()
    with open(path, "wb") as f:
        f.writelines(block for _ in range(nbytes // block.nbytes))
        f.flush()
        os.fsync(f.fileno())
    write = nbytes / (time.perf_counter() - t) / 1e9
    evict(path)
    buf = bytearray(block.nbytes)
    t = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    read = nbytes / (time.perf_counter() - t) / 1e9
    os.remove(path)
    return write, read


PEAK_RSS = "print(next(ln.split()[1] for ln in open('/proc/self/status') if ln.startswith('VmHWM')))"


def run_measured(code: str) -> dict:
    """Run python code in a subprocess: its stdout (but the last line), wall seconds, peak RSS in GB (its own
    VmHWM) and CPU seconds in user and kernel mode (wait4)."""
    t = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", f"{code}\n{PEAK_RSS}"], stdout=subprocess.PIPE, text=True)
    stdout = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t
    if os.waitstatus_to_exitcode(status):
        raise RuntimeError(f"subprocess failed: {os.waitstatus_to_exitcode(status)}")
    *out, peak_kb = stdout.strip().split("\n")
    return {"stdout": "\n".join(out), "wall": wall, "peak": int(peak_kb) * 1024 / 1e9, "user": usage.ru_utime,
            "sys": usage.ru_stime}


IMPORTS = "import json, os; os.environ['JAX_PLATFORMS'] = 'cpu'; import kdtree_converters.convert as c"


def machine() -> str:
    cpu = "unknown CPU"
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{platform.node()}: {cpu}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, {platform.system()}"


def commit() -> str:
    """$KDTREE_COMMIT when set (a copy whose git metadata is stale), else git's short hash of HEAD."""
    if os.environ.get("KDTREE_COMMIT"):
        return os.environ["KDTREE_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--moe-layers", type=int, default=2, help="MoE layers after the dense one (default 2)")
    p.add_argument("--experts", type=int, default=128, help="routed experts per MoE layer (default 128)")
    p.add_argument("--vocab", type=int, default=32768, help="vocabulary size (default 32768)")
    p.add_argument("--dir", default=None, help="where to put the temporary checkpoints (default: the system temp)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "convert",
                                                 "convert.md"),
                   help="append the markdown result to this file (default: results/convert/convert.md)")
    args = p.parse_args()

    root = tempfile.mkdtemp(prefix="kdtree-convert-bench-", dir=args.dir)
    try:
        free = shutil.disk_usage(root).free
        src, out = os.path.join(root, "hf"), os.path.join(root, "out")
        t = time.perf_counter()
        info = make_checkpoint(src, args.moe_layers, args.experts, args.vocab)
        gen_s = time.perf_counter() - t
        if free < 2.2 * info["bytes"]:
            raise SystemExit(f"not enough free disk in {root}: {free / 1e9:.1f} GB for 2 x {info['bytes'] / 1e9:.1f}")
        print(f"generated {info['bytes'] / 1e9:.2f} GB in {info['files']} shards ({gen_s:.0f} s)", file=sys.stderr)
        disk_w, disk_r = disk_speed(root, min(info["bytes"] // 2, 4 << 30) // (64 << 20) * (64 << 20))
        base_rss = run_measured(IMPORTS)["peak"]
        code = (f"{IMPORTS}\nm = c.convert({src!r}, {out!r}, progress=False, log=lambda s: None)\n"
                "print(json.dumps({'stats': m['stats'], 'source': m['source'], 'converted': m['converted']}))")
        run = run_measured(code)
        wall, peak = run["wall"], run["peak"]
        t = time.perf_counter()
        os.sync()
        sync_s = time.perf_counter() - t
        m = json.loads(run["stdout"])
        st, gb, largest = m["stats"], info["bytes"] / 1e9, m["source"]["largest_item_bytes"] / 1e9
        out_gb = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out) for f in fs) / 1e9
        floor = gb / disk_r + out_gb / disk_w
        rows = [
            ("source", (f"{gb:.2f} GB INT4 compressed-tensors, {info['files']} shards, {info['tensors']} tensors "
                        f"(1 dense + {args.moe_layers} MoE layers x {args.experts} experts, vocab {args.vocab})")),
            ("largest layer (source bytes)", f"{largest:.2f} GB"),
            ("output", f"{out_gb:.2f} GB orbax (experts int4, bf16)"),
            ("conversion wall time", (f"{wall:.1f} s, process start included (in convert(): read "
                                      f"{st['read_s']:.1f} s, convert {st['convert_s']:.1f} s, write "
                                      f"{st['write_s']:.1f} s); then `sync` {sync_s:.1f} s")),
            ("CPU time of the conversion", f"user {run['user']:.1f} s, kernel {run['sys']:.1f} s"),
            ("throughput", f"**{gb / wall:.2f} GB/s** of source ({gb / (wall + sync_s):.2f} GB/s to durable)"),
            ("disk, sequential (same filesystem)", (f"read {disk_r:.2f} GB/s, write {disk_w:.2f} GB/s; read-then-"
                                                    f"write floor {floor:.1f} s = {gb / floor:.2f} GB/s")),
            ("peak RSS", (f"**{peak:.2f} GB = {peak / largest:.2f} x the largest layer** "
                          f"({peak / gb:.2f} x the source)")),
            ("RSS of the imports alone", (f"{base_rss:.2f} GB; peak minus that: {peak - base_rss:.2f} GB = "
                                          f"{(peak - base_rss) / largest:.2f} x the largest layer")),
        ]
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        text = (f"### {now}, commit {commit()}\n\nmachine: {machine()}\n\n| | |\n|---|---|\n"
                + "".join(f"| {k} | {v} |\n" for k, v in rows) + "\n")
        print(text)
        if args.out:
            with open(args.out, "a") as f:
                f.write(text)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
