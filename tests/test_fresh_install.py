"""The README's first command installs everything ``specdec`` needs to start, without the dev extra.

CI installs the dev extra, so a runtime module that only that extra brings (httpx once) would
leave every ``specdec`` command broken for a user who follows the README while the suite stays
green. This test runs the README's first command's installs of code (``torch==2.13.0``, then the
package, without llama.cpp's binding: the default pair runs on specdec's own kernel) in a fresh
virtual environment that does not see this interpreter's packages, and runs what a user runs
first: ``import specdec``, every module of the package, and the help of ``specdec generate``,
``specdec serve`` and ``specdec bench``. pip reuses its cache, so it takes about 2 minutes on 2 cores.
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from helpers import REPO

# Modules that only an extra runs (the Ray Serve application: specdec[ray]): without it, importing
# one is an ImportError that says what to install; every other module imports.
EXTRA_MODULES = ("specdec.cluster", "specdec.ray")
IMPORT_EVERY_MODULE = f"""
import pkgutil, importlib, specdec
names = [m.name for m in pkgutil.walk_packages(specdec.__path__, "specdec.") if not m.name.endswith("__main__")]
for name in names:
    try:
        importlib.import_module(name)
    except ImportError as err:
        if name not in {EXTRA_MODULES!r} or "pip install 'specdec[ray]'" not in str(err):
            raise
print(len(names), "modules")
"""


def first_command() -> str:
    """The README's first command: the set-up line that ends by running the default pair."""
    lines = [line for line in (REPO / "README.md").read_text().splitlines() if "pip install torch==2.13.0 &&" in line]
    return lines[0]


def test_the_first_command_of_the_readme_installs_what_specdec_imports(tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True, system_site_packages=False).create(env_dir)
    python, specdec = env_dir / "bin" / "python", env_dir / "bin" / "specdec"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}

    def run(*argv: str | Path, timeout: float = 900) -> str:
        done = subprocess.run([str(a) for a in argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, f"{' '.join(map(str, argv))} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        return done.stdout

    installs = [part.split() for part in first_command().split("&&") if part.split()[:2] == ["pip", "install"]]
    assert installs[:2] == [["pip", "install", "torch==2.13.0"], ["pip", "install", "-e", "."]]
    for install in installs[:2]:  # the code; the model packs (installs[2:]) are the suite's already
        run(python, "-m", *install[:2], "-q", *install[2:])
    dev_only = run(python, "-c", "import importlib.util as u; print([m for m in ('pytest', 'hypothesis', 'openai', "
                                 "'playwright', 'scipy', 'llama_cpp') if u.find_spec(m)])")
    assert dev_only.strip() == "[]", "the environment must have neither the dev extra nor llama.cpp's binding"
    run(python, "-c", "import specdec; specdec.DecodeConfig.parse('spec')")
    assert int(run(python, "-c", IMPORT_EVERY_MODULE).split()[0]) > 50
    assert "usage: specdec generate" in run(specdec, "generate", "--help")
    assert "usage: specdec serve" in run(specdec, "serve", "--help")
    assert "usage: specdec bench" in run(specdec, "bench", "--help")
    assert sys.prefix != str(env_dir)
