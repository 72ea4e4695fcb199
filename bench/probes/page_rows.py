"""Probe: does the zero-copy kernel move whole pages faster as one row per page?

``KernelConfig.page_rows`` (after run 96): where a layer_first transfer moves whole pages,
the kernel copies each page's run (page_size x item bytes, contiguous on both sides) as one
row cut into power-of-two chunks, instead of one row per token. Run 96
(``probe_kernel_parts_h200.json``): DSA's index-K part alone (132-byte rows, moved in
4-byte words since 132 is not a multiple of 16) ran at 25 GB/s on backups and 32 on loads,
while the latent part alone ran at 51.6 and 50.4; side by side on two streams gained only
0.005-0.025x. As page rows, the index-K part's 8,448-byte page runs move in 16-byte words.

Here, layer_first page 64, scattered host pages as the transfer table draws them, huge-page
host pools, in turn per kind: the kernel backend with token rows, and with page rows cut at
8 KiB (the default), 1 KiB, and not cut; for DSA also the DMA backend (its index-K part goes
through the kernel beside the copies) with token rows and page rows, backups, loads and
pairs. GB/s through the engine, as the table times it.
Predictions: DSA kernel backups 0.846 -> 0.90-0.93x and loads 0.865 -> 0.89-0.91x (the
index part no longer at half the link's rate); DSA DMA backups gain less (0.01-0.03x: the
index part runs beside the copies); MLA and MHA within 0.01x either way (their rows already
move in 16-byte words), and cutting at 1 KiB or not at all within 0.01x of 8 KiB.
Usage: python bench/probes/page_rows.py OUT.json [--tokens N]
"""

from __future__ import annotations

import torch

from kvtier.bench.transfer import Case, measure
from kvtier.transfer import TransferEngine
from kvtier.transfer.dma import DMABackend, DMAConfig
from kvtier.transfer.kernel import KernelBackend, KernelConfig
from probelib import JsonLog, args, cell, in_turn, start

PATH, TOKENS = args("/tmp/probe_page_rows.json")
log = JsonLog(PATH, tokens=TOKENS)


def main() -> None:
    torch.cuda.set_stream(torch.cuda.Stream())
    clock, limits, rng = start(log)
    kernels = {"token rows": KernelConfig(page_rows=False), "page rows, 8 KiB": KernelConfig(),
               "page rows, 1 KiB": KernelConfig(page_chunk_bytes=1024),
               "page rows, uncut": KernelConfig(page_chunk_bytes=0)}
    for kind in ("dsa", "mla", "mha"):
        case = Case(kind, "layer_first", 64, TOKENS, "cuda", None)
        idx = case.indices(True, rng)
        engines = {f"kernel, {k}": TransferEngine(case.host, KernelBackend(c)) for k, c in kernels.items()}
        if kind == "dsa":
            for k in ("token rows", "page rows, 8 KiB"):
                engines[f"dma, {k}"] = TransferEngine(case.host, DMABackend(DMAConfig(), KernelBackend(kernels[k])))
        for direction in ("backup", "load", "both"):
            arms = {name: e for name, e in engines.items() if direction != "both" or name.startswith("dma")}
            if not arms:
                continue
            times = in_turn(arms, lambda e, dr=direction: measure(case, e, dr, idx, clock, 1))
            # A pair's ratio is to the one-way limit, as the table's (acceptance: >= 1.5x).
            limit = (limits["backup"] + limits["load"]) / 2 if direction == "both" else limits[direction]
            log(f"{kind}/layer_first/p64/scattered/{direction}", {k: cell(g, limit) for k, g in times.items()})
        case.host.close()
        del case, engines
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
