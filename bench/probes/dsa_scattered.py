"""Probe: why DSA layer_first page-64 loads from scattered host pages miss 0.9x.

Run 71: 0.87x by dma (run 65: 0.89x), where MLA's same row (the same latent part, without
the index-K part) loaded at 0.91x. A DSA pool adds each layer's index-K rows (132 B a
token: 8.4 KB a page-64 page), and the DMA backend sends a part whose copies would average
under ``DMAConfig.kernel_below`` (32 KiB) through the zero-copy kernel: so its loads move the
latent pages (73.7 KB a page and layer) by copies and the index-K pages by the kernel, both
over the host-to-device link at once.

Arms, timed in turn in one process on the same scattered slots, per-layer loads, 32,768
tokens: the default (index-K by the kernel), ``kernel_below=0`` (both parts by copies),
``kernel_below`` above the latent pages' size (both by the kernel), and for reference the
MLA pool of the same shape. Logged: GB/s and ratio to the limit, by the DSA pool's bytes.
Predictions: if the kernel and the copies slow each other, both-by-copies beats the default;
if the index-K copies are too small for the copy engine (batched 16 KiB copies moved 8.8 GB/s
host to device, ``probe_copy_paths_h200.json``), the default stays best and the row is bound
like the single-token ones.
Usage: python bench/probes/dsa_scattered.py OUT.json [--tokens N]
"""

from __future__ import annotations

import torch

from kvtier.bench.transfer import Case, measure
from kvtier.transfer import TransferEngine
from kvtier.transfer.dma import DMABackend, DMAConfig
from probelib import JsonLog, args, cell, in_turn, start

PATH, TOKENS = args("/tmp/probe_dsa_scattered.json")
log = JsonLog(PATH, tokens=TOKENS)


def main():
    clock, limits, rng = start(log)
    cases = {kind: Case(kind, "layer_first", 64, TOKENS, "cuda", None) for kind in ("dsa", "mla")}
    idx = {kind: c.indices(True, rng) for kind, c in cases.items()}
    dsa = cases["dsa"].host
    arms = {
        "default (index-K by the kernel)": ("dsa", TransferEngine(dsa, "dma")),
        "both parts by copies": ("dsa", TransferEngine(dsa, DMABackend(DMAConfig(kernel_below=0)))),
        "both parts by the kernel": ("dsa", TransferEngine(dsa, DMABackend(DMAConfig(kernel_below=1 << 20)))),
        "mla, same shape (dma)": ("mla", TransferEngine(cases["mla"].host, "dma")),
    }

    def load(arm):
        kind, eng = arm
        return measure(cases[kind], eng, "load", idx[kind], clock, 3)
    rates = in_turn(arms, load, warmups=1, rounds=3)
    log("layer_first/p64/scattered/load", {k: cell(v, limits["load"]) for k, v in rates.items()})
    for c in cases.values():
        c.host.close()
    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
