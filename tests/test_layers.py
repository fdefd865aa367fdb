"""The package imports only downward: every ``import`` of ``src/shardwise`` (at module level
or inside a function) names a module of its own layer or of a layer below, and no chain of
imports, however long, comes back to where it started.

The layers, lowest first (``docs/architecture.md`` draws them). A module of layer i may
import layers 0..i; inside one layer the modules must still form no cycle.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "shardwise"

LAYERS = ["base", "perf", "comm", "launch", "models", "data", "parallel", "checkpoint",
          "engine", "training", "apps", "planner", "cli"]
TOP = {"__init__", "__main__"}  # the package's front door and `python -m shardwise`


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PKG.rglob("*.py")}


def _imports(name: str, path: Path, known: set[str]) -> list[tuple[str, int]]:
    """``(imported module, line)`` for every import of ours in the file, at any depth."""
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # `from pkg import sub` imports the submodule when there is one
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod
                       for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `import shardwise.comm.cost as c` -> the module
                t = t.rpartition(".")[0]
            if t and t != name and t.startswith("shardwise"):
                out.append((t, node.lineno))
    return out


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"  # the package root is the front door


def _graph() -> tuple[dict[str, set[str]], list[str]]:
    mods = _modules()
    known = set(mods)
    edges: dict[str, set[str]] = defaultdict(set)
    upward = []
    for name, path in sorted(mods.items()):
        src = _layer(name)
        for target, line in _imports(name, path, known):
            dst = _layer(target)
            if target == "shardwise":
                if src not in TOP:
                    upward.append(f"{path.relative_to(SRC)}:{line} imports the package root")
                continue
            edges[name].add(target)
            if src in TOP:
                continue
            if LAYERS.index(dst) > LAYERS.index(src):
                upward.append(f"{path.relative_to(SRC)}:{line} ({src}) imports {target} ({dst})")
    return edges, upward


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
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

    for v in list(edges):
        if v not in index:
            visit(v)
    return out


def _is_ancestor_init(a: str, b: str) -> bool:
    """A package's ``__init__`` re-exporting its submodules, which import siblings through
    the package: ``x`` -> ``x.y`` -> ``x``. Not a cycle of code, only of names."""
    return b.startswith(a + ".") or a.startswith(b + ".")


def test_every_module_belongs_to_a_layer():
    strays = sorted({_layer(m) for m in _modules()} - set(LAYERS) - TOP)
    assert not strays, f"top-level modules in no layer (add them to LAYERS): {strays}"


def test_imports_point_only_downward():
    _, upward = _graph()
    assert not upward, "imports that point up the layering:\n" + "\n".join(upward)


def test_no_import_cycle():
    edges, _ = _graph()
    # drop the package -> own-submodule edges (re-exports) before looking for cycles
    pruned = {a: {b for b in bs if not (b.startswith(a + ".") and
                                        (PKG / Path(*a.split(".")[1:]) / "__init__.py").exists())}
              for a, bs in edges.items()}
    cycles = _cycles(pruned)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_check_catches_an_upward_import(tmp_path, monkeypatch):
    """The walk is not vacuous: a comm module importing the engine is reported."""
    fake = tmp_path / "shardwise"
    (fake / "comm").mkdir(parents=True)
    (fake / "engine").mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "comm" / "__init__.py").write_text("")
    (fake / "engine" / "__init__.py").write_text("")
    (fake / "comm" / "x.py").write_text("def f():\n    from shardwise.engine import y\n")
    (fake / "engine" / "y.py").write_text("from shardwise.comm import x\n")
    monkeypatch.setattr(__import__(__name__), "SRC", tmp_path)
    monkeypatch.setattr(__import__(__name__), "PKG", fake)
    edges, upward = _graph()
    assert any("comm/x.py:2" in u and "shardwise.engine.y" in u for u in upward), upward
    assert _cycles(edges) == [["shardwise.comm.x", "shardwise.engine.y"]]


def test_the_engine_imports_no_concrete_model():
    """The engine (and parallel, checkpoint, training beneath or beside it) reads a model's
    ``ModelDescription``: of ``models`` it may import only the description, the meta-device
    construction, sampling and the sequence shard a context-parallel rank holds, never the
    GPT, the Llama or the CNN (issue 21)."""
    allowed = {"shardwise.models.description", "shardwise.models.meta_init",
               "shardwise.models.sampling", "shardwise.models.sequence"}
    mods = _modules()
    known = set(mods)
    bad = [f"{path.relative_to(SRC)}:{line} imports {target}"
           for name, path in sorted(mods.items())
           if _layer(name) in ("engine", "parallel", "checkpoint", "training")
           for target, line in _imports(name, path, known)
           if _layer(target) == "models" and target not in allowed]
    assert not bad, "concrete models imported below the applications:\n" + "\n".join(bad)
