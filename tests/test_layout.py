"""The package's shape: imports flow one way (no circle, lazy imports included) and no module outgrows a file."""

from __future__ import annotations

import ast
from pathlib import Path

import flashdraft

ROOT = Path(flashdraft.__file__).parent


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Package modules `name` imports anywhere in its body (functions too), except under `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(sub)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING"
        for sub in ast.walk(node)
    }
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom) or id(node) in typing_only:
            continue
        base = package[: len(package) - node.level + 1] if node.level else []
        target = ".".join(base + [node.module] if node.module else base) if node.level else node.module or ""
        for candidate in [target, *(f"{target}.{a.name}" for a in node.names)]:
            if candidate in modules and candidate != name:
                found.add(candidate)
    return found


def test_no_import_circle():
    modules = _modules()
    # A package's __init__ re-exports its modules: an edge into it is an edge into what it exports, so packages
    # are left out as targets (their own imports still count).
    graph = {
        m: {t for t in _imports(m, p, modules) if modules[t].name != "__init__.py"}
        for m, p in modules.items()
    }
    circles = []

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(graph[node]):
            if nxt in path:
                circles.append(path[path.index(nxt) :] + [nxt])
            elif len(path) < 16:
                visit(nxt, [*path, nxt])

    for m in graph:
        visit(m, [m])
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles[:5])


def test_no_module_over_700_lines():
    long = {
        str(p.relative_to(ROOT)): n
        for p in ROOT.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 700
    }
    assert not long, long
