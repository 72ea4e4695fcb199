"""Probe: do the copy engine and the zero-copy kernel, each moving part of one transfer at
the same time, add up where each alone falls short?

The rows still short of 0.95x are scattered host slots whose copies are small: layer_first
page-64 backups (one 73-128 KB piece per run and layer; DMA 0.73-0.88x, the kernel
0.79-0.90x) and single tokens (only the kernel moves them, at 0.86-0.91x). Each engine
alone seems limited by its per-copy or per-transaction cost, not by the link. This
probe splits the slot pairs of one transfer: the first fraction ``f`` (whole pages) by a
DMA engine, the rest by a kernel engine, both queued at once (each engine has its own
streams), and times the whole, as the bench times one transfer. ``f`` = 0 is the kernel
alone, 1 DMA alone. Each cell is the median of three medians of three after a warm-up;
the ratio is to the contiguous copy measured at the start.

Run 27 (``probe_split_engines_h200.json``): no. Every split fell between the two engines
alone, nearer the slower the larger its share: layer_first page-64 backups by the kernel
alone MLA 0.873x, DSA 0.809x, MHA 0.905x, a quarter by DMA 0.867/0.792/0.891x, DMA alone
0.799/0.712/0.853x; MHA page_first single-token loads the other way round (DMA alone 0.926x,
the kernel 0.867x). The engines share what limits them, so splitting is not pursued.
Usage: python bench/probes/split_engines.py OUT.json [--tokens N]
"""

from __future__ import annotations

import torch

from kvtier.bench.transfer import Case
from kvtier.transfer import TransferEngine
from kvtier.transfer.dma import DMABackend, DMAConfig
from probelib import JsonLog, args, cell, start

PATH, TOKENS = args("/tmp/probe_split_engines.json")
log = JsonLog(PATH, tokens=TOKENS)

CASES = [  # kind, layout, page size, direction; host slots scattered
    ("mla", "layer_first", 64, "backup"),
    ("dsa", "layer_first", 64, "backup"),
    ("mha", "layer_first", 64, "backup"),
    ("mla", "page_first", 1, "backup"),
    ("mla", "layer_first", 1, "load"),
    ("mha", "page_first", 1, "load"),
]
FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)


def split_transfer(engines, h, d, k: int, to_host: bool) -> None:
    """Slots ``[:k]`` by DMA, ``[k:]`` by the kernel, queued together; waits for both."""
    shares = [(engines["dma"], h[:k], d[:k]), (engines["kernel"], h[k:], d[k:])]
    shares = [s for s in shares if s[1].numel()]
    if to_host:
        for hd in [eng.backup(hh, dd) for eng, hh, dd in shares]:
            hd.wait()
    else:
        for ld in [eng.load(hh, dd) for eng, hh, dd in shares]:
            ld.wait_layer(ld.layer_num - 1)


def main():
    clock, limits, rng = start(log)
    for kind, layout, ps, direction in CASES:
        case = Case(kind, layout, ps, TOKENS, "cuda", None)
        h, d, _, _ = case.indices(True, rng)
        engines = {"kernel": TransferEngine(case.host, "kernel"), "dma": TransferEngine(case.host, "dma")}
        if ps == 1:  # single tokens: the DMA backend would hand them to the kernel
            engines["dma"].backend = DMABackend(DMAConfig(kernel_below=0))
        to_host = direction == "backup"
        times = {f: [] for f in FRACTIONS}
        for _ in range(3):
            for f in FRACTIONS:
                k = int(round(f * case.tokens / ps)) * ps
                t = clock.median(lambda: split_transfer(engines, h, d, k, to_host), 3, 1)
                times[f].append(case.nbytes / t / 1e9)
        limit = limits[direction]
        row = {f"dma {f:.2f}": cell(g, limit) for f, g in times.items()}
        log(f"{kind}/{layout}/p{ps}/{direction}", row)
        del engines, case
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
