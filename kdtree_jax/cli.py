"""The `kdtree-jax` command line: `generate` (streamed text and the decoding stats), `bench` (tokens/s, tau and
the equality with AR of ar / chain / ddtree on held-out text, side by side in one run), `plan` (the memory one GPU
needs for a model, a mesh and a workload, from shapes alone), `serve` (an OpenAI-compatible server with continuous
batching) and `bench-serve` (a running server's throughput and latency at several concurrencies)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import stat
import sys
import time

from .xla_flags import apply_gpu_flags

DEFAULT_PROMPT = 'def fibonacci(n):\n    """Return'


INT32_MAX = 2**31 - 1


class OneLineParser(argparse.ArgumentParser):
    """argparse with its errors on one line (no usage block): what every other error of the CLI looks like (and
    kdtree-convert's)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="kdtree-jax",
        description="Kimi K2.x inference with DDTree speculative decoding, in JAX.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  kdtree-jax generate --method ddtree\n"
               "  kdtree-jax generate --model /ckpt/k2 --method ddtree --budget 64 --prompt 'Hello'\n"
               "  kdtree-jax bench --budgets 16,64 --batch 4\n"
               "  kdtree-jax bench --model /ckpt/k2 --mesh tp=8 --kernels ffi --json k2.json\n"
               "  kdtree-jax plan --model k2_6 --mesh ep=8 --context 262144 --concurrency 10 --budget 64\n"
               "  kdtree-jax serve --model builtin --method ddtree --budget 16 --max-batch 8 --port 8000\n"
               "  kdtree-jax bench-serve --url http://127.0.0.1:8000 --concurrency 1,2,4,8,10 --out results/\n")
    p.add_argument("--debug", action="store_true", help="on an error, show the traceback")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate a continuation of a prompt",
                       description="Generate a continuation of --prompt and print it as it comes, then a stats "
                                   "line: new_tokens, steps, tau (tokens per step), compile_s, wall_s (the run "
                                   "without compilation) and tokens_per_s = new_tokens / wall_s. Compilation comes "
                                   "first and is timed apart, for every method.")
    g.add_argument("--prompt", default=DEFAULT_PROMPT, type=_utf8_text,
                   help=f"the text to continue (default: {DEFAULT_PROMPT!r}, which the embedded model, trained on "
                        "the Python standard library, continues well)")
    g.add_argument("--method", choices=("ar", "chain", "ddtree"), default="ar",
                   help="ar: one token per step; chain: DFlash linear draft; ddtree: DDTree draft tree (default: ar)")
    g.add_argument("--budget", type=_budget, default=None,
                   help="with --method ddtree: draft tree nodes per step, or 'auto': chosen every step from a cost "
                        "model measured once for this setup (kept in ~/.cache/kdtree-jax/costs) (default: 64)")
    _auto_args(g)
    g.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most (default: 128)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    g.add_argument("--top-k", type=int, default=None,
                   help="with --temperature > 0: sample from the K most likely tokens only (default: all)")
    g.add_argument("--top-p", type=float, default=None,
                   help="with --temperature > 0: then from the most likely tokens holding P of the probability "
                        "(nucleus; default: 1, all)")
    _common(g)
    _compilation_cache_arg(g)

    b = sub.add_parser("bench", help="tokens/s and tau of ar, chain and ddtree side by side",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Time generate for each method on the same prompts (windows of held-out files of "
                                   "the Python standard library, encoded with the model's tokenizer), greedy. Each "
                                   "configuration is compiled and warmed up first (compile time reported apart), "
                                   "then timed --repeats times. Prints one row per method: tokens/s, speedup over "
                                   "ar, tau (tokens per target step), and whether the tokens equal ar's (they "
                                   "must: decoding is lossless).")
    b.add_argument("--methods", default="ar,chain,ddtree", help="comma-separated, from ar, chain, ddtree "
                                                                 "(default: all three; ar is always run)")
    b.add_argument("--budgets", default=None,
                   help="ddtree node budgets, comma-separated; 'auto' for budget='auto' (default: 16,64; with ddtree "
                        "in --methods only)")
    _auto_args(b)
    b.add_argument("--calibrate", action="store_true",
                   help="measure budget='auto''s cost model for --batch and --max-budget now (replacing a saved one), "
                        "save it where auto runs look for it, and print it; then run the benchmark")
    b.add_argument("--batch", type=int, default=1, help="prompts decoded together (default: 1)")
    b.add_argument("--prompt-len", type=int, default=128, help="tokens per prompt (default: 128)")
    b.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt (default: 128)")
    b.add_argument("--repeats", type=int, default=3, help="timed runs per configuration, after one warm-up "
                                                          "(default: 3; the median is reported)")
    b.add_argument("--json", default=None, metavar="PATH", help="also write the rows and the setup as JSON")
    _common(b)

    pl = sub.add_parser("plan", help="memory per GPU for a model, a mesh and a workload (no devices needed)",
                        description="Print what one GPU holds to serve --concurrency rows of --context tokens with "
                                    "DDTree --budget on --mesh, computed from shapes alone (the weights are not "
                                    "read and no device is used): the weights (sharded by the sharding rules; INT4 "
                                    "experts as packed words plus bf16 scales), the latent cache (replicated over "
                                    "ep x tp today, split over dp along the batch), an estimate of the largest "
                                    "activations of a verify step, a workspace margin of 8% of the GPU, what is "
                                    "free, and whether it fits; if not, the largest concurrency and the largest "
                                    "context that fit. Sizes in GB (1e9 bytes). Exit status: 0 fits, 1 does not "
                                    "fit, 2 bad input. See docs/plan.md.")
    pl.add_argument("--model", required=True, metavar="DIR|builtin|k2_6|tiny",
                    help="a checkpoint directory (its config.json, and its drafter's config when there is one) or a "
                         "preset: builtin (the embedded model and drafter), k2_6 (Kimi K2.6), tiny")
    pl.add_argument("--mesh", default="ep=1", metavar="AXES",
                    help="mesh shape, e.g. 'ep=8' or 'dp=2,ep=4,tp=2' (axes dp, ep, tp; absent axes are 1; no "
                         "devices needed). Default: one GPU")
    pl.add_argument("--context", type=int, required=True,
                    help="tokens per row: prompt plus generated tokens (e.g. 262144)")
    pl.add_argument("--concurrency", type=int, default=1, help="rows decoded together (default: 1)")
    pl.add_argument("--budget", type=int, default=64,
                    help="DDTree draft tree nodes per step, the verify step's tokens per row minus one (default: 64)")
    pl.add_argument("--hosts", type=int, default=1,
                    help="hosts the mesh spans, equal GPU counts (default: 1); checks that tp stays inside a host and "
                         "names the axes that cross hosts")
    pl.add_argument("--gpu-memory-gb", type=float, default=141.0,
                    help="memory of one GPU in GB (default: 141, an H200)")
    pl.add_argument("--json", action="store_true", help="print one JSON object instead of the table")

    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with continuous batching",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Serve the model over HTTP with OpenAI's API: POST /v1/completions and "
                                   "/v1/chat/completions (JSON, or server-sent events with \"stream\": true), GET "
                                   "/v1/models, /health and /metrics (Prometheus). Requests share --max-batch slots "
                                   "(rows of one KV cache): new requests are prefilled into free slots (together, in "
                                   "one call per padded prompt length) while the others keep decoding, --chunk-steps "
                                   "decoding steps run per compiled call, and a finished or disconnected request "
                                   "frees its slot at once. At temperature 0 each request gets exactly the tokens "
                                   "`generate` gives its prompt alone; a seeded sampled request gets the same tokens "
                                   "whatever else runs (with a fixed --budget; not with --budget auto).",
                       epilog="request fields: max_tokens, temperature (default 1; 0 = greedy), top_p, top_k, stop, "
                              "seed (fixes every\ntoken drawn), stream, ignore_eos, n, logprobs (chat: top_logprobs), "
                              "echo. Chat prompts use the\ncheckpoint's chat template, else one line 'role: content' "
                              "per message, then 'assistant:'.\n\n"
                              "examples:\n"
                              "  kdtree-jax serve --model builtin --method ddtree --budget 16 --port 8000\n"
                              "  kdtree-jax serve --model /ckpt/k2 --mesh ep=4,tp=2 --prefix-cache-gb 8 --port 8000\n"
                              "  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\\n"
                              "       -d '{\"model\": \"builtin\", \"prompt\": \"def fibonacci(n):\", "
                              "\"max_tokens\": 64, \"temperature\": 0}'")
    s.add_argument("--method", choices=("ar", "chain", "ddtree"), default="ddtree",
                   help="ar: one token per step; chain: DFlash linear draft; ddtree: DDTree draft tree (default)")
    s.add_argument("--budget", type=_budget, default=None,
                   help="with --method ddtree: draft tree nodes per step, or 'auto': chosen every step for the live "
                        "requests from a cost model measured once for --max-batch slots (saved, reused; greedy answers "
                        "unchanged, but a seeded sampled answer then depends on what else runs) (default: 64)")
    _auto_args(s)
    s.add_argument("--max-batch", type=int, default=8, help="slots: requests decoded together (default: 8)")
    s.add_argument("--max-context", type=int, default=None,
                   help="cache slots per request, a power of two >= 64: prompt + max_tokens (+ the draft tree) must "
                        "fit. Default: the model's context, at most 8192")
    s.add_argument("--max-queue", type=int, default=64,
                   help="requests waiting for a slot; past it requests get 429 (default: 64)")
    s.add_argument("--chunk-steps", type=int, default=4,
                   help="decoding steps per compiled call; new tokens are streamed after each (default: 4; budget "
                        "auto rounds it up to whole windows of the steps between its plans)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    s.add_argument("--port", type=_port, default=8000, help="TCP port, 1-65535 (default: 8000)")
    s.add_argument("--shutdown-timeout", type=_amount("seconds"), default=30.0, metavar="SECONDS",
                   help="on SIGTERM or Ctrl-C: new requests get 503 and those in flight get this long to finish; then "
                        "each still open ends with an error (a stream: an error event and [DONE]) and the server "
                        "exits with status 0. A second Ctrl-C stops at once (status 130). Default: 30")
    s.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model name requests must give (default: 'builtin', or the checkpoint directory's name)")
    s.add_argument("--prefix-cache-gb", type=_amount("GB"), default=0.0, metavar="GB",
                   help="keep prompts' cache rows, up to this many GB (across the mesh), for later prompts that begin "
                        "with the same tokens: those rows are copied instead of prefilled, the least recently used "
                        "dropped first (default: 0, none)")
    s.add_argument("--warmup", type=_warmup, default=(), metavar="LENGTHS",
                   help="before serving, compile the prefill of every admission size (1, 2, 4, ... slots) for prompts "
                        "of these lengths in tokens, comma-separated, or 'all': every length prompts are padded to "
                        "(powers of two up to --max-context), so that no request waits for a compilation; longer "
                        "start (default: none: each first compiles when a request needs it)")
    s.add_argument("--max-request-mb", type=_amount("MB"), default=16.0, metavar="MB",
                   help="the largest request body the server reads, in MB (10^6 bytes); a larger one gets a 413 "
                        "before it is read whole (default: 16)")
    s.add_argument("--max-n", type=int, default=8, metavar="N",
                   help="the most choices (n) one request may ask for, each decoded in its own slot (default: 8)")
    s.add_argument("--cache-sharding", choices=("replicated", "sequence"), default=None,
                   help="with --mesh: the latent cache on every model-parallel device (replicated) or split along "
                        "the sequence over them (sequence). Default: the model's setting")
    _common(s, hosts=False)
    _compilation_cache_arg(s)

    bs = sub.add_parser("bench-serve", help="a running server's tokens/s and time to first token by concurrency",
                        description="Send streamed greedy completions (ignore_eos: exactly --max-tokens each) to a "
                                    "running `kdtree-jax serve` from prompts of held-out standard-library files: at "
                                    "each concurrency c, c clients send --rounds requests each, back to back. Every "
                                    "prompt is sent once first (2 tokens) so that compilation is not timed. Prints "
                                    "and writes (JSON, Markdown, PNG) per concurrency: aggregate tok/s, per-request "
                                    "tok/s, time to first token p50/p99, tokens and wall seconds.")
    bs.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    bs.add_argument("--concurrency", default=None, help="comma-separated (default: 1,2,4,8,10)")
    bs.add_argument("--rounds", type=int, default=2, help="requests per client at each concurrency (default: 2)")
    bs.add_argument("--max-tokens", type=int, default=128, help="tokens per request (default: 128)")
    bs.add_argument("--prompt-chars", type=int, default=None, help="characters per prompt (default: 256)")
    bs.add_argument("--seed", type=int, default=0, help="prompt choice (default: 0)")
    bs.add_argument("--model", default=None, help="model name to request (default: the server's)")
    bs.add_argument("--out", default="bench_serve", metavar="DIR", help="output directory (default: bench_serve/)")
    bs.add_argument("--name", default="bench_serve", help="file name of the outputs, without extension")
    bs.add_argument("--shared-prefix", type=int, default=None, metavar="CHARS",
                    help="instead of the concurrency levels: the time to first token of prompts that begin with CHARS "
                         "characters of a held-out file, cold (a prefix the server has not seen) against warm (the "
                         "prefix of the request just before, another question after it), --rounds pairs, one request "
                         "at a time (a server with --prefix-cache-gb reuses the prefix)")
    bs.add_argument("--question-chars", type=int, default=None,
                    help="with --shared-prefix: characters of the question after the prefix (default: 50)")
    for sp in sub.choices.values():  # also after the subcommand: `kdtree-jax generate ... --debug`
        sp.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="on an error, show the traceback")
    return p


def _port(text: str) -> int:
    """--port: a TCP port, 1..65535."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 1-65535, got {port}")
    return port


