"""Public names carry a docstring: at most 2% of them may lack one (issue 39).

The rule, read from the source with ``ast`` (nothing imported):

- the modules are every ``.py`` file under ``src/shardwise`` whose path has no part starting
  with ``_``, ``__init__.py`` and ``__main__.py`` excepted (``_compat.py`` or a ``_private/``
  folder are internal);
- a public name is a function or class defined at a module's top level whose name does not
  start with ``_``, and each function or class defined directly in the body of such a public
  class whose name does not start with ``_`` (so ``__init__``, ``__call__`` and other dunders
  are not counted: the class's docstring describes construction);
- a name has a docstring when ``ast.get_docstring`` finds one (properties count as methods).
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
LIMIT = 0.02  # at most this share of public names without a docstring


def _modules(root: Path) -> list[Path]:
    keep = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if any(p.startswith("_") and p not in ("__init__.py", "__main__.py") for p in parts):
            continue
        keep.append(path)
    return keep


def public_names(path: Path) -> list[tuple[str, bool]]:
    """``(qualified name, has a docstring)`` for each public name of the module at ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    out = []
    for node in tree.body:
        if not isinstance(node, kinds) or node.name.startswith("_"):
            continue
        out.append((node.name, ast.get_docstring(node) is not None))
        if isinstance(node, ast.ClassDef):
            out += [(f"{node.name}.{m.name}", ast.get_docstring(m) is not None)
                    for m in node.body if isinstance(m, kinds) and not m.name.startswith("_")]
    return out


def test_the_rule_counts_what_it_says(tmp_path):
    """The walk itself: public functions, classes and their public methods counted; private
    names, methods of private classes, nested functions and ``_``-modules not."""
    pkg = tmp_path / "pkg"
    (pkg / "_internal").mkdir(parents=True)
    (pkg / "__init__.py").write_text('def exported():\n    """Doc."""\n')
    (pkg / "_compat.py").write_text("def hidden(): pass\n")
    (pkg / "_internal" / "mod.py").write_text("def hidden(): pass\n")
    (pkg / "mod.py").write_text(
        "def f():\n    def inner(): pass\n"
        "def _g(): pass\n"
        "class C:\n    '''Doc.'''\n    def m(self): pass\n    def _p(self): pass\n"
        "    def __init__(self): pass\n    @property\n    def size(self):\n        '''Doc.'''\n"
        "class _Hidden:\n    def m(self): pass\n")
    found = {p.name: public_names(p) for p in _modules(pkg)}
    assert found == {"__init__.py": [("exported", True)],
                     "mod.py": [("f", False), ("C", True), ("C.m", False), ("C.size", True)]}


def test_at_most_two_percent_of_public_names_lack_a_docstring():
    total, missing = 0, Counter()
    names = []
    for path in _modules(SRC / "shardwise"):
        rel = path.relative_to(SRC).as_posix()
        for name, documented in public_names(path):
            total += 1
            if not documented:
                missing[rel] += 1
                names.append(f"{rel}: {name}")
    assert total > 500, total  # the walk found the package
    share = sum(missing.values()) / total
    per_file = ", ".join(f"{f} {n}" for f, n in missing.most_common())
    assert share <= LIMIT, (f"{sum(missing.values())} of {total} public names "
                            f"({share:.1%}) lack a docstring (at most {LIMIT:.0%}): "
                            f"{per_file}\n" + "\n".join(names))
