"""The package's import graph: no module imports itself through others, and no layer imports a
higher one. Every ``import`` of a specdec module is an edge, read from the source: at module level,
inside a function, and under ``TYPE_CHECKING`` (a type-only import is a dependency too: the reader
of one module must read the other). Importing ``specdec.a.b`` runs ``specdec/a/__init__.py`` first,
so it is an edge to the package ``specdec.a`` too (but for the importer's own packages, which are
being imported already): a module-level import of one package's submodule that runs a package
importing the first one back is a circle, whichever module Python meets first.

Imports inside functions hide edges from a reader of the module's head: at most
:data:`MAX_IMPORTS_IN_FUNCTIONS` of specdec's own modules, each with a comment saying why, and
third-party modules only those :data:`LOADED_WHERE_NEEDED` names.

:data:`LAYERS` places each module of the package in a layer of the drawing in
docs/architecture.md, which it mirrors (:func:`test_the_table_is_the_drawing`)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import specdec

from helpers import REPO

ROOT = Path(specdec.__file__).parent
DRAWING = REPO / "docs" / "architecture.md"

# The layers, highest first, each with the modules (``x`` for x.py) and packages (``x`` for x/) of
# specdec in it; ``__init__`` is the package itself. A module may import its own layer and lower ones.
LAYERS: dict[str, tuple[str, ...]] = {
    "entry points": ("cli", "__main__", "server", "bench", "training", "cluster", "ray"),
    "library API": ("__init__", "api", "serving", "config", "build", "models", "packs", "tokenizers", "draft_vocab", "requantize",
                    "prompts",
                    "layer_skip_search", "divergence"),
    "decoding": ("engine", "stats", "verify", "drafters", "policies", "theory", "sequoia", "token_tree", "sampling",
                 "constraints", "datastore", "options", "costs"),
    "backends": ("backends", "kernels", "memory"),
    "measurements": ("measurements", "paths"),
}


# Imports of specdec's own modules that may stand inside a function body (each with a comment).
MAX_IMPORTS_IN_FUNCTIONS = 5
# Third-party modules imported inside functions, and why they are not imported with the module.
LOADED_WHERE_NEEDED = {
    "llama_cpp": "optional: only the llamacpp extra installs the binding",
    "fcntl": "Unix only: elsewhere the lock is skipped",
    "transformers": "seconds to import; GGUF files on the kernel or llama.cpp never need it",
    "torch": "the command line's modules parse arguments and answer --help before it loads",
    "numpy": "read by conversions only",
    "gguf": "the gguf package's reader, for conversions and GGUF headers only",
    "safetensors": "trained heads' files only",
    "llguidance": "grammars only",
    "tokenizers": "grammars only",
    "matplotlib": "the benchmark's plots only",
    "uvicorn": "the server only",
    "rich": "terminal output only",
    "tqdm": "progress bars only",
}


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
            for name in names:
                if name.startswith("specdec") and owner(name) not in ("", module):
                    edges[module] |= _runs(owner(name), module, modules)
    return edges


def _runs(imported: str, importer: str, modules: dict[str, Path]) -> set[str]:
    """What importing ``imported`` from ``importer`` runs: the module, and each package above it
    that is not one of the importer's own (those are being imported already)."""
    parts = imported.split(".")
    packages = {".".join(parts[:i]) for i in range(2, len(parts))}
    own = {".".join(importer.split(".")[:i]) for i in range(1, len(importer.split(".")) + 1)}
    return {imported} | {p for p in packages if p in modules and p not in own}