def _amount(unit: str):
    """An argparse type: a finite number of `unit` >= 0 (--prefix-cache-gb, --shutdown-timeout)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number of {unit}, got {text!r}") from None
        if not 0 <= value < float("inf"):
            raise argparse.ArgumentTypeError(f"expected a finite number of {unit} >= 0, got {text!r}")
        return value

    return parse


def _check_listen(host: str, port: int) -> None:
    """Open a server on host:port as the HTTP server will (asyncio's create_server: every address the host resolves
    to) and close it at once, so that a taken port or a bad host fails in a line before the model is loaded and
    compiled (minutes for a large one), not after."""
    import asyncio
    import socket

    if not host.strip():  # asyncio reads an empty host as every interface: say so instead of doing it quietly
        raise ValueError("--host must not be empty (the default 127.0.0.1 serves this machine only; give 0.0.0.0 to "
                         "serve every interface)")

    async def probe():
        server = await asyncio.get_running_loop().create_server(asyncio.Protocol, host=host, port=port)
        server.close()
        await server.wait_closed()

    try:
        asyncio.run(probe())
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r}: {e.strerror or e}") from None
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port} (--host, --port): {e.strerror or e}") from None


def _probe_folder(folder: str, what: str) -> None:
    """Create and delete a file in `folder`, the one sure test that it can be written (permission bits say nothing
    for root, or for /proc)."""
    import tempfile

    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".kdtree-probe-"):
            pass
    except OSError as e:
        raise ValueError(f"{what}: cannot write in {folder} ({e.strerror or e})") from None


def _check_output_file(path: str, flag: str) -> None:
    """Fail before the work, not after it, where `path` (a file to write) cannot be written: its folder must exist
    and be writable, and the path must not be a folder."""
    if not path.strip():  # `if args.json:` took '' as no file: the run ended without writing one, without a word
        raise ValueError(f"{flag} {path!r}: expected a file name")
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path}: is a directory; give a file name")
    if not os.path.isdir(folder):
        raise ValueError(f"{flag} {path}: the folder {folder} does not exist")
    _probe_folder(folder, f"{flag} {path}")


def _check_output_dir(path: str, flag: str) -> None:
    """The same for a folder that will be created if missing: it must be a folder, or creatable in a writable one
    (not '', which os.path.abspath makes the working directory)."""
    if not path.strip():
        raise ValueError(f"{flag} {path!r}: expected a directory")
    path = os.path.abspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{flag} {path}: exists and is not a directory")
    parent = path
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ValueError(f"{flag} {path}: {parent} is not a directory")
    _probe_folder(parent, f"{flag} {path}")


def _budget(text: str):
    """--budget: a node count, or 'auto'."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {text!r}") from None


