"""Every module ``specdec`` imports at module level is installed by ``pip install specdec``.

A third-party module imported at the top of a file under ``src/`` that only an optional extra
(``dev``, ``llamacpp``) installs breaks the README's first command on a fresh machine with a
``ModuleNotFoundError``, while CI, which installs the extras, stays green. This walks ``src/``
and maps each module-level import (not those inside functions, under ``try: ... except
ImportError`` or ``if TYPE_CHECKING:``) to the distributions that provide it; each must be among
the runtime dependencies of ``pyproject.toml`` or what they pull in. ``tests/test_fresh_install.py``
checks the same from the other side, in a virtual environment without the extras.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys
import tomllib
from pathlib import Path

from helpers import REPO


def module_level_imports(source: str) -> set[str]:
    """Top-level names of the modules ``source`` imports when it is imported."""
    found: set[str] = set()

    def visit(nodes: list[ast.stmt], guarded: bool) -> None:
        for node in nodes:
            if isinstance(node, ast.Import) and not guarded:
                found.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and not guarded and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
            elif isinstance(node, ast.Try):
                caught = set()
                for handler in node.handlers:
                    types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
                    caught |= {getattr(t, "id", None) for t in types}
                visit(node.body, guarded or bool(caught & {"ImportError", "ModuleNotFoundError", "Exception"}))
                visit(node.orelse, guarded)
                visit(node.finalbody, guarded)
            elif isinstance(node, ast.If):
                visit(node.body, guarded or "TYPE_CHECKING" in ast.unparse(node.test))
                visit(node.orelse, guarded)

    visit(ast.parse(source).body, False)
    return found


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\s<>=!~;\[(]", r.strip(), maxsplit=1)[0].lower().replace("_", "-")
            for r in requirements if r.strip()}


def _closure(names: set[str]) -> set[str]:
    """The distributions ``names`` install: themselves and their requirements (no extras)."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        todo += _names([r for r in requires if "extra ==" not in r])
    return seen


def undeclared_imports(root: Path) -> dict[str, list[str]]:
    """``{module (its distributions): [files]}`` for module-level imports under ``root/src`` that
    the runtime dependencies of ``root/pyproject.toml`` do not install."""
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    runtime = _closure(_names(project.get("dependencies", [])))
    owners_of = md.packages_distributions()
    own = project["name"].replace("-", "_")
    missing: dict[str, list[str]] = {}
    for path in sorted((root / "src").rglob("*.py")):
        for module in module_level_imports(path.read_text(encoding="utf-8")):
            if module in sys.stdlib_module_names or module in (own, "__future__"):
                continue
            owners = {d.lower().replace("_", "-") for d in owners_of.get(module, [])}
            if not owners & runtime:
                shown = f"{module} (from {', '.join(sorted(owners)) or 'nothing installed here'})"
                missing.setdefault(shown, []).append(str(path.relative_to(root)))
    return missing


def test_every_module_level_import_is_a_runtime_dependency():
    assert undeclared_imports(REPO) == {}


def test_the_check_catches_a_module_level_import_that_only_an_extra_installs(tmp_path):
    """The control: a project that imports pytest (installed here, by the dev extra) at module
    level without declaring it is caught; the same import inside a function, or declared, is not."""
    (tmp_path / "src" / "demo").mkdir(parents=True)
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "demo"\ndependencies = ["numpy"]\n')
    module = tmp_path / "src" / "demo" / "__init__.py"
    module.write_text("import numpy\nimport pytest\n")
    assert list(undeclared_imports(tmp_path)) == ["pytest (from pytest)"]
    module.write_text("import numpy\n\ndef later():\n    import pytest\n\ntry:\n    import pytest\nexcept ImportError:\n    pass\n")
    assert undeclared_imports(tmp_path) == {}
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "demo"\ndependencies = ["numpy", "pytest"]\n')
    module.write_text("import pytest\n")
    assert undeclared_imports(tmp_path) == {}