def _imports(tree: ast.AST):
    """Every import statement in ``tree``, wherever it stands (under ``TYPE_CHECKING`` too)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node


def _in_functions(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """The import statements inside function bodies (not those under ``TYPE_CHECKING``)."""
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)) and in_function:
                found.append(child)
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return found


def _imported_names(node: ast.Import | ast.ImportFrom) -> list[str]:
    """The modules an import statement names (a relative import as ``specdec``'s)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    return ["specdec" if node.level else node.module or ""]


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


def _top(module: str) -> str:
    """The name a module has in the table: its package under specdec, or itself (``__init__``: specdec)."""
    return (module.split(".") + ["__init__"])[1]


def _layer(module: str) -> int:
    """The layer of a specdec module, 0 the highest (a StopIteration for a module the table lacks)."""
    return next(i for i, names in enumerate(LAYERS.values()) if _top(module) in names)


def _upward(edges: dict[str, set[str]]) -> list[str]:
    """The edges from a lower layer to a higher one, as 'importer -> imported'."""
    return [f"{a} -> {b}" for a in sorted(edges) for b in sorted(edges[a]) if _layer(b) < _layer(a)]


def _drawn() -> dict[str, tuple[str, ...]]:
    """The drawing's layers, highest first, each with the names its rows list: ``x.py`` and ``x/``
    items separated by ' · ', what stands in parentheses being commentary."""
    block = DRAWING.read_text("utf-8").split("```")[1]
    layers: dict[str, list[str]] = {}
    for line in block.strip("\n").splitlines():
        labelled = re.match(r"(\S.*?)\s{2,}(.*)", line)  # a layer's first row: its name, then its items
        if labelled:
            layers[labelled[1]] = []
        items = labelled[2] if labelled else line
        for item in re.sub(r"\([^()]*\)", "", items).split("·"):
            if item.strip():
                layers[list(layers)[-1]].append(item.strip().removesuffix("/").removesuffix(".py"))
    return {label: tuple(names) for label, names in layers.items()}


def test_no_module_imports_itself_through_others():
    modules = _modules()
    assert {"specdec.api", "specdec.policies.auto", "specdec.backends.llamacpp"} <= set(modules)
    circle = _cycle(_edges(modules))
    assert circle is None, " -> ".join(circle)


def test_no_layer_imports_a_higher_one():
    modules = _modules()
    unplaced = sorted(m for m in modules if not any(_top(m) in names for names in LAYERS.values()))
    assert not unplaced, f"place these modules in a layer of LAYERS and of docs/architecture.md: {unplaced}"
    upward = _upward(_edges(modules))
    assert not upward, "imports of a higher layer: " + "; ".join(upward)


def test_the_table_is_the_drawing():
    assert list(_drawn()) == list(LAYERS)
    for label, names in LAYERS.items():
        assert sorted(_drawn()[label]) == sorted(names), label


def test_imports_inside_functions_are_few_and_say_why():
    own, unexplained, foreign = [], [], []
    for module, path in sorted(_modules().items()):
        lines = path.read_text().splitlines()
        for node in _in_functions(ast.parse(path.read_text())):
            where = f"{path.relative_to(ROOT.parent)}:{node.lineno}"
            tops = {name.split(".")[0] for name in _imported_names(node)}
            if "specdec" in tops:
                own.append(where)
                above = lines[node.lineno - 2].strip() if node.lineno > 1 else ""
                if "#" not in lines[node.end_lineno - 1] and not above.startswith("#"):
                    unexplained.append(where)
            foreign += [f"{where} ({top})" for top in sorted(tops - {"specdec"} - set(LOADED_WHERE_NEEDED))]
    assert len(own) <= MAX_IMPORTS_IN_FUNCTIONS, f"specdec imports inside functions: {own}"
    assert not unexplained, f"say why each import inside a function is not at the module's head: {unexplained}"
    assert not foreign, ("import these at the module's head, or say in LOADED_WHERE_NEEDED why they wait: "
                         + "; ".join(foreign))


def test_an_import_runs_the_packages_above_the_module():
    modules = _modules()
    assert _runs("specdec.policies.base", "specdec.drafters.tree", modules) == {
        "specdec.policies.base", "specdec.policies"}
    assert _runs("specdec.drafters.base", "specdec.drafters.tree", modules) == {"specdec.drafters.base"}
    assert _runs("specdec.sequoia", "specdec.drafters.tree", modules) == {"specdec.sequoia"}


def test_the_walk_finds_imports_inside_functions_but_not_type_only_ones():
    source = ("from typing import TYPE_CHECKING\nimport os\nif TYPE_CHECKING:\n    from specdec.api import generate\n"
              "def f():\n    import json\n    from specdec import paths  # why\n    return lambda: __import__('x')\n"
              "class C:\n    def g(self):\n        if TYPE_CHECKING:\n            import specdec.api\n        import struct\n")
    found = _in_functions(ast.parse(source))
    assert [_imported_names(node) for node in found] == [["json"], ["specdec"], ["struct"]]


def test_the_walk_finds_a_circle_where_there_is_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_walk_reads_type_only_imports_and_finds_an_upward_edge():
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from specdec.api import generate\n"
    assert [node.module for node in _imports(ast.parse(source))] == ["typing", "specdec.api"]
    assert _upward({"specdec.paths": {"specdec.api"}, "specdec.api": {"specdec.paths"}}) == [
        "specdec.paths -> specdec.api"]
