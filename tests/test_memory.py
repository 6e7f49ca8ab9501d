"""The allocator setting that keeps freed memory for reuse (specdec.memory): opt-in, and real."""

from __future__ import annotations

import subprocess
import sys

import pytest

from specdec import memory

# Run in a fresh process (glibc's thresholds cannot be reset once set): whether a large block is
# served by its own mapping (glibc's default) or from the heap (freed memory kept: up to 32 MiB),
# read from mallinfo2's count of mapped blocks. glibc raises its threshold to the size of a freed
# mapped block, so the second block is larger than the first.
PROBE = """
import ctypes, ctypes.util, os, sys
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def mapped(mib):
    before = libc.mallinfo2().hblks
    block = libc.malloc(mib << 20)
    during = libc.mallinfo2().hblks
    libc.free(block)
    return during > before
import specdec, specdec.api, specdec.cli, specdec.drafters
imported = mapped(24)
from specdec.memory import keep_freed_memory
took = keep_freed_memory()
print(imported, took, mapped(30))  # above the 24 MiB glibc's dynamic threshold has now learnt
"""


def _glibc_with_mallinfo2() -> bool:
    lib = memory._mallopt()
    if lib is None:
        return False
    import ctypes
    import ctypes.util

    return hasattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), "mallinfo2")


def _probe(env_extra: dict[str, str]) -> list[str]:
    import os

    env = {k: v for k, v in os.environ.items() if k != "SPECDEC_MALLOC"} | env_extra
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return out.stdout.split()


@pytest.mark.skipif(not _glibc_with_mallinfo2(), reason="not glibc >= 2.33: nothing to set or read")
def test_importing_specdec_leaves_the_allocator_alone_and_one_call_opts_in() -> None:
    imported, took, after = _probe({})
    assert imported == "True"  # glibc's default: a large block gets its own mapping
    assert took == "True" and after == "False"  # kept: served from the heap


@pytest.mark.skipif(not _glibc_with_mallinfo2(), reason="not glibc >= 2.33: nothing to set or read")
def test_system_setting_leaves_the_allocator_alone() -> None:
    imported, took, after = _probe({"SPECDEC_MALLOC": "system"})
    assert (imported, took, after) == ("True", "False", "True")


def test_system_setting_is_reported(monkeypatch) -> None:
    monkeypatch.setenv("SPECDEC_MALLOC", "system")
    assert memory.keep_freed_memory() is False


def test_the_command_line_opts_in(monkeypatch) -> None:
    from specdec import cli
    from specdec.cli import commands

    calls = []
    monkeypatch.setattr(commands, "keep_freed_memory", lambda *a: calls.append(a) or True)
    assert cli.main(["models", "--json"]) == 0
    assert calls == [()]
