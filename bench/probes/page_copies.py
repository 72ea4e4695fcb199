"""Probe: three choices of the DMA backend and the kernel, each A/B in one process.

1. The ramp: a backup's first chunks small (``RAMP_DIV``, ``RAMP_MIN_BYTES``: the first chunk is
   staging / 16, at least 4 MiB, doubling up to a full buffer) or every chunk a full staging
   buffer (``RAMP_MIN_BYTES = 0``): 32k-token single-token backups on allocator slots of MHA, MLA
   and DSA layer_first, at 128 and 256 MiB staging.
2. A run's rows of all layers as one pitched 2-D copy (default) or as 1-D copies in one batched
   call (``MAX_PITCH = 0``): allocator backups, layer_first page 64 and MHA page_first page 1 on
   scattered slots.
3. The zero-copy kernel's row numbering (``triton_kernels.ROW_ORDER_BY_LAYOUT``: neighbours in
   the host layout are neighbours in the grid, or layer by layer): backups of MHA page_head and
   page_first and MLA page_first to scattered single-token slots.

Run: ``PYTHONPATH=.:bench/probes python bench/probes/page_copies.py OUT.json [--tokens N]``.
Backs: ``RAMP_DIV``/``RAMP_MIN_BYTES`` (at 128 MiB staging MLA 0.944x against 0.932x without the
ramp, DSA 0.937x against 0.921x, MHA equal), ``ROW_ORDER_BY_LAYOUT`` = True (MHA page_head 0.898x
against 0.814x, MLA page_first 0.879x against 0.805x, MHA page_first 0.908x against 0.902x).
Part 2: pitched and batched calls are within 0.03x of each other on every row but DSA's scattered
page-64 load (0.665x pitched, 0.917x batched).
Current answer: ``bench/results/h200/probes.json ("page_copies")``.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

import kvtier.transfer.dma.backend as dma_mod
import kvtier.transfer.dma.chunked as chunked_mod
import kvtier.transfer.dma.issue as issue_mod
import kvtier.transfer.dma.plan as plan_mod
from kvtier.bench.transfer import Case, Clock, contiguous_limit
from kvtier.transfer import TransferEngine
from kvtier.transfer.dma import DMABackend, DMAConfig, MiB
from probelib import JsonLog, args, transfer

PATH, TOKENS = args("/tmp/probe_page_copies.json")
log = JsonLog(PATH, tokens=TOKENS)
clock = Clock(True)


def rate(case, cfg, idx, to_host):
    eng = TransferEngine(case.host, "dma")
    eng.backend = DMABackend(cfg)
    return round(case.nbytes / clock.median(lambda: transfer(eng, idx[0], idx[1], to_host), 3, 1) / 1e9, 2)


def main():
    rng = np.random.default_rng(0)
    base = DMAConfig()
    limits = None
    ramp_default = dma_mod.RAMP_MIN_BYTES
    for kind in ("mha", "mla", "dsa"):
        case = Case(kind, "layer_first", 1, TOKENS, "cuda", None)
        if limits is None:
            limits = contiguous_limit(case.nbytes, clock, 3)
            log("limit", {k: round(v, 2) for k, v in limits.items()})
        idx = case.indices(False, rng)
        for staging in (128, 256):
            cfg = replace(base, staging_bytes=staging * MiB)
            for ramp in (ramp_default, 0):
                dma_mod.RAMP_MIN_BYTES = ramp
                g = rate(case, cfg, idx, True)
                log(f"{kind}/p1/allocator/backup/staging{staging}/ramp{int(bool(ramp))}",
                    {"gbps": g, "ratio": round(g / limits["backup"], 3)})
        dma_mod.RAMP_MIN_BYTES = ramp_default
        pitched_vs_batched(case, base, idx, limits, f"{kind}/p1/allocator", (True,))
        case.host.close()
        del case
        for layout, ps in (("layer_first", 64), ("page_first", 1)):
            if kind != "mha" and layout == "page_first":
                continue
            case = Case(kind, layout, ps, TOKENS, "cuda", None)
            idx = case.indices(True, rng)
            pitched_vs_batched(case, base, idx, limits, f"{kind}/{layout}/p{ps}/scattered", (True, False))
            case.host.close()
            del case
        torch.cuda.empty_cache()
    kernel_row_order(rng, limits)


def kernel_row_order(rng, limits):
    """Zero-copy backups of page-major layouts at scattered page-1 slots, rows numbered by
    layout (a token's layers adjacent) or layer by layer as before."""
    import kvtier.transfer.triton_kernels as tk
    for kind, layout in (("mha", "page_head"), ("mha", "page_first"), ("mla", "page_first")):
        case = Case(kind, layout, 1, TOKENS, "cuda", None)
        idx = case.indices(True, rng)
        eng = TransferEngine(case.host, "kernel")
        for by_layout in (True, False):
            tk.ROW_ORDER_BY_LAYOUT = by_layout
            g = round(case.nbytes / clock.median(lambda: eng.backup(idx[0], idx[1]).wait(), 3, 1) / 1e9, 2)
            log(f"kernel/{kind}/{layout}/p1/scattered/backup/order_by_layout{int(by_layout)}",
                {"gbps": g, "ratio": round(g / limits["backup"], 3)})
        tk.ROW_ORDER_BY_LAYOUT = True
        case.host.close()
        del case


def pitched_vs_batched(case, cfg, idx, limits, name, directions):
    for to_host in directions:
        d = "backup" if to_host else "load"
        for how, pitch in (("pitched", (1 << 31) - 1), ("batched", 0)):
            plan_mod.MAX_PITCH = chunked_mod.MAX_PITCH = issue_mod.MAX_PITCH = pitch
            g = rate(case, cfg, idx, to_host)
            log(f"{name}/{d}/{how}", {"gbps": g, "ratio": round(g / limits[d], 3)})
        plan_mod.MAX_PITCH = chunked_mod.MAX_PITCH = issue_mod.MAX_PITCH = (1 << 31) - 1


if __name__ == "__main__":
    main()
