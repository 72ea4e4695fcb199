"""Probe: a backup and a load at once on scattered layer_first page-64 pages, each by the way
that is best for it alone?

Run 93 (huge-page pools): one way, the zero-copy kernel is best for these backups (MHA
0.932x, MLA 0.920x, DSA 0.822x) and DMA for the loads (0.952x, 0.926x, 0.897x); at once, DMA
both ways reached 1.472x (MHA), 1.433x (MLA), 1.211x (DSA), the kernel both ways 0.98-1.11x,
and `auto` 1.499x, 1.439x, 1.211x. Not timed yet: the backup by the kernel and the load by
DMA together (or the other way round).

Arms, in turn, per kind, one device pool and one huge-page host pool, the same slots as the
table's scattered pairs: ``dma + dma``, ``kernel + kernel``, ``kernel backup + dma load``,
``dma backup + kernel load``, ``auto``; GB/s of both transfers' bytes over the pair's time,
ratio to the one-way limit (as the table's ``both``).
Predictions: if the kernel's writes to the host and the copy engine's reads from it share
the link as two copy streams do, ``kernel backup + dma load`` reaches 1.5x or more for MHA and
MLA; if the kernel takes the link as DSA's index-K kernel did beside copies (the copy engine
at 11-13 GB/s, run 84), it lands near the kernel's own pairs (1.1-1.3x).
Run 95 (``probe_pair_mix_h200.json``): the second. ``kernel backup + dma load`` 1.085x (MLA),
1.087x (MHA), 1.145x (DSA), as the kernel both ways (1.093x, 1.142x, 1.012x); ``dma backup +
kernel load`` 1.285x, 1.207x, 1.190x; DMA both ways 1.397x, 1.538x, 1.267x, and ``auto``
with it (1.394x, 1.519x, 1.245x). A zero-copy transfer beside copies the other way holds the
pair near one direction's rate, so the pairs go by DMA both ways, as ``auto`` already sends
them; what they lack is DMA's own pair rate on page-long host rows.

After run 112 (not yet run): ``--case kind/layout/page`` (repeatable; default the three
above) times the same arms on other rows, scattered. For `auto` on single-token pairs
(run 111: MHA page_head 0.97x against the kernel's 1.05x; DMA's pairs there are host-bound,
their load call returning after 70-110 ms): ``--case mha/page_head/1 --case
mha/page_first/1 --case mla/page_first/1 --case mha/layer_first/64``. Predictions there:
the kernel both ways 1.03-1.08x, steadiest; DMA both ways 0.96-1.15x; ``kernel backup + dma
load`` near the kernel's own pair; ``auto`` at or below DMA both ways (it sends both by DMA).
Usage: python bench/probes/pair_mix.py OUT.json [--tokens N] [--case KIND/LAYOUT/PAGE ...]
"""

from __future__ import annotations

import sys

import torch

from kvtier.bench.transfer import Case, measure
from kvtier.transfer import TransferEngine
from kvtier.transfer.base import Backend, get_backend
from probelib import JsonLog, args, cell, in_turn, start

PATH, TOKENS = args("/tmp/probe_pair_mix.json")
CASES = [(k, lay, int(ps)) for k, lay, ps in
         (sys.argv[i + 1].split("/") for i, a in enumerate(sys.argv) if a == "--case")] or \
    [(k, "layer_first", 64) for k in ("mla", "mha", "dsa")]
log = JsonLog(PATH, tokens=TOKENS, cases=["/".join(map(str, c)) for c in CASES])


class Split(Backend):
    """Backups by one backend, loads by another (each as the engine would call it alone)."""

    name = "split"

    def __init__(self, up, down):
        self.up, self.down = up, down

    def prepare(self, parts, host_idx, dev_idx, to_host, block_quota=None, whole=True, host_np=None, dev_np=None):
        b = self.up if to_host else self.down
        if b.name == "kernel":
            return b.prepare(parts, host_idx, dev_idx, to_host, block_quota, host_np=host_np)
        return b.prepare(parts, host_idx, dev_idx, to_host, block_quota, whole, host_np=host_np, dev_np=dev_np)

    def backup(self, parts, host_idx, dev_idx, block_quota=None):
        self.prepare(parts, host_idx, dev_idx, True, block_quota)(None)

    def load(self, parts, host_idx, dev_idx, layer):
        self.prepare(parts, host_idx, dev_idx, False, whole=False)(layer)


def main() -> None:
    torch.cuda.set_stream(torch.cuda.Stream())
    clock, limits, rng = start(log)
    dev = torch.device("cuda")
    kernel, dma = get_backend("kernel", dev), get_backend("dma", dev)
    for kind, layout, ps in CASES:
        case = Case(kind, layout, ps, TOKENS, "cuda", None)
        idx = case.indices(True, rng)
        engines = {"dma + dma": TransferEngine(case.host, "dma"), "kernel + kernel": TransferEngine(case.host, "kernel"),
                   "kernel backup + dma load": TransferEngine(case.host, Split(kernel, dma)),
                   "dma backup + kernel load": TransferEngine(case.host, Split(dma, kernel)),
                   "auto": TransferEngine(case.host, "auto")}
        times = in_turn({k: (lambda e=e: measure(case, e, "both", idx, clock, 1)) for k, e in engines.items()},
                        lambda fn: fn(), warmups=1, rounds=3)
        log(f"{kind}/{layout}/p{ps}/scattered/both", {k: cell(g, limits["backup"]) for k, g in times.items()})
        case.host.close()
        del case, engines
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
