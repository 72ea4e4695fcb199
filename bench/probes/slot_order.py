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
0.883x). Hence ``sort_below`` (1 MiB).
Usage: python bench/probes/slot_order.py OUT.json [--tokens N]
"""

from __future__ import annotations

import torch

from kvtier.bench.transfer import Case, measure
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


def main():
    clock, limits, rng = start(log)
    for kind, layout, ps, directions in CASES:
        case = Case(kind, layout, ps, TOKENS, "cuda", None)
        idx = case.indices(True, rng)
        engines = {}
        for order in (True, False):
            engines[order] = TransferEngine(case.host, "dma")
            # sorted whatever the copy size (sort_below: the default sorts only small copies)
            engines[order].backend = DMABackend(DMAConfig(sort_slots=order, sort_below=1 << 62))
        for direction in directions:
            times = {True: [], False: []}
            for _ in range(3):
                for order, eng in engines.items():
                    times[order].append(measure(case, eng, direction, idx, clock, 3))
            limit = limits["duplex" if direction == "both" else direction]
            row = {("sorted" if order else "as given"): cell(g, limit) for order, g in times.items()}
            log(f"{kind}/{layout}/p{ps}/{direction}/dma", row)
        del engines, case
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
