"""Write a saved tiny Hugging Face model in each source format kdtree-convert reads.

Each writer takes the directory of a `save_pretrained` model (one model.safetensors, fp32) and writes a new
checkpoint directory. The quantized writers also write `ref_dir`: the same model with the weights the quantized
checkpoint decodes to, in fp32, loadable by transformers as the reference. The formats follow
docs/model.md §1, §7 and §8, implemented here independently of kdtree_jax:

- INT4, compressed-tensors pack-quantized: routed experts only, symmetric, group 32, bf16 `weight_scale`,
  nibbles q + 8 packed least significant first into int32 `weight_packed`, int32 `weight_shape`;
- FP8 e4m3 with one fp32 `weight_scale_inv` per 128x128 block (multiplying: W = fp8 * scale_inv), every Linear
  projection except the router;
- the K2.5 / K2.6 multimodal wrapper: `language_model.` prefix, config under `text_config`, vision tensors;
- shards with a model.safetensors.index.json.
"""

from __future__ import annotations

import base64
import json
import os
import shutil

import numpy as np
import torch
from safetensors.torch import load_file, save_file

INT4_QUANTIZATION = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                  "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                              "group_size": 32, "dynamic": False, "actorder": None,
                                              "observer": "minmax"}}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None,
}
FP8_QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                    "activation_scheme": "dynamic"}


def read(src_dir: str) -> tuple[dict[str, torch.Tensor], dict]:
    return load_file(os.path.join(src_dir, "model.safetensors")), _config(src_dir)


def _config(src_dir: str) -> dict:
    with open(os.path.join(src_dir, "config.json")) as f:
        return json.load(f)