def _integers(text: str, least: int, what: str, expected: str = "comma-separated integers") -> tuple[int, ...]:
    """Comma-separated integers >= least (an argparse type's body: errors are ArgumentTypeError)."""
    try:
        values = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if any(v < least for v in values):
        raise argparse.ArgumentTypeError(f"{what} must be >= {least}, got {text!r}")
    return values


def _warmup(text: str) -> tuple[int, ...] | str:
    """--warmup: 'all', or comma-separated prompt lengths >= 1."""
    return text if text == "all" else _integers(text, 1, "prompt lengths", "'all' or comma-separated integers")


def _model_dir(text: str) -> str:
    """--model: not empty (a path that os.path.abspath would make the working directory)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a checkpoint directory or 'builtin', got {text!r}")
    return text


def _utf8_text(text: str) -> str:
    """--prompt: text that is UTF-8 (argv bytes that are not arrive as lone surrogates, which no tokenizer takes), and
    not empty (no token to continue from: refused here, before the model is loaded)."""
    if not text:
        raise argparse.ArgumentTypeError("expected the text to continue, got '' (leave --prompt out for the default)")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raw = text[e.start:e.end].encode("utf-8", "surrogateescape")
        raise argparse.ArgumentTypeError(f"not UTF-8 text: byte {raw[:1].hex(' ')} at character {e.start} (pass the "
                                         "text in UTF-8)") from None
    return text


def _tiers(text: str) -> tuple[int, ...]:
    """--tiers: comma-separated integers >= 0."""
    tiers = _integers(text, 0, "tiers")
    twice = sorted({t for t in tiers if tiers.count(t) > 1})
    if twice:
        raise argparse.ArgumentTypeError(f"each tier once: {', '.join(map(str, twice))} given more than once in "
                                         f"{text!r}")
    return tiers


def _auto_args(g: argparse.ArgumentParser) -> None:
    g.add_argument("--max-budget", type=int, default=None,
                   help="budget auto: the largest tree; tiers of max/16, max/8, max/4, max/2 and max nodes (those "
                        ">= 4) are compiled (default: 64)")
    g.add_argument("--cost-model", default=None, metavar="PATH",
                   help="budget auto: use this saved cost model (JSON) instead of the one kept for this setup")
    g.add_argument("--tiers", type=_tiers, default=None, metavar="N,N,...",
                   help="budget auto: the tree sizes compiled, comma-separated, the largest equal to --max-budget "
                        "(default: max/16 .. max as above); 0 adds autoregressive steps: between plans nothing is "
                        "drafted, for where no tree pays (a cost model is measured per set of tiers)")


def _check_auto_flags(args, auto: bool) -> None:
    """--max-budget, --tiers and --cost-model shape budget auto alone: refuse them without it (they would be ignored)
    and fill in --max-budget's default."""
    given = [f"--{n.replace('_', '-')}" for n in ("max_budget", "tiers", "cost_model") if getattr(args, n) is not None]
    if given and not auto:
        them = "them" if len(given) > 1 else "it"
        raise ValueError(f"{', '.join(given)}: for --budget auto only (add it, or drop {them})")
    if args.max_budget is None:
        args.max_budget = 64


