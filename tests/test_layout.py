"""The package's shape (docs/architecture.md), held by the code's own imports: packages by concept whose imports go
one way, down the floors; no import circle (lazy imports included); few modules at the top, none over 650 lines; the
CPU's features read only inside `kernels/`."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import flashdraft

ROOT = Path(flashdraft.__file__).parent


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path], typing: bool = False) -> set[str]:
    """Package modules `name` imports anywhere in its body (functions too); those under `if TYPE_CHECKING:` only
    with `typing`."""
    tree = ast.parse(path.read_text())
    typing_only = (
        set()
        if typing
        else {
            id(sub)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING"
            for sub in ast.walk(node)
        }
    )
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
    # are left out as targets (their own imports still count). Imports for type hints count: two modules that name
    # each other's types are one concept split in two, whatever the interpreter runs.
    graph = {
        m: {t for t in _imports(m, p, modules, typing=True) if modules[t].name != "__init__.py"}
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


# Each part of the package and its floor: a module may import its own part and the floors below, never above (parts
# on one floor do not import each other).
FLOORS = {
    "cli": 9,
    "__main__": 10,
    "errors": 8,
    "bench": 7,
    "training": 7,
    "__init__": 6,
    "serve": 6,
    "pipeline": 5,
    "mlx": 5,
    "generate": 5,
    "engine": 4,
    "targets": 3,
    "prompts": 3,
    "drafter": 2,
    "models": 2,
    "kernels": 1,
    "sampling": 0,
    "progress": 0,
    "files": 0,
    "extras": 0,
    "_version": 0,
}


def _part(name: str) -> str:
    return name.split(".")[1] if "." in name else "__init__"


def test_imports_go_down_the_floors_and_every_part_has_one():
    modules = _modules()
    climbs = []
    for name, path in modules.items():
        assert _part(name) in FLOORS, (
            f"{name}: a part with no floor (add it to FLOORS and docs/architecture.md)"
        )
        for other in _imports(name, path, modules):
            if _part(other) != _part(name) and FLOORS[_part(other)] >= FLOORS[_part(name)]:
                climbs.append(f"{name} -> {other}")
    assert not climbs, climbs


def test_few_modules_at_the_top_and_none_over_650_lines():
    top = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(top) <= 12, top
    long = {
        str(p.relative_to(ROOT)): n
        for p in ROOT.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 650
    }
    assert not long, long


def test_only_the_kernels_read_the_cpu_s_features():
    tests = re.compile(
        r"torch\.cpu\._is_|/proc/cpuinfo|get_cpu_capability|_init_amx|_is_mkldnn_\w+_supported"
    )
    readers = sorted(
        str(p.relative_to(ROOT))
        for p in ROOT.rglob("*.py")
        if p.relative_to(ROOT).parts[0] != "kernels" and tests.search(p.read_text())
    )
    assert not readers, readers


def test_the_kernel_switches_are_read_in_one_place():
    """`$FLASHDRAFT_COMPILE`, `_FUSED_LAYERS`, `_ATTENTION`, `_ATTENTION_TILES`, `_PACKED_LINEAR`: the kernel plan
    (kernels/plan.py)."""
    read = re.compile(
        r"environ(?:\.get)?\W+[\"']FLASHDRAFT_(COMPILE|FUSED_LAYERS|ATTENTION|ATTENTION_TILES|PACKED_LINEAR)\b"
    )
    readers = sorted(str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py") if read.search(p.read_text()))
    assert readers == ["kernels/plan.py"], readers
