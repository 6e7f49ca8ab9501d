"""The allocator setting that keeps freed memory for reuse (specdec.memory)."""

from __future__ import annotations

import pytest

from specdec import memory


def test_system_setting_leaves_the_allocator_alone(monkeypatch) -> None:
    monkeypatch.setenv("SPECDEC_MALLOC", "system")
    assert memory.keep_freed_memory() is False


@pytest.mark.skipif(memory._mallopt() is None, reason="not glibc: nothing to set")
def test_glibc_takes_both_settings(monkeypatch) -> None:
    monkeypatch.delenv("SPECDEC_MALLOC", raising=False)
    try:
        assert memory.keep_freed_memory(False) is True
        assert memory.keep_freed_memory(True) is True
    finally:
        memory.keep_freed_memory(True)
