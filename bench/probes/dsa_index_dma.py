"""Probe: DSA's index-K pages by the kernel or by the copy engines, in pairs and one way?

Run 95 (``probe_pair_mix_h200.json``): with the zero-copy kernel moving one direction of a
backup+load pair while the copy engines move the other, the pair fell to the kernel's own
pair rate (1.09-1.15x). The DMA backend sends DSA's index-K part (8,448-byte page runs at
page 64 on scattered pages, under ``kernel_below``) through the kernel, in backups and loads,
so a DSA pair by DMA has the kernel both ways for a tenth of its bytes: 1.40x in runs 97-98,
MLA's (no such part) 1.38-1.44x.

Here, DSA layer_first page 64, scattered host pages, huge-page pools, in turn: the DMA
backend as it is (index-K by the kernel, beside the copies in backups), and with
``kernel_below=0`` (every part by the copy engines: 8,448-byte copies for the index-K);
backups, per-layer loads and pairs, GB/s through the engine as the table times them.
Predictions: one way, copies lose 0.02-0.05x (short copies run far below the link); pairs
within 0.03x either way (the index-K is a tenth of the bytes).
Usage: python bench/probes/dsa_index_dma.py OUT.json [--tokens N]
"""

from __future__ import annotations

import torch

from kvtier.bench.transfer import Case, measure
from kvtier.transfer import TransferEngine
from kvtier.transfer.dma import DMABackend, DMAConfig
from probelib import JsonLog, args, cell, in_turn, start

PATH, TOKENS = args("/tmp/probe_dsa_index_dma.json")
log = JsonLog(PATH, tokens=TOKENS)


def main() -> None:
    torch.cuda.set_stream(torch.cuda.Stream())
    clock, limits, rng = start(log)
    case = Case("dsa", "layer_first", 64, TOKENS, "cuda", None)
    idx = case.indices(True, rng)
    engines = {"dma, index-K by the kernel": TransferEngine(case.host, DMABackend(DMAConfig())),
               "dma, index-K by copies": TransferEngine(case.host, DMABackend(DMAConfig(kernel_below=0)))}
    for direction in ("backup", "load", "both"):
        times = in_turn(engines, lambda e, dr=direction: measure(case, e, dr, idx, clock, 1))
        limit = (limits["backup"] + limits["load"]) / 2 if direction == "both" else limits[direction]
        log(f"dsa/layer_first/p64/scattered/{direction}", {k: cell(g, limit) for k, g in times.items()})
    case.host.close()


if __name__ == "__main__":
    main()
