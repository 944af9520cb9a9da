"""The `kdtree-jax` command line: generate text (streaming) and print the decoding stats."""

from __future__ import annotations

import argparse
import sys
import time


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kdtree-jax",
        description="Kimi K2.x inference with DDTree speculative decoding, in JAX.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  kdtree-jax generate --prompt 'def fibonacci(n):'\n"
               "  kdtree-jax generate --model /ckpt/k2 --method ddtree --budget 64 --prompt 'Hello'\n")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate a continuation of a prompt",
                       description="Generate a continuation of --prompt, streaming the text, then print a stats line "
                                   "(steps, tokens per step tau, tokens/s).")
    g.add_argument("--prompt", required=True, help="the text to continue")
    g.add_argument("--model", default=None,
                   help="a converted checkpoint directory (kdtree-convert), or 'builtin'. Default: the embedded "
                        "model shipped in the package (else a random tiny model with a byte tokenizer)")
    g.add_argument("--method", choices=("ar", "chain", "ddtree"), default="ar",
                   help="ar: one token per step; chain: DFlash linear draft; ddtree: DDTree draft tree (default: ar)")
    g.add_argument("--budget", type=int, default=64, help="ddtree: draft tree nodes per step (default: 64)")
    g.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most (default: 128)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    g.add_argument("--seed", type=int, default=0, help="sampling and random-model seed (default: 0)")
    g.add_argument("--mesh", default=None, metavar="AXES",
                   help="shard over the local devices, e.g. 'tp=8' or 'ep=4,tp=2' or 'dp=2,ep=4' (axes dp, ep, tp; "
                        "their product must equal the device count). Default: one device")
    g.add_argument("--kernels", choices=("xla", "ffi"), default=None,
                   help="custom calls (ffi) or their pure-JAX references (xla). Default: the model's setting")
    return p


def _load(args):
    """(params, cfg, tokenizer, drafter, note)."""
    import jax

    import kdtree_jax as kj
    from kdtree_jax import builtin
    from kdtree_jax.tokenizer import ByteTokenizer

    if args.model is not None:
        model = builtin.load_builtin() if args.model == "builtin" else kj.load(args.model)
        return model.params, model.cfg, model.tokenizer, model.drafter, f"model {args.model}"
    if builtin.available():
        model = builtin.load_builtin()
        return (model.params, model.cfg, model.tokenizer, model.drafter,
                "the embedded model (4M parameters, trained on the Python standard library, byte tokens)")
    cfg = kj.configs.tiny()
    params = kj.init_params(cfg, jax.random.key(args.seed))
    drafter = None
    if args.method != "ar":
        drafter = kj.init_drafter(cfg, jax.random.key(args.seed + 1), num_layers=1, block_size=8)
    return (params, cfg, ByteTokenizer(), drafter,
            "no --model given: a RANDOM tiny model with a byte tokenizer (its text is noise)")


def parse_mesh(text: str) -> dict[str, int]:
    """'ep=4,tp=2' -> {'ep': 4, 'tp': 2}, with a ValueError naming what is wrong."""
    axes = {}
    for part in text.split(","):
        name, _, value = part.strip().partition("=")
        if name not in ("dp", "ep", "tp") or not value.isdigit() or name in axes:
            raise ValueError(f"--mesh {text!r}: expected comma-separated dp=N, ep=N, tp=N (each at most once)")
        axes[name] = int(value)
    return axes


def generate_command(args) -> int:
    import dataclasses

    import jax

    import kdtree_jax as kj

    params, cfg, tok, drafter, note = _load(args)
    if args.kernels is not None:
        cfg = dataclasses.replace(cfg, kernels=args.kernels)
    if args.mesh is not None:
        mesh = kj.make_mesh(**parse_mesh(args.mesh))
        params = kj.shard_params(params, cfg, mesh)
        if drafter is not None:
            drafter = jax.device_put(drafter, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
        note += f"; sharded over {dict(mesh.shape)}"
    print(f"[kdtree-jax] {note}", file=sys.stderr)
    ids = tok.encode(args.prompt)
    t0 = time.perf_counter()
    sys.stdout.write(args.prompt)
    if args.method == "ar":
        from kdtree_jax.generate import stream_ar

        new = []
        for chunk in stream_ar(params, cfg, ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                               seed=args.seed, eos_id=tok.eos_id):
            before = tok.decode(new)
            new += chunk
            sys.stdout.write(tok.decode(new)[len(before):])
            sys.stdout.flush()
        elapsed = time.perf_counter() - t0
        stats = {"method": "ar", "steps": max(len(new) - 1, 0), "tau": 1.0, "new_tokens": len(new),
                 "tokens_per_s": len(new) / elapsed}
    else:
        out = kj.generate(params, cfg, [ids], max_new_tokens=args.max_new_tokens, method=args.method,
                          drafter=drafter, budget=args.budget, temperature=args.temperature, seed=args.seed,
                          eos_id=tok.eos_id)
        sys.stdout.write(tok.decode(out.tokens[0]))
        stats = out.stats
        elapsed = time.perf_counter() - t0
    print()
    line = (f"[stats] method={stats['method']} new_tokens={stats['new_tokens']} steps={stats['steps']} "
            f"tau={stats['tau']:.2f} tokens/s={stats['tokens_per_s']:.1f} (total {elapsed:.1f}s incl. compile)")
    if stats.get("tau_histogram"):
        line += f" tau_histogram={stats['tau_histogram']}"
    print(line)
    return 0


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "generate":
            return generate_command(args)
    except (ValueError, TypeError, FileNotFoundError, RuntimeError) as e:
        print(f"kdtree-jax: error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
