"""The import structure, read from the source with `ast` (no imports run): one way only.

- no import cycles among the project's modules (specjax, pallas_kernels, train, tools), counting
  imports inside functions too (an import moved into a function still ties the modules together);
- `pallas_kernels` imports nothing from specjax; `specjax` imports nothing from train / tools / tests;
  `train` nothing from tools / tests;
- imports inside functions in `specjax/` only for optional dependencies (ALLOWED_LAZY);
- `specjax/`'s folders are layers (LAYERS, lowest first): a module imports from its own layer or
  lower ones only; the top level holds only the package face, the CLI and `typing`.

Run `python -m tests.test_imports` for the graph's cycles and lazy imports in words.
"""
from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("specjax", "pallas_kernels", "train", "tools")
# Optional dependencies (absent from a base install, or heavy and needed by one path only) may be
# imported where they are used.
ALLOWED_LAZY = ("torch", "transformers", "matplotlib", "jax_triton", "llama_cpp", "gguf", "jinja2",
                "jax.experimental.pallas.triton", "jax.experimental.pallas", "orbax", "optax", "tokenizers",
                "flatbuffers")
# specjax's layers, lowest first: a module may import from its own layer and those before it.
LAYERS = ("typing", "spec", "models", "io", "drafters", "engine", "__init__", "cli", "__main__")
TOP_LEVEL = {"specjax", "specjax.__main__", "specjax.cli", "specjax.typing"}  # the only flat modules


def module_name(path: str) -> str:
    rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def modules() -> dict[str, str]:
    out = {}
    for pkg in PACKAGES:
        for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    p = os.path.join(dirpath, f)
                    out[module_name(p)] = p
    return out


def _resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = mod.split(".")
    base = base if is_pkg else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(mods: dict[str, str]):
    """{module: [(imported project module, lineno, inside a function)]} and the lazy imports of
    external modules [(module, lineno, name)]."""
    graph, lazy_ext = {}, []
    for mod, path in mods.items():
        tree = ast.parse(open(path).read(), path)
        is_pkg = path.endswith("__init__.py")
        edges = []

        def visit(node, in_func):
            for child in ast.iter_child_nodes(node):
                nested = in_func or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                names = []
                if isinstance(child, ast.Import):
                    names = [a.name for a in child.names]
                elif isinstance(child, ast.ImportFrom):
                    base = _resolve(mod, is_pkg, child)
                    names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in child.names]
                for n in names:
                    target = next((m for m in (n, n.rsplit(".", 1)[0]) if m in mods), None)
                    if target is not None and target != mod:
                        edges.append((target, child.lineno, in_func))
                    elif target is None and in_func:
                        lazy_ext.append((mod, child.lineno, n))
                visit(child, nested)

        visit(tree, False)
        graph[mod] = edges
    return graph, lazy_ext


def cycles(graph) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w, _, _ in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def _package_parents(graph):
    """A package's __init__ re-exporting its own submodules is not a cycle: drop edges from a package
    to its submodules when those edges only re-export (the submodule imports the package's
    siblings, not the package)."""
    return {m: [(t, ln, f) for t, ln, f in e if not t.startswith(m + ".")] for m, e in graph.items()}


def test_no_import_cycles():
    graph, _ = imports(modules())
    found = cycles(_package_parents(graph))
    assert not found, f"import cycles: {found}"


def test_layers_import_one_way():
    graph, _ = imports(modules())
    bad = []
    rules = {"pallas_kernels": ("specjax", "train", "tools", "tests"), "specjax": ("train", "tools", "tests"),
             "train": ("tools", "tests")}
    for mod, edges in graph.items():
        top = mod.split(".")[0]
        for target, line, _ in edges:
            if target.split(".")[0] in rules.get(top, ()):
                bad.append(f"{mod}:{line} imports {target}")
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_function_level_imports_only_for_optional_dependencies():
    mods = modules()
    graph, lazy_ext = imports(mods)
    bad = [f"{m}:{ln} imports {t} inside a function" for m, e in graph.items() if m.startswith("specjax")
           for t, ln, inside in e if inside]
    bad += [f"{m}:{ln} imports {n} inside a function" for m, ln, n in lazy_ext if m.startswith("specjax")
            and not n.startswith(ALLOWED_LAZY)]
    assert not bad, "imports inside functions (move them to the top, or name the optional dependency):\n" + "\n".join(bad)


def layer(mod: str) -> str:
    """`specjax.<folder or top-level module>` for specjax, the top package otherwise."""
    parts = mod.split(".")
    return parts[1] if parts[0] == "specjax" and len(parts) > 1 else ("__init__" if mod == "specjax" else parts[0])


def layer_edges(graph) -> dict[tuple[str, str], int]:
    """{(importing layer, imported layer): number of imports} between specjax's layers."""
    out = {}
    for mod, edges in graph.items():
        if mod.split(".")[0] != "specjax":
            continue
        for target, _, _ in edges:
            a, b = layer(mod), layer(target)
            if a != b:
                out[(a, b)] = out.get((a, b), 0) + 1
    return out


def test_specjax_folders_are_layers():
    mods = modules()
    flat = sorted(m for m, p in mods.items() if m.startswith("specjax") and m.count(".") <= 1
                  and not p.endswith("__init__.py") and m not in TOP_LEVEL)
    assert not flat, f"flat modules in specjax/ (put each in the folder of its layer): {flat}"
    unknown = sorted({layer(m) for m in mods if m.startswith("specjax.")} - set(LAYERS))
    assert not unknown, f"specjax folders missing from LAYERS: {unknown}"
    graph, _ = imports(mods)
    rank = {n: i for i, n in enumerate(LAYERS)}
    bad = [f"{mod}:{line} imports {target}" for mod, edges in graph.items() if mod.split(".")[0] == "specjax"
           for target, line, _ in edges if target.split(".")[0] == "specjax" and rank[layer(target)] > rank[layer(mod)]]
    assert not bad, "upward imports between specjax's layers:\n" + "\n".join(bad)


if __name__ == "__main__":
    g, lazy = imports(modules())
    print("cycles:", cycles(_package_parents(g)))
    print("imports between specjax's layers (lowest first:", " < ".join(LAYERS) + "):")
    for (a, b), n in sorted(layer_edges(g).items(), key=lambda kv: (LAYERS.index(kv[0][0]) if kv[0][0] in LAYERS else 99, kv[0][1])):
        print(f"  {a:>9} -> {b:<14} {n:3d}")
    for m, e in sorted(g.items()):
        for t, ln, inside in e:
            if inside and m.startswith("specjax"):
                print(f"lazy  {m}:{ln} -> {t}")
    for m, ln, n in lazy:
        if m.startswith("specjax") and not n.startswith(ALLOWED_LAZY):
            print(f"lazy-ext {m}:{ln} -> {n}")