def _check_auto_values(args, batch: int, read: bool = True) -> None:
    """--max-budget, --tiers and (with `read`) the --cost-model to read, by budget auto's rules, before the model is
    loaded: the file must be a cost model (`budget.load`), of `batch` rows and of this run's tiers (`budget.resolve`
    checks the same once the model is loaded, minutes later for a large one)."""
    from . import budget, validate

    if args.max_budget < 1:
        raise ValueError(f"--max-budget must be at least 1, got {args.max_budget}")
    if args.tiers is not None and max(args.tiers) != args.max_budget:  # (_tiers checked the rest)
        raise ValueError(f"--tiers {','.join(map(str, args.tiers))}: the largest tier must equal --max-budget "
                         f"({args.max_budget})")
    if not read or args.cost_model is None:
        return
    why = validate.path_problem(args.cost_model)
    if why is not None:
        why = "no such file" if why == "is missing" else why
        raise ValueError(f"--cost-model {args.cost_model}: {why} (a cost model saved by "
                         "`kdtree-jax bench --calibrate`; leave it out to use, or measure, the one kept for this "
                         "setup)")
    cost, _ = budget.load(args.cost_model)  # a ValueError naming the file
    budget.check_matches(cost, batch, budget.default_tiers(args.max_budget) if args.tiers is None
                         else budget.check_tiers(args.tiers, args.max_budget), args.max_budget)


def _check_decoding(args, sampling: bool) -> None:
    """generate's and serve's decoding flags, checked before the model is loaded (minutes for a large one) by the
    rules that generate and the serving engine apply (`kdtree_jax.validate`, with their messages), and the flags
    that would be ignored refused: --budget without --method ddtree, the budget auto flags without --budget auto
    and, with `sampling` (generate's flags), --top-k and --top-p at temperature 0. Fills in the budgets' defaults."""
    from . import validate

    if args.budget is not None and args.method != "ddtree":
        raise ValueError(f"--budget: for --method ddtree only (--method {args.method} drafts no tree; add --method "
                         "ddtree, or drop --budget)")
    if args.budget is None:
        args.budget = 64
    elif args.budget != "auto" and args.budget < 1:
        raise ValueError(f"--budget must be at least 1 (or 'auto'), got {args.budget}")
    _check_auto_flags(args, args.budget == "auto")
    if args.budget == "auto":  # generate decodes one prompt; serve's cost model is the one for --max-batch rows
        _check_auto_values(args, getattr(args, "max_batch", 1))
    if not sampling:
        return
    validate.integer("max_new_tokens", args.max_new_tokens, 1, validate.INT32_LIMIT)
    validate.temperature(args.temperature)
    validate.top_k(args.top_k)
    validate.top_p(args.top_p)
    given = [flag for flag, value in (("--top-k", args.top_k), ("--top-p", args.top_p)) if value is not None]
    if given and args.temperature == 0:
        raise ValueError(f"{', '.join(given)}: for --temperature > 0 only (at 0, greedy decoding takes the most likely "
                         f"token; add a temperature, or drop {'them' if len(given) > 1 else 'it'})")


def _check_serving(args) -> None:
    """serve's flags, checked before the model is loaded (the engine checks them again, after it)."""
    from kdtree_jax.serving.engine import DEFAULT_MAX_CONTEXT

    _check_decoding(args, sampling=False)
    for name in ("max_batch", "max_queue", "chunk_steps", "max_n"):
        if not 1 <= getattr(args, name) <= INT32_MAX:  # the engine keeps them in int32 columns and loop bounds
            raise ValueError(f"--{name.replace('_', '-')} must be in 1..{INT32_MAX}, got {getattr(args, name)}")
    if args.max_context is not None and (args.max_context < 64 or args.max_context & (args.max_context - 1)):
        raise ValueError(f"--max-context must be a power of two >= 64, got {args.max_context}")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise ValueError("--served-model-name must not be empty (requests name the model they ask for)")
    if args.cache_sharding is not None and args.mesh is None:
        raise ValueError("--cache-sharding lays the cache out over --mesh: give a mesh too")
    if args.max_request_mb * 1e6 < 1:
        raise ValueError(f"--max-request-mb must allow at least one byte, got {args.max_request_mb:g}")
    for flag, value, unit in (("--prefix-cache-gb", args.prefix_cache_gb, 1e9),
                              ("--max-request-mb", args.max_request_mb, 1e6)):
        if value * unit >= 2**63:  # counted in bytes (1e300 GB was inf bytes: an OverflowError once the model loaded)
            raise ValueError(f"{flag} must be below {2**63 / unit:.3g} (2**63 bytes), got {value:g}")
    if args.warmup and args.warmup != "all" and args.max_context is not None and max(args.warmup) >= args.max_context:
        raise ValueError(f"--warmup {max(args.warmup)}: a prompt must be shorter than --max-context "
                         f"{args.max_context}")
    if args.warmup and args.warmup != "all" and args.max_context is None and max(args.warmup) >= DEFAULT_MAX_CONTEXT:
        raise ValueError(f"--warmup {max(args.warmup)}: a prompt must be shorter than the context, at most "
                         f"{DEFAULT_MAX_CONTEXT} tokens without --max-context")


def _check_hosts_flags(args) -> None:
    """--coordinator, --num-processes and --process-id: all three or none, the id in range."""
    given = {f"--{n.replace('_', '-')}": getattr(args, n) for n in ("coordinator", "num_processes", "process_id")}
    missing = [flag for flag, value in given.items() if value is None]
    if missing:
        raise ValueError(f"{', '.join(missing)} missing: a multi-host run takes --coordinator, --num-processes and "
                         "--process-id together")
    host, _, port = args.coordinator.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--coordinator {args.coordinator!r}: expected HOST:PORT, the port 1-65535 (process 0 "
                         "listens there)")
    if args.num_processes < 1:
        raise ValueError(f"--num-processes must be at least 1, got {args.num_processes}")
    if not 0 <= args.process_id < args.num_processes:
        raise ValueError(f"--process-id must be in 0..{args.num_processes - 1} (--num-processes "
                         f"{args.num_processes}), got {args.process_id}")


def _common(g: argparse.ArgumentParser, hosts: bool = True) -> None:
    """--model, --seed, --mesh, --kernels, --ffi-ops and (with hosts) the multi-host flags."""
    g.add_argument("--model", default=None, type=_model_dir,
                   help="a converted checkpoint directory (kdtree-convert), or 'builtin'. Default: the embedded "
                        "model shipped in the package (else a random tiny model with a byte tokenizer)")
    g.add_argument("--seed", type=_seed, default=0,
                   help="sampling, prompt-choice and random-model seed, in [0, 2**63) (default: 0)")
    g.add_argument("--mesh", default=None, metavar="AXES",
                   help="shard over the local devices, e.g. 'tp=8' or 'ep=4,tp=2' or 'dp=2,ep=4' (axes dp, ep, tp; "
                        "their product must equal the device count). Default: one device")
    g.add_argument("--kernels", choices=("xla", "ffi"), default=None,
                   help="custom calls (ffi) or their pure-JAX references (xla). Default: the model's setting")
    g.add_argument("--ffi-ops", default=None, metavar="OPS",
                   help="with custom calls, only these (comma-separated, from tree_build, tree_accept, mla_verify, "
                        "marlin_moe, moe_route, move_rows, mla_pre, fused_dot, draft_attention; the rest in "
                        "pure JAX), "
                        "e.g. 'tree_build,tree_accept' for "
                        "a small fp32 model whose attention and experts are off the CUDA fast paths. Default: all "
                        "but fused_dot (a layer's dense weights with their norms and residual adds in four "
                        "launches: no faster in the step so far). Implies --kernels ffi")
    if not hosts:
        return
    g.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="several hosts: the address process 0 listens on; give --num-processes and --process-id too, "
                        "run the same command on every host (the mesh then spans every host's devices; only process "
                        "0 prints)")
    g.add_argument("--num-processes", type=int, default=None, metavar="N", help="several hosts: how many processes")
    g.add_argument("--process-id", type=int, default=None, metavar="I", help="several hosts: this process, 0..N-1")


