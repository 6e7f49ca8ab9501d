"""The package's import graph has no circle: every ``import`` of a specdec module, at module level
or inside a function (but not under ``TYPE_CHECKING``), is an edge, read from the source."""

from __future__ import annotations

import ast
from pathlib import Path

import specdec

ROOT = Path(specdec.__file__).parent


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _edges(modules: dict[str, Path]) -> dict[str, set[str]]:
    def owner(name: str) -> str:  # the module an imported name lives in
        while name not in modules and "." in name:
            name = name.rsplit(".", 1)[0]
        return name if name in modules else ""

    edges: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        for node in _imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                names = [f"{base}.{a.name}" for a in node.names]
            edges[module] |= {owner(n) for n in names if n.startswith("specdec")} - {"", module}
    return edges


def _imports(tree: ast.AST):
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from _imports(node)


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One circle of the graph, if there is one (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(edges[v]):
            if state.get(w) == 1:
                return path[path.index(w):] + [w]
            if w not in state and (found := visit(w)):
                return found
        state[v] = 2
        path.pop()
        return None

    for v in sorted(edges):
        if v not in state and (found := visit(v)):
            return found
    return None


def test_no_module_imports_itself_through_others():
    modules = _modules()
    assert {"specdec.api", "specdec.policies.auto", "specdec.backends.llamacpp"} <= set(modules)
    assert _cycle(_edges(modules)) is None, " -> ".join(_cycle(_edges(modules)))


def test_the_walk_finds_a_circle_where_there_is_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
