"""The acceptance targets of ``kvtier bench transfer`` rows (each transfer's ratio to the
contiguous-copy limit it must reach), and how ratios are shown against them
(``bench/acceptance.py``, the bench's table and its figure)."""

from __future__ import annotations

import math

# The acceptance targets: 0.95x one way for these on host slots as the allocator hands them
# out, 0.9x for the other one-way rows (page_head, DSA, scattered slots), 1.5x both at once;
# page sizes 1 and 64 only.
TARGET_95 = {("mha", "layer_first"), ("mha", "page_first"), ("mla", "layer_first"), ("mla", "page_first")}


def target(r: dict) -> float | None:
    """A row's target (``r``: a JSON row), or None where it is not one of the 72 acceptance
    rows (page 16, spread pools, the contiguous limit's own rows)."""
    if r["kind"] == "all" or r["host_slots"] not in ("allocator", "scattered") or r["page_size"] not in (1, 64):
        return None
    if r["direction"] == "both":
        return 1.5
    return 0.95 if r["host_slots"] == "allocator" and (r["kind"], r["layout"]) in TARGET_95 else 0.9


def ratio_text(ratio: float) -> str:
    """``ratio`` cut (not rounded) to three decimals: 0.9497 shows as 0.949, never as the 0.95
    it misses."""
    return f"{math.floor(ratio * 1000 + 1e-9) / 1000:.3f}"
