"""One process of a two-process job on this machine (tests/test_multihost.py starts two of these).

    python tests/multihost_worker.py PORT PROCESS_ID OUT_JSON [--other-config] [--ckpt DIR]

Joins the job (4 CPU devices per process, gloo), makes a 2 x 4 mesh over the 8 global devices (ep=2 across the
processes, tp=4 inside each), makes the tiny model's weights in their shardings, runs forward and generate (ar and
ddtree), loads the embedded model (and a converted checkpoint, each process restoring its own shards) onto a
2 x 4 mesh and generates with it; process 0 writes the results as JSON.
"""

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import kdtree_jax as kj  # noqa: E402
from kdtree_jax.distributed import is_leader, to_host  # noqa: E402

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10]]


def main() -> int:
    port, pid, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    layers = 3 if "--other-config" not in sys.argv else 4
    kj.init_distributed(f"127.0.0.1:{port}", 2, pid, timeout_s=60)
    jax.config.update("jax_default_matmul_precision", "highest")
    mesh = kj.make_mesh(ep=2, tp=4)
    cfg = kj.configs.tiny(num_attention_heads=8, n_routed_experts=16, moe_intermediate_size=256,
                          num_hidden_layers=layers)
    from kdtree_jax.distributed import check_same

    check_same("the model config", cfg.to_dict())
    params = kj.init_params(cfg, jax.random.key(0), mesh=mesh)
    drafter = kj.init_drafter(cfg, jax.random.key(1), num_layers=1, block_size=4)
    tokens = np.random.default_rng(0).integers(0, 256, size=(4, 16))
    res = dict(logits=to_host(kj.forward(params, cfg, tokens)).tolist(),
               ar=kj.generate(params, cfg, PROMPTS, max_new_tokens=8).tokens,
               ddtree=kj.generate(params, cfg, PROMPTS, max_new_tokens=8, method="ddtree", drafter=drafter,
                                  budget=8).tokens)
    small = kj.make_mesh(dp=2, ep=4)  # 4 heads split 4 ways; dp spans the processes
    model = kj.load("builtin", small)
    res["builtin"] = kj.generate(model, [model.tokenizer.encode("def add(a, b):")], max_new_tokens=12).tokens
    if "--ckpt" in sys.argv:
        ckpt = kj.load(sys.argv[sys.argv.index("--ckpt") + 1], small)
        shards = {tuple(s.data.shape) for s in ckpt.params.moe_layers[0].mlp.we_gate.addressable_shards}
        res["ckpt_local_shards"] = sorted(shards)
        res["ckpt"] = kj.generate(ckpt, PROMPTS, max_new_tokens=8).tokens
    if is_leader():
        import json

        with open(out, "w") as f:
            json.dump(res, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
