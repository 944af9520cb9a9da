"""The package's layers (README, "Layout"): each module imports only from its own layer or those below, and no two
modules import each other, directly or around a circle (function-level imports included). The converters
(`kdtree_converters`) sit on top: the library never imports them."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kdtree_jax"

# lowest first; a module may import from its own layer and every layer below
LAYERS = [
    {"config", "configs", "corpus", "quant", "tokenizer", "validate", "xla_flags"},
    {"kernels", "kernels._registry", "kernels.marlin_moe", "kernels.mla_verify", "kernels.moe_route",
     "kernels.move_rows", "kernels.mla_pre", "kernels.fused_dot", "kernels.draft_attention",
     "kernels.tree_accept", "kernels.tree_build", "distributed"},
    {"sharding"},
    {"model"},
    {"drafter"},
    {"decoding", "budget_policy"},
    {"ddtree"},
    {"generate", "builtin", "budget"},
    {"checkpoint", "serving", "serving.engine", "serving.heap"},
    {"plan", "train", "cli", "serving.serve", "serving.bench_serve"},
    {"__init__"},
]
LAYER = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def _module(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(p for p in parts if p != "__init__") or "__init__"


def _imports(path: pathlib.Path) -> set[str]:
    """The package modules `path` imports, wherever in the file (relative imports resolved)."""
    mod = _module(path)
    package = mod.split(".")[:-1] if path.name != "__init__.py" else mod.split(".") if mod != "__init__" else []
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").startswith("kdtree_jax"):
                target = node.module[len("kdtree_jax"):].lstrip(".")
            else:
                continue
            names = [target] if node.module else []
            names += [f"{target}.{a.name}".lstrip(".") for a in node.names]
            out.update(n for n in names if n in LAYER)
        elif isinstance(node, ast.Import):
            out.update(a.name[len("kdtree_jax."):] for a in node.names
                       if a.name.startswith("kdtree_jax.") and a.name[len("kdtree_jax."):] in LAYER)
    out.discard(mod)
    return out


GRAPH = {_module(p): _imports(p) for p in PACKAGE.rglob("*.py")}


def _imported_packages(path: pathlib.Path) -> set[str]:
    """The top-level names of the absolute imports of `path` (function-level ones included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
    return out


def test_the_library_never_imports_the_converters():
    users = sorted(str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py") if "kdtree_converters" in
                   _imported_packages(p))
    assert not users, users


def test_every_module_has_a_layer():
    assert set(GRAPH) <= set(LAYER), sorted(set(GRAPH) - set(LAYER))


def test_imports_only_look_down():
    upward = [f"{m} (layer {LAYER[m]}) imports {t} (layer {LAYER[t]})" for m, targets in GRAPH.items()
              for t in targets if LAYER[t] > LAYER[m]]
    assert not upward, "\n".join(upward)


def test_no_import_cycles():
    seen, stack, cycles = set(), [], []

    def visit(m):
        if m in stack:
            cycles.append(stack[stack.index(m):] + [m])
            return
        if m in seen:
            return
        seen.add(m)
        stack.append(m)
        for t in sorted(GRAPH.get(m, ())):
            if not t.startswith("kernels") or not m.startswith("kernels"):  # the kernels package imports its own
                visit(t)
        stack.pop()

    for m in sorted(GRAPH):
        visit(m)
    assert not cycles, cycles


def test_the_api_imports_the_kernels_itself():
    """`import kdtree_jax as kj; kj.kernels.tree_build(...)` works because the package imports `kernels` itself, not
    as a side effect of another module's import."""
    import jax
    import numpy as np

    import kdtree_jax as kj

    assert "kernels" in GRAPH["__init__"] and "kernels" in kj.__all__
    logits = jax.random.normal(jax.random.key(0), (2, 3, 16))
    tree = kj.kernels.tree_build(logits, 5, impl="xla")
    np.testing.assert_array_equal(tree.tokens, kj.kernels.tree_build_ref(logits, 5).tokens)
