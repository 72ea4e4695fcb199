"""What the CPU transfer tests of the engine and of its benchmark share (test_transfer_engine_cpu.py,
test_transfer_bench_cpu.py): a small host reserve, an autouse fixture each imports."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _small_reserve(monkeypatch):
    monkeypatch.setenv("KVTIER_HOST_RESERVE_GB", "0.5")