def _compilation_cache_arg(g: argparse.ArgumentParser) -> None:
    g.add_argument("--no-compilation-cache", action="store_true",
                   help="do not keep compiled programs across runs (default: kept in ~/.cache/kdtree-jax/jax, or "
                        "$KDTREE_JAX_COMPILATION_CACHE, so that a restart does not compile again; that variable set "
                        "to 'off' turns it off too)")


def compilation_cache_dir() -> str | None:
    """Where compiled programs are kept across runs: $KDTREE_JAX_COMPILATION_CACHE ('off': nowhere), else
    kdtree-jax/jax in the user cache directory ($XDG_CACHE_HOME, else ~/.cache)."""
    chosen = os.environ.get("KDTREE_JAX_COMPILATION_CACHE")
    if chosen:
        return None if chosen == "off" else chosen
    from kdtree_jax.config import user_cache_dir

    return user_cache_dir("jax")


def _use_compilation_cache(args) -> None:
    """Turn JAX's persistent compilation cache on, unless --no-compilation-cache or the variable says off."""
    path = compilation_cache_dir()
    if args.no_compilation_cache or path is None:
        return
    import jax

    jax.config.update("jax_compilation_cache_dir", path)


def _seed(text: str) -> int:
    """--seed: an integer in [0, 2**63), the API's and the server's rule (validate.seed)."""
    try:
        seed = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 0 <= seed < 2**63:
        raise argparse.ArgumentTypeError(f"{seed} is outside [0, 2**63) (the seed is an int64)")
    return seed


def _load(args, need_drafter: bool):
    """(params, cfg, tokenizer, drafter, note), with --kernels applied and the params sharded over --mesh."""
    import dataclasses

    params, cfg, tok, drafter, note = _read_model(args, need_drafter)
    if args.kernels is not None:
        cfg = dataclasses.replace(cfg, kernels=args.kernels)
    if args.ffi_ops is not None:
        if args.kernels == "xla":
            raise ValueError("--ffi-ops selects custom calls; it cannot go with --kernels xla")
        cfg = dataclasses.replace(cfg, kernels="ffi", ffi_ops=tuple(o.strip() for o in args.ffi_ops.split(",")))
    if args.mesh is not None:
        import kdtree_jax as kj
        from kdtree_jax.drafter import shard_drafter

        mesh = kj.make_mesh(**parse_mesh(args.mesh))
        params = kj.shard_params(params, cfg, mesh)
        if drafter is not None:
            drafter = shard_drafter(drafter, mesh)
        note += f"; sharded over {dict(mesh.shape)}"
    print(f"[kdtree-jax] {note}", file=sys.stderr)
    return params, cfg, tok, drafter


def _read_model(args, need_drafter: bool):
    import jax

    import kdtree_jax as kj
    from kdtree_jax import builtin
    from kdtree_jax.tokenizer import ByteTokenizer

    if args.model is not None:
        model = builtin.load_builtin() if args.model == "builtin" else kj.load(args.model)
        note = f"model {args.model}"
        if args.model != "builtin" and isinstance(model.tokenizer, ByteTokenizer):
            note += " (no tiktoken.model in it: a byte tokenizer assumed, token i = byte i)"
        return model.params, model.cfg, model.tokenizer, model.drafter, note
    if builtin.available():
        model = builtin.load_builtin()
        return (model.params, model.cfg, model.tokenizer, model.drafter,
                "the embedded model (4M parameters, trained on the Python standard library, byte tokens)")
    cfg = kj.configs.tiny()
    params = kj.init_params(cfg, jax.random.key(args.seed))
    drafter = None
    if need_drafter:
        drafter = kj.init_drafter(cfg, jax.random.key((args.seed + 1) % 2**63), num_layers=1, block_size=8)
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
    _check_decoding(args, sampling=True)
    _use_compilation_cache(args)
    params, cfg, tok, drafter = _load(args, need_drafter=args.method != "ar")
    _need_drafter(args, drafter)
    ids = tok.encode(args.prompt)
    _check_room(cfg, f"--max-new-tokens {args.max_new_tokens}: the prompt's {len(ids)} tokens",
                len(ids), args.max_new_tokens, _extra_slots(cfg, args.method, drafter, args))
    stats = _stream(params, cfg, tok, drafter, ids, args)
    print()
    print(stats_line(stats))
    return 0


def _extra_slots(cfg, method: str, drafter, args, budget=None) -> int:
    """The cache slots `method` needs past the last token (the speculative tree's nodes; budget auto: the largest
    tree's), as generate counts them (`Method.extra_slots`)."""
    from kdtree_jax.generate import make_method

    budget = args.budget if budget is None else budget
    return make_method(cfg, method, drafter, args.max_budget if budget == "auto" else budget).extra_slots


def _check_room(cfg, what: str, prompt: int, new: int, extra: int) -> None:
    """A prompt of `prompt` tokens, `new` tokens and `extra` speculative slots must fit the model's context: checked
    before a compile line or a timed run (generate checks the same once it is called: after the compile line, and in
    bench after the methods before it had been timed)."""
    need = prompt + new + extra
    if need > cfg.max_position_embeddings:
        raise ValueError(f"{what} + {new}" + (f" + {extra} speculative slots" if extra else "") + f" = {need} "
                         f"exceed the model's context of {cfg.max_position_embeddings} positions")


def _log(text: str) -> None:
    print(f"[kdtree-jax] {text}", file=sys.stderr, flush=True)


