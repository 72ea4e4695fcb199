"""Probe: does the zero-copy kernel move whole pages faster as one row per page?

``KernelConfig.page_rows``: where a layer_first transfer moves whole pages, the kernel copies each
page's run (page_size x item bytes, contiguous on both sides) as one row cut into power-of-two
chunks of at most ``page_chunk_bytes``, instead of one row per token. DSA's 132-byte index-K
rows, not a multiple of 16, otherwise move in 4-byte words; as page rows they are 8,448-byte
runs in 16-byte words. Here, per kind (DSA, MLA, MHA), layer_first page 64, 32k tokens to
scattered host pages, in turn: the kernel with token rows, page rows cut at 8 KiB (default),
1 KiB and uncut; for DSA also the DMA backend (index-K through the kernel) with token and page
rows, one way and as a backup+load pair.

Run: ``PYTHONPATH=.:bench/probes python bench/probes/page_rows.py OUT.json [--tokens N]``.
Backs: ``KernelConfig.page_rows`` (DSA kernel backups 0.842x -> 0.922x, loads 0.851x -> 0.880x,
DMA pairs 1.244x -> 1.402x; MHA and MLA within 0.01x) and ``page_chunk_bytes`` = 8 KiB (1 KiB,
8 KiB and uncut within 0.01x of each other).
Current answer: ``bench/results/h200/probes.json ("page_rows")``.
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
