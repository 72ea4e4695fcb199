"""Probe: why a grouped DMA load from page_first runs below its rows' measured copy rate.

Times a full per-layer load (engine.load, MHA llama-3-8b shape, page_first, 32k tokens)
for each forced layers-per-copy, with and without the scatter kernels, next to the
isolated pitched copy of the same rows at several payload sizes.
Usage: python bench/probes/grouped_load.py OUT.json
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch

from kvtier.bench.transfer import Case
from kvtier.transfer import TransferEngine
from kvtier.transfer import dma as dma_mod
from kvtier.transfer.cudart import memcpy2d
from kvtier.transfer.dma import DMABackend, DMAConfig, MiB
from kvtier.transfer.timing import event_seconds

out = {}


def _measure_row_rate(host_raw, device, width, pitch, payload=64 * MiB):
    """Pitched host -> device copies over a contiguous copy of the same bytes (what the DMA
    backend used to choose groups by, before it timed whole trial loads)."""
    rows = max(1, min(payload // width, host_raw.numel() // pitch))
    nbytes = rows * width
    scratch = torch.empty(nbytes, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device)
    src, dst, s = host_raw.data_ptr(), scratch.data_ptr(), stream.cuda_stream
    with torch.cuda.stream(stream):
        pitched = event_seconds(lambda: memcpy2d(dst, width, src, pitch, width, rows, s))
        flat = event_seconds(lambda: memcpy2d(dst, nbytes, src, nbytes, nbytes, 1, s))
    return flat / pitched


def log(k, v):
    out[k] = v
    print(k, v, flush=True)


def timed_load(eng, h, d, nbytes, reps=3):
    ts = []
    for i in range(reps + 1):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        ld = eng.load(h, d)
        ld.wait_layer(ld.layer_num - 1)
        b.record()
        b.synchronize()
        if i:
            ts.append(a.elapsed_time(b) / 1e3)
    return round(nbytes / float(np.median(ts)) / 1e9, 2)


def main(path, layout="page_first", kind="mha"):
    rng = np.random.default_rng(0)
    case = Case(kind, layout, 1, 32768, "cuda", None)
    h, d, _, _ = case.indices(False, rng)
    part = case.host.transfer_parts()[0]
    pl = part.host
    log("runs", int(1 + np.count_nonzero(np.diff(h.numpy()) != 1)))
    real_scatter = dma_mod.copy_items
    for g in (1, 2, 4, 8, 16, pl.layer_num):
        eng = TransferEngine(case.host, "dma")
        eng.backend = DMABackend(DMAConfig(load_group=g))
        log(f"{kind}/{layout}/g{g}/load", timed_load(eng, h, d, case.nbytes))
        dma_mod.copy_items = lambda *a, **k: 0 if not a[10] else real_scatter(*a, **k)  # no scatter
        log(f"{kind}/{layout}/g{g}/load_no_scatter", timed_load(eng, h, d, case.nbytes))
        dma_mod.copy_items = real_scatter
        if g < pl.layer_num:
            for mib in (8, 32, 64, 256):
                r = _measure_row_rate(part.host_raw, torch.device("cuda"), g * pl.chunk_bytes, pl.token, mib << 20)
                log(f"{kind}/{layout}/g{g}/row_rate_{mib}MiB", round(r, 3))
            # the same rows starting at layer g (not 0)
            off = part.host_raw[g * pl.layer_stride:]
            log(f"{kind}/{layout}/g{g}/row_rate_64MiB_layer{g}",
                round(_measure_row_rate(off, torch.device("cuda"), g * pl.chunk_bytes, pl.token, 64 << 20), 3))
        json.dump(out, open(path, "w"), indent=1)
    case.host.close()


if __name__ == "__main__":
    main(sys.argv[1])
    main(sys.argv[1].replace(".json", "_mla.json"), "page_first", "mla")
