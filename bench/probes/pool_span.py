"""Probe: do scattered backups slow as the host pool grows around the same transfer?

Run 105 (``probe_row_pitch_h200_*.json``): the kernel wrote MLA's single-token rows to
scattered host slots at 0.94x packed (the pool twice the transfer, half of each 2 MiB page
written), 0.94x with a 1,280-byte pitch, 0.81-0.88x with 1,536 and 0.66-0.69x with 2,048 (a
quarter of each page written); loads 0.90-0.91x at every pitch. So writes, not reads, slow
as a transfer's bytes thin out over more host pages. A cache's host pool is many times one
transfer, and its free pages scatter over all of it.

Here, MLA layer_first, the same 32k-token transfer (device slots scattered) to host pages
drawn at random from a pool 2x (as the table), 4x and 8x its size, huge pages, in turn per
pool: page 1 by the kernel; page 64 by the kernel and by DMA; backups and per-layer loads
through the engine.
Predictions: kernel backups fall with the pool (page 1: 0.94 -> about 0.8 -> 0.66x at 8x),
kernel loads and DMA within 0.02x at every size.
Usage: python bench/probes/pool_span.py OUT.json [--tokens N]
"""

from __future__ import annotations

import torch

from kvtier.bench.transfer import Case
from kvtier.transfer import TransferEngine
from probelib import JsonLog, args, cell, in_turn, spread_pool, start, transfer

PATH, TOKENS = args("/tmp/probe_pool_span.json")
log = JsonLog(PATH, tokens=TOKENS)


def main() -> None:
    torch.cuda.set_stream(torch.cuda.Stream())
    clock, limits, rng = start(log)
    for ps, backends in ((1, ("kernel",)), (64, ("kernel", "dma"))):
        case = Case("mla", "layer_first", ps, TOKENS, "cuda", None)
        d = case.indices(True, rng)[1]
        case.host.close()
        for span in (2, 4, 8):
            host, h = spread_pool(case, span, rng)
            engines = {b: TransferEngine(host, b) for b in backends}
            log(f"mla/layer_first/p{ps}/pool {span}x/huge_page_share", round(host.huge_page_share(), 3))
            for direction, to_host in (("backup", True), ("load", False)):
                times = in_turn(engines, lambda e, t=to_host: case.nbytes / clock.once(
                    lambda: transfer(e, h, d, t)) / 1e9)
                log(f"mla/layer_first/p{ps}/pool {span}x/{direction}",
                    {k: cell(g, limits[direction]) for k, g in times.items()})
            host.close()
            del host, engines
        del case
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
