"""The package's layers point one way, and no module imports itself back.

Layers, bottom to top: ops and structures, curvature capture, optimizers, distributed
training, the harness. A module imports only from its own layer or those below it;
imports made only for type checking count too (a type-only cycle is a cycle for a reader).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "singd_cuda"
LAYERS = {"ops": 0, "structures": 0, "curvature": 1, "optim": 2, "distributed": 3, "harness": 4}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in ROOT.rglob("*.py")}


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that ``path`` imports (a package's __init__ counts as the
    package; ``from package import module`` counts as the module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            targets = [f"{prefix}.{alias.name}" for alias in node.names] + [prefix]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(name, path, set(mods)) for name, path in mods.items()}


def layer(name: str) -> int | None:
    parts = name.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def test_layers_point_one_way():
    wrong = [
        f"{source} -> {target}"
        for source, targets in graph().items()
        for target in targets
        if layer(source) is not None and layer(target) is not None and layer(target) > layer(source)
    ]
    assert not wrong, "imports from a layer above:\n" + "\n".join(sorted(wrong))


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    # a package's __init__ re-exports its modules: edges into a package's own modules
    # from its __init__ are how Python packages work, not a cycle of concepts
    edges = {
        source: {t for t in targets if not t.startswith(source + ".")}
        for source, targets in graph().items()
    }
    assert not cycles(edges), "import cycles:\n" + "\n".join(map(str, cycles(edges)))


@pytest.mark.parametrize(
    "edges, expected",
    [({"a": {"b"}, "b": {"a"}}, [["a", "b"]]), ({"a": {"b"}, "b": set()}, [])],
)
def test_cycle_finder(edges, expected):
    assert cycles(edges) == expected
