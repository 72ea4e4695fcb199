"""Probe: in a large host pool, do single-token kernel backups recover in host-slot order?

Run 106 (``probe_pool_span_h200.json``): the kernel's MLA single-token backups to host slots
drawn from a pool 2x, 4x and 8x the transfer ran at 0.914x, 0.645x and 0.548x (loads
0.89-0.90x at every size; page-64 kernel backups 0.90-0.915x): writes slow as a transfer's
bytes thin out over more 2 MiB host pages, as if the GPU's translations for host memory
missed. The kernel moves slot pairs in the caller's order (random here), so the rows in
flight at once lie anywhere in the pool; in host-slot order they lie in a few pages.
(Before huge pages, at a 2x pool, host order cost the kernel 0.01-0.05x, runs 25 and 28.)

Here, MLA layer_first page 1, the same transfer to host slots drawn from a pool 2x and 8x
its size, huge pages, kernel backend through the engine, in turn: the pairs as drawn, and
sorted by host slot (device slots permuted alike). Backups and per-layer loads.
Predictions: at 8x, sorted backups +0.2x or more (towards the 2x pool's 0.91x); at 2x within
0.03x; loads within 0.02x.
Usage: python bench/probes/host_order_span.py OUT.json [--tokens N]
"""

from __future__ import annotations

import torch

from kvtier.bench.transfer import Case
from kvtier.transfer import TransferEngine
from probelib import JsonLog, args, cell, in_turn, spread_pool, start, transfer

PATH, TOKENS = args("/tmp/probe_host_order_span.json")
log = JsonLog(PATH, tokens=TOKENS)


def main() -> None:
    torch.cuda.set_stream(torch.cuda.Stream())
    clock, limits, rng = start(log)
    case = Case("mla", "layer_first", 1, TOKENS, "cuda", None)
    d = case.indices(True, rng)[1]
    case.host.close()
    for span in (8, 2):
        host, h = spread_pool(case, span, rng)
        order = torch.argsort(h)
        pairs = {"as drawn": (h, d), "host order": (h[order], d[order])}
        eng = TransferEngine(host, "kernel")
        for direction, to_host in (("backup", True), ("load", False)):
            times = in_turn(pairs, lambda p, t=to_host: case.nbytes / clock.once(
                lambda: transfer(eng, p[0], p[1], t)) / 1e9)
            log(f"mla/layer_first/p1/pool {span}x/{direction}", {k: cell(g, limits[direction]) for k, g in times.items()})
        host.close()
        del host, eng


if __name__ == "__main__":
    main()
