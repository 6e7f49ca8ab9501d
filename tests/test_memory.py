"""The allocator setting that keeps freed memory for reuse (specdec.memory)."""

from __future__ import annotations

import pytest
import torch

from specdec import memory


def test_system_setting_leaves_the_allocator_alone(monkeypatch) -> None:
    monkeypatch.setenv("SPECDEC_MALLOC", "system")
    assert memory.keep_freed_memory() is False


@pytest.mark.skipif(memory._mallopt() is None, reason="not glibc: nothing to set")
def test_glibc_takes_both_settings_and_results_do_not_change(monkeypatch) -> None:
    monkeypatch.delenv("SPECDEC_MALLOC", raising=False)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 151936, generator=gen)
    try:
        assert memory.keep_freed_memory(False) is True
        handed_back = torch.softmax(logits, -1)
        assert memory.keep_freed_memory(True) is True
        kept = torch.softmax(logits, -1)
    finally:
        memory.keep_freed_memory(True)
    assert torch.equal(handed_back, kept)
