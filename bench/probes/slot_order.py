"""Probe: does moving a transfer's slot pairs in host-slot order speed up scattered host slots?

Scattered host pages become ascending addresses in that order, and pages that happen to be
neighbours join into one longer copy. In one process, in turn, the DMA backend with
``sort_slots`` on (sorting whatever the copy size) and off, on 32k-token transfers to scattered
host slots: MLA page_first page 64 (backup, load, both; 4.5 MB copies, plus a third arm, sorted
with every copy cut into 4.5 MB pieces), MLA layer_first page-64 backups and MHA page_first
single-token backups (short copies). Each cell: the median of three medians of three.

Run: ``PYTHONPATH=.:bench/probes python bench/probes/slot_order.py OUT.json [--tokens N]``.
Backs: ``DMAConfig.sort_slots`` (short copies gain: 0.754x -> 0.857x, 0.697x -> 0.755x) and
``sort_below`` = 1 MiB (4.5 MB copies lose when sorted: 0.914x -> 0.847x backup, 0.941x -> 0.812x
load; cut into 4.5 MB pieces as slowly, so host-address order itself is what costs).
Current answer: ``bench/results/h200/probes.json ("slot_order")``.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import numpy as np
import torch

from kvtier.bench.transfer import Case, measure
from kvtier.transfer.dma import chunked as chunked_mod, plan as plan_mod
from kvtier.transfer import TransferEngine
from kvtier.transfer.dma import DMABackend, DMAConfig
from probelib import JsonLog, args, cell, start

PATH, TOKENS = args("/tmp/probe_slot_order.json")
log = JsonLog(PATH, tokens=TOKENS)

CASES = [  # kind, layout, page size, directions (all by DMA)
    ("mla", "page_first", 64, ("backup", "load", "both")),  # long copies (4.5 MB)
    ("mla", "layer_first", 64, ("backup",)),  # short copies (72 KiB a page and layer)
    ("mha", "page_first", 1, ("backup",)),  # a token's layers of K or V: 64 KiB copies
]


PIECE = 64 * 61 * 1152  # one MLA page-64 page of every layer: 4.5 MB


def cut(flat: np.ndarray, piece: int) -> np.ndarray:
    """1-D copies ``(host_off, stg_off, width)`` cut into pieces of at most ``piece`` bytes."""
    n = -(-flat[:, 2] // piece)
    k = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
    width = np.repeat(flat[:, 2], n)
    out = np.stack([np.repeat(flat[:, 0], n) + k * piece, np.repeat(flat[:, 1], n) + k * piece,
                    np.minimum(piece, width - k * piece)], axis=1)
    return out.astype(np.int64)


@contextmanager
def pieces(piece: int):
    """While active, DMA plans cut their 1-D copies into pieces (this probe's third arm)."""
    plain = plan_mod.split_copies

    def split(copies, max_pitch, tall=None):
        t, flat = plain(copies, max_pitch, tall)
        return t, cut(flat, piece)
    plan_mod.split_copies = chunked_mod.split_copies = split
    try:
        yield
    finally:
        plan_mod.split_copies = chunked_mod.split_copies = plain


def main():
    clock, limits, rng = start(log)
    for kind, layout, ps, directions in CASES:
        case = Case(kind, layout, ps, TOKENS, "cuda", None)
        idx = case.indices(True, rng)
        arms = {"sorted": True, "as given": False}
        if (kind, layout) == ("mla", "page_first"):
            arms["sorted, 4.5 MB pieces"] = True
        engines = {}
        for arm, order in arms.items():
            engines[arm] = TransferEngine(case.host, "dma")
            # sorted whatever the copy size (sort_below: the default sorts only small copies)
            engines[arm].backend = DMABackend(DMAConfig(sort_slots=order, sort_below=1 << 62))
        for direction in directions:
            times = {arm: [] for arm in arms}
            for _ in range(3):
                for arm, eng in engines.items():
                    with pieces(PIECE) if "pieces" in arm else nullcontext():
                        times[arm].append(measure(case, eng, direction, idx, clock, 3))
            limit = limits["duplex" if direction == "both" else direction]
            log(f"{kind}/{layout}/p{ps}/{direction}/dma", {arm: cell(g, limit) for arm, g in times.items()})
        del engines, case
        torch.cuda.empty_cache()

if __name__ == "__main__":
    main()
