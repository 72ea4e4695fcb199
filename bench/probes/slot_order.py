"""Probe: does moving a transfer's slot pairs in host-slot order speed up scattered host slots?

Host pages scattered at random become ascending addresses in that order, and pages
that happen to be neighbours join into one run (longer, fewer copies). This times
the same transfers with and without that order, in one process, alternating A and
B: the bench's scattered rows for shapes that miss their target (layer_first
page-64 backups, page-major single tokens). Each cell is the median of three
medians of three after a warm-up; the ratio is to the contiguous copy measured at
the start.

Run 25 (``probe_slot_order_h200_run25.json``; then the engine put every backend's pairs
in that order): DMA gained on every case (scattered backups 0.67-0.81x -> 0.73-0.88x,
a page-64 backup and load at once 0.75x -> 0.82x of the duplex limit) and lost
nothing; the zero-copy kernel lost 0.01-0.05x on single tokens (MLA page_first
backup 0.87x -> 0.82x) and gained only on page_head loads (0.68x -> 0.80x). Since
then only the DMA backend sorts (``DMAConfig.sort_slots``), and this probe A/Bs it,
sorting whatever the copy size (the default now sorts only copies under
``DMAConfig.sort_below``). Run 28 added MLA page_first page-64 scattered pages, which
the full runs had slower in host-slot order (``probe_slot_order_h200.json``): sorted they
ran 0.871x against 0.925x as given (backup), 0.904x against 0.954x (load) and 0.757x
against 0.86x of the duplex limit (both); sorting still gained where copies are small
(MLA layer_first page-64 backup 0.70x -> 0.745x, MHA page_first page-1 backup 0.75x ->
0.883x). Hence ``sort_below`` (1 MiB). A third arm for that shape tests why: sorted, with every 1-D
copy cut into pieces of one page (4.5 MB), as the copies are as given (sorted, merged runs
make copies of 4.5-36 MB, uneven per chunk). Run 31 (``probe_slot_order_h200.json``; run 28's
is ``*_run28.json``): the pieces ran as slowly as sorted (backup 0.807x, load 0.853x, both
0.757x; as given 0.914x, 0.941x, 0.879x; sorted 0.847x, 0.812x, 0.784x), so uneven copy sizes
are not the cause; host-address order is what differs, and why it costs is not known.
Usage: python bench/probes/slot_order.py OUT.json [--tokens N]
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import numpy as np
import torch

from kvtier.bench.transfer import Case, measure
from kvtier.transfer import dma_plan
from kvtier.transfer import TransferEngine
from kvtier.transfer.dma import DMABackend, DMAConfig
from probelib import JsonLog, args, cell, start

PATH, TOKENS = args("/tmp/probe_slot_order.json")
log = JsonLog(PATH, tokens=TOKENS)

CASES = [  # kind, layout, page size, directions (all by DMA)
    # MLA page_first page-64 scattered pages by DMA fell from 0.91-0.93x one way and 1.52-1.54x
    # both (runs 22, 24: as given) to 0.80-0.87x and 1.24x (run 27, in host-slot order).
    ("mla", "page_first", 64, ("backup", "load", "both")),
    ("mla", "layer_first", 64, ("backup",)),
    ("mha", "page_first", 1, ("backup",)),
]
# Run 25 also had DSA and MHA layer_first page-64 backups, an MHA page_head page-1 load and an
# MLA page_first page-1 load, and an MLA layer_first page-64 pair.


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
    plain = dma_plan.split_copies

    def split(copies, max_pitch, tall=None):
        t, flat = plain(copies, max_pitch, tall)
        return t, cut(flat, piece)
    dma_plan.split_copies = split
    try:
        yield
    finally:
        dma_plan.split_copies = plain


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
