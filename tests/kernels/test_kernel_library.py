"""Building and loading the compiled kernels (:func:`specdec.kernels.build_library`).

- a library cut short (the SIGBUS case: it loads, then its code pages are past the end of the
  file) or emptied is built again, once, and then computes what it computed before; an intact one
  is not rebuilt;
- a library that fails to load even freshly built is one error saying why;
- no C compiler (none on PATH, or ``$CC`` naming nothing), and a compiler without OpenMP;
- the kernels live in the cache the run uses (``--cache-dir``), and on the command line a missing
  compiler is a one-line error with ``--backend gguf`` and a fallback to llama.cpp with ``auto``.

Libraries are loaded after damage only in child processes: a process that has loaded a library
keeps its mapping (a truncated file would fault there), and loading the same path again would
return that mapping, not the rebuilt file.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from specdec import kernels, packs
from specdec.paths import CACHE_ENV

GUMBEL_FLAGS = ["-O2", "-ffp-contract=off", "-shared", "-fPIC"]  # as specdec.sampling builds it
GUMBEL = "gumbel_interface"  # the function through which the library describes its interface
needs_cc = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                              reason="no C compiler on PATH")

# Builds (or loads) the Gumbel filter in the cache $SPECDEC_CACHE names and runs it once.
GUMBEL_CHILD = f"""
import ctypes
from specdec import kernels
lib = kernels.build_library("gumbel.c", {GUMBEL_FLAGS!r}, name="gumbel", interface="gumbel_interface")
fn = lib.gumbel_candidates
scores = (ctypes.c_double * 64)(*[0.25 * (i % 9) for i in range(64)])
out = (ctypes.c_int64 * 64)()
n = fn(scores, 64, 12345, 1.5, 1e-6, out, 64)
print(n, list(out[:n]))
"""

# Loads a GGUF file on specdec's kernel (built in the cache $SPECDEC_CACHE names) and prints the
# sha256 of the logits of a 3-token pass: their exact bits.
GGUF_CHILD = """
import hashlib, sys
from specdec.backends import gguf
model = gguf.load_gguf_native(sys.argv[1], n_threads=1, n_ctx=64)
logits = model.forward([504, 1070, 28], num_logits=1)
print(logits.shape, hashlib.sha256(logits.numpy().tobytes()).hexdigest())
"""


class Refused(RuntimeError):
    pass


def child(code: str, cache: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    environ = {**os.environ, CACHE_ENV: str(cache), **(env or {})}
    return subprocess.run([sys.executable, "-c", code, *args], env=environ, capture_output=True, text=True,
                          timeout=900)


def only(folder: Path, pattern: str) -> Path:
    found = sorted(folder.glob(pattern))
    assert len(found) == 1, found
    return found[0]


def stamp_of(library: Path) -> str:
    data = library.read_bytes()
    return f"{len(data)} {hashlib.sha256(data).hexdigest()}\n"


def script(path: Path, text: str) -> str:
    path.write_text("#!/bin/sh\n" + text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This process's kernels go to a fresh cache, the default one ($SPECDEC_CACHE; restored afterwards)."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(kernels, "_cache_dir", None, raising=False)
    return tmp_path / "cache"


# -- a damaged library ----------------------------------------------------------------------------


@needs_cc
def test_a_built_library_has_a_stamp_of_its_size_and_hash_and_is_not_rebuilt(tmp_path):
    first = child(GUMBEL_CHILD, tmp_path)
    assert first.returncode == 0, first.stderr
    library = only(tmp_path / "kernels", "gumbel-*.so")
    assert library.with_name(library.name + ".sha256").read_text() == stamp_of(library)
    inode = library.stat().st_ino
    again = child(GUMBEL_CHILD, tmp_path)
    assert again.returncode == 0 and again.stdout == first.stdout
    assert library.stat().st_ino == inode  # loaded as it was, not built again


@needs_cc
@pytest.mark.parametrize("damage", ["truncated to 4096 bytes", "emptied", "a page zeroed, same size", "no stamp"])
def test_a_damaged_library_is_built_again_and_computes_what_it_computed(tmp_path, damage):
    first = child(GUMBEL_CHILD, tmp_path)
    assert first.returncode == 0, first.stderr
    library = only(tmp_path / "kernels", "gumbel-*.so")
    size, inode = library.stat().st_size, library.stat().st_ino
    assert size > 4096
    if damage.startswith("truncated"):
        os.truncate(library, 4096)  # in place, as `truncate -s 4096` does
    elif damage == "emptied":
        os.truncate(library, 0)
    elif damage.startswith("a page"):
        with open(library, "r+b") as f:
            f.seek(4096)
            f.write(bytes(4096))
    else:
        library.with_name(library.name + ".sha256").unlink()
    again = child(GUMBEL_CHILD, tmp_path)
    assert again.returncode == 0, (again.returncode, again.stderr)
    assert again.stdout == first.stdout
    assert library.stat().st_ino != inode and library.stat().st_size == size  # a new file, built whole
    assert library.with_name(library.name + ".sha256").read_text() == stamp_of(library)


def test_a_library_that_never_loads_is_built_once_more_then_the_error_says_why(cache, tmp_path, monkeypatch):
    log = tmp_path / "cc.log"
    junk = script(tmp_path / "cc", f'echo run >> "{log}"\n'
                                   'while [ $# -gt 0 ]; do [ "$1" = -o ] && printf "not a library" > "$2"; shift; done\n')
    monkeypatch.setenv("CC", junk)
    with pytest.raises(Refused, match=r"^loading .*gumbel-\w+\.so failed: .*"):
        kernels.build_library("gumbel.c", GUMBEL_FLAGS, name="gumbel", interface=GUMBEL, error=Refused)
    assert log.read_text().count("run") == 1  # built just now: not built again
    # now it matches its stamp but does not load: built again once, then the same error
    with pytest.raises(Refused, match=r"^loading .*gumbel-\w+\.so failed"):
        kernels.build_library("gumbel.c", GUMBEL_FLAGS, name="gumbel", interface=GUMBEL, error=Refused)
    assert log.read_text().count("run") == 2


# -- the interface each library describes ------------------------------------------------------------


@needs_cc
def test_every_library_is_declared_from_its_own_description_and_no_python_file_repeats_a_signature():
    """Each source in csrc/ lists its exported functions once and returns their prototypes as text;
    the functions are declared to ctypes from that text alone (specdec.kernels.declare)."""
    import re
    from importlib import resources

    from specdec import sampling
    from specdec.backends import gguf
    from specdec.bench import machine

    loaded = {"gumbel_interface": sampling._filter(), "read_speed_interface": machine._read_library(),
              "gguf_interface": gguf.library()}
    if kernels.status() == "available":  # x86-64 with AVX2
        loaded["linear_bf16_interface"] = kernels._load()
    for interface, lib in loaded.items():
        describe = getattr(lib, interface)
        functions, _ = kernels.parse_interface(describe().decode())
        assert functions, interface
        for name, (args, result) in functions.items():
            assert getattr(lib, name).argtypes == args and getattr(lib, name).restype == result, name
    functions, _ = kernels.parse_interface(sampling._filter().gumbel_interface().decode())
    assert functions == {"gumbel_candidates": ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64, ctypes.c_double,
                                                ctypes.c_double, ctypes.c_void_p, ctypes.c_int64], ctypes.c_int64)}
    sources = resources.files("specdec").joinpath("csrc")
    for source in sources.iterdir():
        if source.name.endswith(".c"):
            assert re.search(r"const char \*\w+_interface\(void\)", source.read_text()), source.name
    package = Path(kernels.__file__).parent
    by_hand = [str(path.relative_to(package)) for path in package.rglob("*.py")
               if path.name != "kernels.py" and re.search(r"\.(argtypes|restype)\s*=", path.read_text())]
    assert by_hand == []


# -- the compiler ---------------------------------------------------------------------------------


def test_no_compiler_on_path_is_the_given_error(cache, tmp_path, monkeypatch):
    monkeypatch.delenv("CC", raising=False)
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(Refused) as err:
        kernels.build_library("gumbel.c", GUMBEL_FLAGS, name="gumbel", interface=GUMBEL, error=Refused)
    assert str(err.value) == "no C compiler found (install gcc, or set CC)"


def test_a_compiler_named_by_cc_that_does_not_exist_is_the_given_error(cache, monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with pytest.raises(Refused) as err:
        kernels.build_library("gumbel.c", GUMBEL_FLAGS, name="gumbel", interface=GUMBEL, error=Refused)
    assert str(err.value) == ("cannot run the C compiler /nonexistent/cc: No such file or directory "
                              "(install gcc, or set CC to a compiler that runs)")


@needs_cc
def test_a_built_library_loads_without_a_compiler(tmp_path, monkeypatch):
    assert child(GUMBEL_CHILD, tmp_path).returncode == 0
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(kernels, "_cache_dir", None, raising=False)
    monkeypatch.delenv("CC", raising=False)
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    lib = kernels.build_library("gumbel.c", GUMBEL_FLAGS, name="gumbel", interface=GUMBEL, error=Refused)
    assert isinstance(lib, ctypes.CDLL)


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc")
def test_a_compiler_without_openmp_builds_the_serial_library(cache, tmp_path, monkeypatch):
    log = tmp_path / "cc.log"
    cc = script(tmp_path / "cc", f'echo "$*" >> "{log}"\n'
                                 'for a in "$@"; do [ "$a" = -fopenmp ] && { echo "unsupported option -fopenmp" >&2; exit 1; }; done\n'
                                 f'exec {shutil.which("gcc")} "$@"\n')
    monkeypatch.setenv("CC", cc)
    flags = [*GUMBEL_FLAGS, "-fopenmp"]
    with pytest.raises(Refused, match=r"^compiling .*gumbel-omp-\w+\.c failed: unsupported option -fopenmp$"):
        kernels.build_library("gumbel.c", flags, name="gumbel-omp", interface=GUMBEL, error=Refused)
    assert not list(cache.glob("kernels/*.so")) and not list(cache.glob("kernels/*.tmp"))
    lib = kernels.build_library("gumbel.c", flags, name="gumbel-omp", interface=GUMBEL, error=Refused,
                                serial_fallback=True)
    runs = log.read_text().splitlines()
    assert len(runs) == 3 and "-fopenmp" in runs[1] and "-fopenmp" not in runs[2]
    assert lib.gumbel_candidates is not None


# -- the GGUF kernel, the cache directory and the command line ---------------------------------------


@pytest.fixture(scope="module")
def smollm2() -> Path:
    """SmolLM2-135M's GGUF file (Q4_1), a .gguf path: nothing of it goes into the caches under test."""
    pack = packs.PACKS["smollm2-135m"]
    missing = packs.missing_parts(pack)
    if missing:
        pytest.skip(f"pack smollm2-135m is not installed: {pack.install_command(missing)}")
    return packs.gguf_file(pack, progress=False)