def _stream(params, cfg, tok, drafter, ids: list[int], args) -> dict:
    """Stream the text as the method decodes it and return `generate`'s stats. Compilation comes first, apart: a
    throwaway run of the first two chunks compiles the prefill and the decoding loop (compile_s includes that short
    run), so wall_s and tokens_per_s time the streamed run alone, as `generate` does."""
    from kdtree_jax.decoding import step_stats
    from kdtree_jax.generate import stream

    def chunks():
        return stream(params, cfg, ids, max_new_tokens=args.max_new_tokens, method=args.method, drafter=drafter,
                      budget=args.budget, max_budget=args.max_budget, cost_model=args.cost_model, tiers=args.tiers,
                      temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                      seed=args.seed, eos_id=tok.eos_id)

    _log(f"compiling {args.method} ...")
    t0 = time.perf_counter()
    warm = chunks()
    if next(warm, []):  # the inputs are checked here: a prompt that is refused is not echoed
        next(warm, None)
    warm.close()
    t1 = time.perf_counter()
    _log(f"compiled in {t1 - t0:.1f} s")
    new = []
    sys.stdout.write(args.prompt)
    run = chunks()
    while True:
        try:
            chunk = next(run)
        except StopIteration as end:
            final = end.value
            break
        before = tok.decode(new)
        new += chunk
        sys.stdout.write(tok.decode(new)[len(before):])
        sys.stdout.flush()
    wall = time.perf_counter() - t1
    return {**step_stats(final), "compile_s": t1 - t0, "wall_s": wall, "method": args.method,
            "budget": args.budget if args.method == "ddtree" else None, "new_tokens": len(new),
            "tokens_per_s": len(new) / wall}


def stats_line(stats: dict) -> str:
    """One line of `generate`'s stats; tokens_per_s = new_tokens / wall_s, compilation excluded for every method."""
    line = (f"[stats] method={stats['method']} new_tokens={stats['new_tokens']} steps={stats['steps']} "
            f"tau={stats['tau']:.2f} compile_s={stats['compile_s']:.2f} wall_s={stats['wall_s']:.3f} "
            f"tokens_per_s={stats['tokens_per_s']:.1f}")
    if stats["method"] != "ar":
        line += f" tau_histogram={','.join(map(str, stats['tau_histogram']))}"
    if stats["method"] == "ddtree":
        line += f" budget={stats['budget']} nodes={stats['nodes']:.1f}"
    return line


def _bench_prompts(tok, batch: int, length: int, seed: int) -> list[list[int]]:
    """`batch` windows of `length` tokens from the held-out standard-library files, in the model's tokenizer."""
    import numpy as np

    from kdtree_jax.corpus import corpus_split, windows

    _, held = corpus_split()
    ids = []
    for path in held:
        ids += tok.encode(path.read_text(errors="replace"))
        if len(ids) > 50 * length * batch:
            break
    if len(ids) <= length:
        raise ValueError(f"--prompt-len {length}: the held-out text has only {len(ids)} tokens")
    if batch * length > len(ids):  # (windows of it, which a batch past it would not fit in memory either)
        raise ValueError(f"--batch {batch} x --prompt-len {length}: {batch * length} prompt tokens, more than the "
                         f"{len(ids)} of the held-out text they are drawn from")
    return windows(np.asarray(ids, np.int32), np.random.default_rng(seed), batch, length).tolist()


