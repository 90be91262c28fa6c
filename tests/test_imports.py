"""No import circle inside the ``unicron`` package, and no class or module past the bounds.

The graph has one edge per ``import`` of a package module, wherever the statement sits: at
the top of a module, in a class, or inside a function (a function-local import is how a
circle hides until the function first runs). Imports under ``if TYPE_CHECKING:`` are left
out: they never run. Read with :mod:`ast`, so nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "unicron"


def _modules(package: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file under ``package``."""
    out: dict[str, Path] = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _imported(tree: ast.Module, name: str, modules: dict[str, Path]) -> set[str]:
    """The package modules ``name``'s tree imports (``from pkg import sub`` names ``pkg.sub``
    where that is a module; a relative import is resolved against ``name``)."""
    out: set[str] = set()
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and _type_checking(node):
            todo.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".")
                if modules[name].name != "__init__.py":
                    pkg.pop()
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join([*pkg, base] if base else pkg)
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.add(sub if sub in modules else base)
        todo.extend(ast.iter_child_nodes(node))
    return {m for m in out if m in modules and m != name}


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the package modules it imports."""
    modules = _modules(package)
    return {
        name: _imported(ast.parse(path.read_text(encoding="utf-8")), name, modules)
        for name, path in modules.items()
    }


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_in_the_package() -> None:
    graph = import_graph(PACKAGE)
    assert graph.get("unicron.sim.engine")  # the walk sees edges
    assert circles(graph) == []


def _write(root: Path, files: dict[str, str]) -> Path:
    pkg = root / "pkg"
    for rel, text in files.items():
        path = pkg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return pkg


def test_a_circle_hidden_in_a_function_is_found(tmp_path: Path) -> None:
    pkg = _write(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "from pkg import b\n",
            "b.py": "def f() -> None:\n    from pkg.a import x\n",
            "c.py": "from . import a\n",
        },
    )
    assert circles(import_graph(pkg)) == [["pkg.a", "pkg.b"]]


def test_a_relative_circle_is_found_and_type_checking_is_left_out(tmp_path: Path) -> None:
    pkg = _write(
        tmp_path,
        {
            "__init__.py": "",
            "sub/__init__.py": "",
            "sub/a.py": "from .b import y\n",
            "sub/b.py": "from .. import c\n",
            "c.py": "import pkg.sub.a\n",
            "d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import c\n",
            "e.py": "from pkg import d\n",
        },
    )
    assert circles(import_graph(pkg)) == [["pkg.c", "pkg.sub.a", "pkg.sub.b"]]


def test_the_data_path_imports_nothing_of_the_control_plane() -> None:
    # runtime/ (groups, reduce, transfer, ...) and the wire contract are below control/: the
    # arrows point one way (control/ imports them, never the reverse)
    graph = import_graph(PACKAGE)
    wire = ("unicron.protocol", "unicron.messages")
    below = [m for m in graph if m.startswith("unicron.runtime") or m in wire]
    assert set(wire) <= set(below)
    assert "unicron.runtime.group" in below
    up = {m: sorted(d for d in graph[m] if d.startswith("unicron.control")) for m in below}
    assert {m: d for m, d in up.items() if d} == {}


CLASS_LINES, MODULE_LINES = 500, 900
"""the house's bounds (issue #34): a class a newcomer reads whole, a module of one job"""


def test_no_class_or_module_of_the_package_is_over_the_houses_bounds() -> None:
    over = []
    for name, path in _modules(PACKAGE).items():
        text = path.read_text()
        if (lines := len(text.splitlines())) > MODULE_LINES:
            over.append(f"module {name}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.ClassDef) or node.end_lineno is None:
                continue
            if (span := node.end_lineno - node.lineno + 1) > CLASS_LINES:
                over.append(f"class {name}.{node.name}: {span} lines")
    assert over == []