@pytest.fixture(scope="module")
def gguf_run(tmp_path_factory, smollm2) -> tuple[Path, Path, subprocess.CompletedProcess]:
    """``specdec generate --backend gguf --cache-dir C`` with $SPECDEC_CACHE another folder D: (C, D, the run)."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler on PATH")
    chosen, default = tmp_path_factory.mktemp("chosen"), tmp_path_factory.mktemp("default")
    run = subprocess.run(
        [sys.executable, "-m", "specdec", "generate", "the", "--target", str(smollm2), "--draft", "none",
         "--backend", "gguf", "--cache-dir", str(chosen), "--max-new-tokens", "3", "--threads", "1"],
        env={**os.environ, CACHE_ENV: str(default)}, capture_output=True, text=True, timeout=900,
    )
    return chosen, default, run


def test_the_gguf_kernel_is_built_in_the_cache_dir_the_command_names(gguf_run):
    chosen, default, run = gguf_run
    assert run.returncode == 0, run.stderr
    library = only(chosen / "kernels", "linear_gguf-*.so")
    assert library.with_name(library.name + ".sha256").read_text() == stamp_of(library)
    assert not (default / "kernels").exists()


def test_a_truncated_gguf_kernel_is_built_again_with_the_same_logits(gguf_run, smollm2, tmp_path):
    chosen, _, run = gguf_run
    assert run.returncode == 0, run.stderr
    shutil.copytree(chosen / "kernels", tmp_path / "kernels")
    before = child(GGUF_CHILD, tmp_path, str(smollm2))
    assert before.returncode == 0, before.stderr
    library = only(tmp_path / "kernels", "linear_gguf-*.so")
    size = library.stat().st_size
    os.truncate(library, 4096)
    after = child(GGUF_CHILD, tmp_path, str(smollm2))
    assert after.returncode == 0, (after.returncode, after.stderr)  # not -7 (SIGBUS)
    assert after.stdout == before.stdout and after.stdout.strip()
    assert library.stat().st_size == size


def no_compiler_env(tmp_path: Path) -> dict[str, str]:
    """The environment of a machine without a C compiler: an empty PATH (python runs by its full path)."""
    (tmp_path / "bin").mkdir()
    env = {k: v for k, v in os.environ.items() if k != "CC"}
    return {**env, "PATH": str(tmp_path / "bin"), CACHE_ENV: str(tmp_path / "cache")}


def generate_without_compiler(smollm2: Path, tmp_path: Path, backend: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "specdec", "generate", "the", "--target", str(smollm2), "--draft", "none",
         "--backend", backend, "--max-new-tokens", "3", "--threads", "1"],
        env=no_compiler_env(tmp_path), capture_output=True, text=True, timeout=600,
    )


def test_backend_gguf_without_a_compiler_is_a_one_line_error_naming_llamacpp(smollm2, tmp_path):
    run = generate_without_compiler(smollm2, tmp_path, "gguf")
    assert run.returncode == 1 and run.stdout == ""
    assert "Traceback" not in run.stderr
    assert run.stderr.splitlines()[-2:] == [
        "specdec: error: specdec's GGUF kernel could not be built: no C compiler found (install gcc, or set CC)",
        "hint: the llama.cpp backend (--backend llamacpp) can run it",
    ]


def test_backend_auto_without_a_compiler_runs_on_llamacpp(smollm2, tmp_path):
    from specdec.backends import llamacpp

    if not llamacpp.available():
        pytest.skip("llama-cpp-python is not installed")
    run = generate_without_compiler(smollm2, tmp_path, "auto")
    assert run.returncode == 0, run.stderr
    assert "Traceback" not in run.stderr
    assert ("runs on llama.cpp: specdec's GGUF kernel could not be built (no C compiler found (install gcc, or set CC))"
            in run.stderr)