def bench_command(args) -> int:
    import json
    import statistics

    import jax

    import kdtree_jax as kj
    from kdtree_jax import validate
    from kdtree_jax.generate import make_method

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in ("ar", "chain", "ddtree")]
    if not methods:
        raise ValueError("--methods: give at least one of ar, chain, ddtree")
    if bad:
        raise ValueError(f"--methods: unknown method(s) {bad}; choose from ar, chain, ddtree")
    if args.budgets is not None and "ddtree" not in methods:
        raise ValueError(f"--budgets: for ddtree only (--methods {args.methods} drafts no tree; add ddtree to "
                         "--methods, or drop --budgets)")
    try:
        budgets = ([_budget(b.strip()) for b in ("16,64" if args.budgets is None else args.budgets).split(",")]
                   if "ddtree" in methods else [])
    except argparse.ArgumentTypeError:
        raise ValueError(f"--budgets {args.budgets!r}: expected comma-separated integers or 'auto'") from None
    if any(b != "auto" and b < 1 for b in budgets):
        raise ValueError(f"--budgets {args.budgets!r}: every budget must be at least 1")
    for name in ("batch", "prompt_len", "max_new_tokens", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    validate.integer("max_new_tokens", args.max_new_tokens, 1, validate.INT32_LIMIT)  # generate's rule, as generate's
    _check_auto_flags(args, "auto" in budgets or args.calibrate)
    if "auto" in budgets or args.calibrate:  # (--calibrate writes --cost-model: checked below)
        _check_auto_values(args, args.batch, read=not args.calibrate)
    if args.json is not None:
        _check_output_file(args.json, "--json")
    if args.calibrate and args.cost_model is not None:  # its folder is created if missing (budget.save)
        if not args.cost_model.strip():  # '' was taken as no --cost-model: saved where auto runs look, unsaid
            raise ValueError(f"--cost-model {args.cost_model!r}: expected a file name (or leave it out)")
        if os.path.isdir(args.cost_model):
            raise ValueError(f"--cost-model {args.cost_model}: is a directory; give a file name")
        _check_output_dir(os.path.dirname(os.path.abspath(args.cost_model)), "--cost-model's folder")
    params, cfg, tok, drafter = _load(args, need_drafter=methods != ["ar"])
    if methods != ["ar"] and drafter is None:
        raise ValueError("chain and ddtree need a drafter; this model has none (convert one with --drafter)")
    for b in budgets:  # a tree the drafter cannot fill: refused before ar and chain are timed, not after
        make_method(cfg, "ddtree", drafter, args.max_budget if b == "auto" else b)
    configs = [("ar", 1)] + [("chain", 1)] * ("chain" in methods) + [("ddtree", b) for b in budgets]
    for method, budget in configs:  # every run's prompt, tokens and tree must fit: before ar is timed, not after
        run = f"{method}, budget {budget}" if method == "ddtree" else method
        _check_room(cfg, f"--prompt-len {args.prompt_len} and --max-new-tokens {args.max_new_tokens} ({run}): "
                         f"{args.prompt_len} prompt tokens", args.prompt_len, args.max_new_tokens,
                    _extra_slots(cfg, method, drafter, args, budget))
    prompts = _bench_prompts(tok, args.batch, args.prompt_len, args.seed)
    if args.calibrate:
        _calibrate(params, cfg, drafter, args)
    rows, ar_tokens = [], None
    print(f"{'method':8s} {'budget':>6s} {'tokens/s':>10s} {'vs ar':>6s} {'tau':>5s} {'= ar':>5s} {'compile':>8s}")
    for method, budget in configs:
        auto = dict(cost_model=args.cost_model, tiers=args.tiers) if budget == "auto" else {}  # auto's alone
        run = lambda: kj.generate(params, cfg, prompts, max_new_tokens=args.max_new_tokens, method=method,
                                  drafter=drafter, budget=budget, max_budget=args.max_budget, **auto)
        first = run()
        outs = [run() for _ in range(args.repeats)]
        wall = statistics.median(o.stats["wall_s"] for o in outs)
        tokens = outs[0].tokens
        ar_tokens = tokens if method == "ar" else ar_tokens
        row = dict(method=method, budget=budget if method == "ddtree" else None,
                   tokens_per_s=sum(len(t) for t in tokens) / wall, wall_s=wall, tau=outs[0].stats["tau"],
                   steps=outs[0].stats["steps"], nodes=outs[0].stats["nodes"], equal_ar=tokens == ar_tokens,
                   compile_s=first.stats.get("compile_s"))
        row["speedup_vs_ar"] = row["tokens_per_s"] / rows[0]["tokens_per_s"] if rows else 1.0
        rows.append(row)
        comp = f"{row['compile_s']:.1f}s" if row["compile_s"] is not None else "-"
        print(f"{method:8s} {str(row['budget'] or '-'):>6s} {row['tokens_per_s']:10.1f} {row['speedup_vs_ar']:5.2f}x "
              f"{row['tau']:5.2f} {str(row['equal_ar']):>5s} {comp:>8s}", flush=True)
    if args.json is not None:
        setup = dict(model=args.model or "builtin", batch=args.batch, prompt_len=args.prompt_len,
                     max_new_tokens=args.max_new_tokens, repeats=args.repeats, mesh=args.mesh, kernels=cfg.kernels,
                     device=str(jax.devices()[0].device_kind), devices=jax.device_count(), jax=jax.__version__)
        with open(args.json, "w") as f:
            json.dump(dict(setup=setup, rows=rows), f, indent=1)
    if not all(r["equal_ar"] for r in rows):
        print("kdtree-jax: warning: some speculative tokens differ from ar's (see the '= ar' column)", file=sys.stderr)
    return 0


def _calibrate(params, cfg, drafter, args) -> None:
    """bench --calibrate: measure budget='auto''s cost model for this setup, save it (--cost-model, else where auto
    runs look for it) and print it."""
    from kdtree_jax import budget
    from kdtree_jax.sharding import trace_context

    if drafter is None:
        raise ValueError("--calibrate measures ddtree's steps and needs a drafter; this model has none")
    tiers = budget.check_tiers(budget.default_tiers(args.max_budget) if args.tiers is None else args.tiers,
                               args.max_budget)
    with trace_context(params, cfg):
        path = args.cost_model or budget.cost_path(budget.setup_key(cfg, drafter, args.batch, tiers))
    cost, meta = budget.calibrate(params, cfg, drafter, batch=args.batch, max_budget=args.max_budget, tiers=tiers,
                                  log=_log)
    budget.save(cost, path, meta)
    _log(f"cost model saved to {path}")
    for size, pts in zip(cost.tiers, cost.points()):
        print(f"tier {size:4d}: " + "  ".join(f"{m:.0f} tok {1e3 * t:.2f} ms" for m, t in pts), flush=True)


def plan_command(args) -> int:
    import json

    from kdtree_jax import plan

    if args.hosts < 1:
        raise ValueError(f"--hosts must be a positive integer, got {args.hosts}")
    cfg, dcfg, description = plan.load_config(args.model)
    p = plan.plan(cfg, dcfg, parse_mesh(args.mesh), args.context, args.concurrency, args.budget,
                  args.gpu_memory_gb * plan.GB, model=f"{args.model} ({description})")
    report = plan.report(cfg, dcfg, p)
    report["hosts"] = plan.check_hosts(p.mesh, args.hosts)
    text = plan.format_report(report)
    if args.hosts > 1:
        h = report["hosts"]
        text += (f"\nhosts: {h['hosts']} x {h['gpus_per_host']} GPUs (per-GPU memory as above); mesh axes crossing "
                 f"hosts: {', '.join(h['crossing']) or 'none'} (tp stays inside a host; each layer's all-reduces "
                 "span every model-parallel GPU, so they cross hosts whenever ep does)")
    print(json.dumps(report, indent=1) if args.json else text)
    return 0 if p.fits else 1


def _need_drafter(args, drafter) -> None:
    if args.method != "ar" and drafter is None:
        raise ValueError(f"--method {args.method} needs a drafter and this model has none (use --method ar, or "
                         "convert one with --drafter)")


def serve_command(args) -> int:
    try:
        from kdtree_jax.serving import serve
    except ImportError as e:
        raise ValueError(f"kdtree-jax serve needs the serve extra: pip install 'kdtree-jax[serve]' ({e})") from None
    from kdtree_jax.serving.engine import DEFAULT_MAX_CONTEXT, Engine

    _check_serving(args)
    _check_listen(args.host, args.port)
    _use_compilation_cache(args)
    checkpoint = args.model if args.model not in (None, "builtin") else None
    template = serve.load_chat_template(checkpoint)  # a broken template file: refused before loading the model
    params, cfg, tok, drafter = _load(args, need_drafter=args.method != "ar")
    _need_drafter(args, drafter)
    if args.max_context is not None and args.max_context > cfg.max_position_embeddings:
        raise ValueError(f"--max-context {args.max_context} exceeds the model's context of "
                         f"{cfg.max_position_embeddings} positions")
    context = args.max_context or min(cfg.max_position_embeddings, DEFAULT_MAX_CONTEXT)  # (the Engine's)
    if args.warmup and args.warmup != "all" and max(args.warmup) >= context:  # (with --max-context: refused above)
        raise ValueError(f"--warmup {max(args.warmup)}: a prompt must be shorter than the context, {context} tokens "
                         f"(the model's {cfg.max_position_embeddings} positions, at most {DEFAULT_MAX_CONTEXT} without "
                         "--max-context)")
    if args.cache_sharding is not None:
        import dataclasses

        cfg = dataclasses.replace(cfg, cache_sharding=args.cache_sharding)
    name = args.served_model_name or (os.path.basename(os.path.normpath(checkpoint)) if checkpoint else "builtin")
    if args.warmup:
        _log(f"compiling the prefills of every admission size for {args.max_batch} slots and prompts of "
             f"{'every padded length' if args.warmup == 'all' else ', '.join(map(str, args.warmup)) + ' tokens'} "
             "(--warmup) ...")
    t0 = time.perf_counter()
    with Engine(params, cfg, method=args.method, drafter=drafter, budget=args.budget, max_budget=args.max_budget,
                tiers=args.tiers, cost_model=args.cost_model, max_batch=args.max_batch, max_context=args.max_context,
                max_queue=args.max_queue, chunk_steps=args.chunk_steps, eos_id=tok.eos_id, seed=args.seed,
                warmup=args.warmup, prefix_cache_bytes=int(args.prefix_cache_gb * 1e9)) as engine:
        if args.warmup:
            _log(f"warm-up compiled in {time.perf_counter() - t0:.1f} s")
        what = f"{args.method} (budget {engine.budget})" if args.method == "ddtree" else args.method
        if engine.chunk_steps != args.chunk_steps:
            _log(f"--chunk-steps {args.chunk_steps} rounded up to {engine.chunk_steps}: whole windows of the "
                 f"{engine.describe()['replan']} steps from one plan of budget auto to the next")
        _log(f"compiling {what} for {args.max_batch} slots of {engine.max_context} tokens (warm-up requests: "
             "greedy, sampled, sampled with top-k) ...")
        t0 = time.perf_counter()
        for sampling in (dict(temperature=0.0), dict(temperature=1.0), dict(temperature=1.0, top_k=40)):
            engine.complete(tok.encode("def"), max_tokens=2, **sampling)  # each sampler form's program
        _log(f"compiled in {time.perf_counter() - t0:.1f} s; serving {name!r} on http://{args.host}:{args.port}")
        app = serve.create_app(engine, tok, name, template, max_n=args.max_n,
                               max_body_bytes=int(args.max_request_mb * 1e6))
        serve.run(app, args.host, args.port, shutdown_timeout=args.shutdown_timeout, log_line=_log)
    return 0


def bench_serve_command(args) -> int:
    from kdtree_jax.serving import bench_serve

    # the flags of the other mode would be ignored: refused (--shared-prefix 0 ran the concurrency levels)
    shared = args.shared_prefix is not None
    flags = (("--concurrency", args.concurrency, False), ("--prompt-chars", args.prompt_chars, False),
             ("--question-chars", args.question_chars, True))  # (flag, value, whether --shared-prefix's)
    other = [f for f, v, mine in flags if v is not None and mine != shared]
    if other:
        raise ValueError(f"{other[0]}: " + ("for the concurrency levels, not with --shared-prefix (one request at a "
                                            "time), drop it" if shared else "with --shared-prefix only (add it, or "
                                            "drop this)"))
    concurrency = "1,2,4,8,10" if args.concurrency is None else args.concurrency
    try:
        levels = [int(c) for c in concurrency.split(",")]
    except ValueError:
        raise ValueError(f"--concurrency {concurrency!r}: expected comma-separated integers") from None
    prompt_chars = 256 if args.prompt_chars is None else args.prompt_chars
    question_chars = 50 if args.question_chars is None else args.question_chars
    for name, value in (("concurrency", min(levels)), ("rounds", args.rounds), ("max-tokens", args.max_tokens),
                        ("prompt-chars", prompt_chars), ("question-chars", question_chars),
                        ("shared-prefix", 1 if args.shared_prefix is None else args.shared_prefix)):
        if value < 1:
            raise ValueError(f"--{name} must be at least 1, got {value}")
    longest = bench_serve.longest_prompt_chars()  # prompts are cut from held-out files more than twice as long
    for name, value in (("shared-prefix", args.shared_prefix), ("question-chars", question_chars if shared else None),
                        ("prompt-chars", None if shared else prompt_chars)):
        if value is not None and value > longest:
            raise ValueError(f"--{name} {value}: prompts are cut from held-out files more than twice as long; the "
                             f"longest allows {longest} characters")
    if not 0 <= args.seed < 2**63:
        raise ValueError(f"--seed must be in 0..2**63 - 1, got {args.seed}")
    if args.name.strip() in ("", ".", "..") or any(sep and sep in args.name for sep in (os.sep, os.altsep)):
        raise ValueError(f"--name {args.name!r}: expected a file name without a folder (the outputs go in --out as "
                         "NAME.json, NAME.md, NAME.png)")
    _check_output_dir(args.out, "--out")
    import httpx

    log = lambda line: print(line, flush=True)
    try:
        if shared:
            result = bench_serve.prefix_ttft(args.url, prefix_chars=args.shared_prefix,
                                             question_chars=question_chars, rounds=args.rounds,
                                             max_tokens=args.max_tokens, seed=args.seed, model=args.model, log=log)
        else:
            result = bench_serve.run(args.url, levels, rounds=args.rounds, max_tokens=args.max_tokens,
                                     prompt_chars=prompt_chars, seed=args.seed, model=args.model, log=log)
    except (httpx.HTTPError, httpx.InvalidURL, json.JSONDecodeError) as e:  # unreachable, not a URL, not ours
        raise ValueError(f"--url {args.url}: {type(e).__name__}: {e}") from None
    what = "time to first token with a shared prefix" if shared else result["setup"]["model"]
    paths = bench_serve.write([result], args.out, args.name, f"kdtree-jax serve: {what}")
    _log(f"wrote {', '.join(paths)}")
    return 0


MAX_ERROR_CHARS = 1000


def _stdout_closed() -> bool:
    """Whether standard output is a pipe whose reader has gone (a broken pipe elsewhere, a socket, is an error)."""
    import select

    try:
        fd = sys.stdout.fileno()
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return False
        poller = select.poll()
        poller.register(fd, select.POLLERR)
        return any(ev & select.POLLERR for _, ev in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def report_errors(prog: str, command, debug: bool, status: int) -> int:
    """command() -> its exit status. Any exception becomes one line `prog: error: ...` on stderr (with the
    exception's notes, at most MAX_ERROR_CHARS) and exit status `status`; an interrupt `prog: interrupted` and 130.
    With debug, the exception propagates with its traceback."""
    try:
        return command()
    except (Exception, KeyboardInterrupt) as e:
        if debug:
            raise
        text = " ".join(" ".join([str(e), *getattr(e, "__notes__", ())]).split())
        if isinstance(e, BrokenPipeError) and _stdout_closed():  # the reader went away (`... | head`): stop quietly
            try:  # nothing more to flush into the closed pipe at exit (Python's documented recipe)
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            except (OSError, ValueError):  # stdout without a file descriptor (captured): nothing to redirect
                pass
            return 141
        if isinstance(e, KeyboardInterrupt):
            print(f"{prog}: interrupted {text}".rstrip(), file=sys.stderr)
            return 130
        if not isinstance(e, (ValueError, TypeError, OSError)):  # not an expected failure: say what it was
            text = f"{type(e).__name__}: {text} (rerun with --debug for the traceback)"
        if len(text) > MAX_ERROR_CHARS:
            text = text[:MAX_ERROR_CHARS] + "..."
        print(f"{prog}: error: {text}", file=sys.stderr)
        return status


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    apply_gpu_flags()  # before jax starts a backend (docs/full_scale.md)
    command = {"generate": generate_command, "bench": bench_command, "plan": plan_command, "serve": serve_command,
               "bench-serve": bench_serve_command}[args.command]
    return report_errors("kdtree-jax", lambda: _join_and_run(command, args), args.debug, status=2)


def _join_and_run(command, args) -> int:
    """Join a multi-process job first when --coordinator is given; then only process 0 writes to stdout."""
    if any(getattr(args, n, None) is not None for n in ("coordinator", "num_processes", "process_id")):
        from .distributed import init_distributed, is_leader

        _check_hosts_flags(args)

        init_distributed(args.coordinator, args.num_processes, args.process_id)
        if not is_leader():
            with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
                return command(args)
    return command(args)


if __name__ == "__main__":
    sys.exit(main())