def write(dst_dir: str, tensors: dict[str, torch.Tensor], config: dict) -> str:
    os.makedirs(dst_dir, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(dst_dir, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(dst_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return dst_dir


def is_routed_expert(name: str) -> bool:
    return ".mlp.experts." in name and name.endswith(".weight")


# ---------------------------------------------------------------------------------------------------------------
# INT4 compressed-tensors
# ---------------------------------------------------------------------------------------------------------------


def pack_int32(q: np.ndarray) -> np.ndarray:
    """int [out, in] in [-8, 7] -> int32 [out, in / 8]: word j holds q[8j + i] + 8 at bits 4i .. 4i + 3."""
    nib = (q.astype(np.int64) + 8).astype(np.uint32).reshape(q.shape[0], -1, 8)
    words = np.zeros(nib.shape[:2], np.uint32)
    for i in range(8):
        words |= nib[:, :, i] << np.uint32(4 * i)
    return words.view(np.int32)


def quantize_int4(w: torch.Tensor, group: int = 32):
    """Symmetric per-group INT4 of w [out, in]: (q int8 [out, in], scale bf16 [out, in / group]), scale = max / 7.
    q[0, 0] is forced to -8, a code the QAT checkpoints avoid but a reader must accept."""
    g = w.float().reshape(w.shape[0], -1, group)
    scale = (g.abs().amax(-1) / 7).to(torch.bfloat16)
    s = scale.float().clamp_min(1e-30).unsqueeze(-1)
    q = torch.round(g / s).clamp(-8, 7).to(torch.int8).reshape(w.shape)
    q[0, 0] = -8
    return q, scale


def to_int4(src_dir: str, dst_dir: str, ref_dir: str, group: int = 32) -> str:
    """Routed experts as compressed-tensors pack-quantized INT4; ref_dir gets their dequantized values."""
    tensors, config = read(src_dir)
    out, ref = {}, {}
    for name, w in tensors.items():
        if is_routed_expert(name):
            q, scale = quantize_int4(w, group)
            base = name.removesuffix(".weight")
            out[f"{base}.weight_packed"] = torch.from_numpy(pack_int32(q.numpy()))
            out[f"{base}.weight_scale"] = scale
            out[f"{base}.weight_shape"] = torch.tensor(list(w.shape), dtype=torch.int32)
            ref[name] = q.float() * scale.float().repeat_interleave(group, dim=-1)
        else:
            out[name] = ref[name] = w
    write(ref_dir, ref, config)
    return write(dst_dir, out, {**config, "quantization_config": INT4_QUANTIZATION})


# ---------------------------------------------------------------------------------------------------------------
# FP8 block-scaled
# ---------------------------------------------------------------------------------------------------------------


def is_fp8_linear(name: str, w: torch.Tensor) -> bool:
    return w.ndim == 2 and name.endswith(".weight") and "_proj" in name.rsplit(".", 2)[-2]


def quantize_fp8(w: torch.Tensor, block=(128, 128)):
    """e4m3 values and fp32 scale_inv [ceil(out/bo), ceil(in/bi)], the block's max mapped to 448."""
    (o, i), (bo, bi) = w.shape, block
    po, pi = -(-o // bo) * bo, -(-i // bi) * bi
    padded = torch.zeros(po, pi)
    padded[:o, :i] = w.float()
    blocks = padded.reshape(po // bo, bo, pi // bi, bi)
    scale = (blocks.abs().amax(dim=(1, 3)) / 448.0).clamp_min(1e-12)  # [po/bo, pi/bi]
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    deq = (q.float() * scale[:, None, :, None]).reshape(po, pi)[:o, :i]
    return q.reshape(po, pi)[:o, :i].contiguous(), scale.float(), deq


def to_fp8(src_dir: str, dst_dir: str, ref_dir: str, block=(128, 128)) -> str:
    """Every Linear projection but the router as FP8 e4m3 + weight_scale_inv; ref_dir gets the dequantized ones."""
    tensors, config = read(src_dir)
    out, ref = {}, {}
    for name, w in tensors.items():
        if is_fp8_linear(name, w):
            q, scale_inv, deq = quantize_fp8(w, block)
            out[name], out[f"{name}_scale_inv"], ref[name] = q, scale_inv, deq
        else:
            out[name] = ref[name] = w
    write(ref_dir, ref, config)
    quant = {**FP8_QUANTIZATION, "weight_block_size": list(block)}
    return write(dst_dir, out, {**config, "quantization_config": quant})


# ---------------------------------------------------------------------------------------------------------------
# The K2.5 / K2.6 wrapper, shards, tokenizer files
# ---------------------------------------------------------------------------------------------------------------


VISION_TENSORS = {"vision_tower.patch_embed.proj.weight": (32, 3, 4, 4), "vision_tower.blocks.0.norm.weight": (32,),
                  "mm_projector.linear_1.weight": (64, 32), "mm_projector.linear_1.bias": (64,)}


def wrap_language_model(src_dir: str, dst_dir: str) -> str:
    """`language_model.` prefix on every tensor, the config under text_config (quantization_config at the top,
    as K2.5/K2.6 ship it), vision tensors, and a stale rotary_emb.inv_freq buffer."""
    tensors, config = read(src_dir)
    out = {f"language_model.{k}": v for k, v in tensors.items()}
    out["language_model.model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.rand(8).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(7)
    out.update({k: torch.randn(s, generator=gen).to(torch.bfloat16) for k, s in VISION_TENSORS.items()})
    text = {k: v for k, v in config.items() if k != "quantization_config"}
    wrapper = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": text,
               "vision_config": {"hidden_size": 32}}
    if "quantization_config" in config:
        wrapper["quantization_config"] = config["quantization_config"]
    return write(dst_dir, out, wrapper)


def shard(src_dir: str, dst_dir: str, n: int) -> str:
    """The tensors split over n files named as K2-Thinking names them, with model.safetensors.index.json."""
    tensors, _ = read(src_dir)
    os.makedirs(dst_dir, exist_ok=True)
    names = sorted(tensors)
    weight_map, total = {}, 0
    for k in range(n):
        fname = f"model-{k + 1:05d}-of-{n:06d}.safetensors"
        part = {name: tensors[name].contiguous() for name in names[k::n]}
        save_file(part, os.path.join(dst_dir, fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in part})
        total += sum(t.numel() * t.element_size() for t in part.values())
    with open(os.path.join(dst_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    shutil.copyfile(os.path.join(src_dir, "config.json"), os.path.join(dst_dir, "config.json"))
    return dst_dir


def add_mtp_layer(src_dir: str, dst_dir: str) -> str:
    """A DeepSeek-V3-style multi-token-prediction layer after the last one (a copy of the last layer plus
    enorm, hnorm, eh_proj and shared_head), with num_nextn_predict_layers = 1."""
    tensors, config = read(src_dir)
    n, d = config["num_hidden_layers"], config["hidden_size"]
    last = f"model.layers.{n - 1}."
    out = dict(tensors)
    out.update({f"model.layers.{n}.{k[len(last):]}": v.clone() for k, v in tensors.items() if k.startswith(last)})
    out.update({f"model.layers.{n}.enorm.weight": torch.ones(d), f"model.layers.{n}.hnorm.weight": torch.ones(d),
                f"model.layers.{n}.eh_proj.weight": torch.zeros(d, 2 * d),
                f"model.layers.{n}.shared_head.norm.weight": torch.ones(d)})
    return write(dst_dir, out, {**config, "num_nextn_predict_layers": 1})


MERGES = [b"he", b"ll", b"llo", b"hello", b"wo", b"rl", b"world", b" world", b"o ", "世界".encode()]
SPECIAL_NAMES = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>"]


def write_tokenizer(dst_dir: str) -> dict:
    """A small tiktoken.model (the 256 bytes, then MERGES) and a tokenizer_config.json naming the first special
    ids as Kimi's does, plus [PAD] on the last one. Returns {"num_base": ..., "merges": {bytes: id}}."""
    tokens = [bytes([b]) for b in range(256)] + MERGES
    with open(os.path.join(dst_dir, "tiktoken.model"), "w") as f:
        f.writelines(f"{base64.b64encode(tok).decode()} {rank}\n" for rank, tok in enumerate(tokens))
    num_base = len(tokens)
    added = {str(num_base + i): {"content": name, "special": True} for i, name in enumerate(SPECIAL_NAMES)}
    added[str(num_base + 257)] = {"content": "[PAD]", "special": True}
    config = {"added_tokens_decoder": added, "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]",
              "tokenizer_class": "TikTokenTokenizer"}
    with open(os.path.join(dst_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    return {"num_base": num_base, "merges": {tok: 256 + i for i, tok in enumerate(MERGES)}}
