"""Probe: how much of a DMA transfer's time is the host planning it, and 256 MiB staging.

Run 16 left MLA backups and MLA page_first loads at 0.93-0.94x of a limit that
is measured on one 4.3 GB copy, where an MLA transfer is 2.3 GB: a fixed cost
per transfer weighs almost twice as much. The bench's timing starts before
``engine.backup`` is called, so everything the host does before the first copy
(index checks, reading indices, planning: 0.5-1 ms per part on a 2-core CI
machine) is time the copy engine sits idle.

For MHA, MLA and DSA, layer_first and page_first, page 1 and 64, allocator
slots, backup and per-layer load by DMA, this times:
- ``full``: as the bench does (event before the call, after the last layer);
- ``prepared``: the backend's ``prepare`` done before the start event, so only
  ``run`` is timed (index copies are queued in ``prepare`` and count nowhere: a
  few microseconds). Since chunk-at-a-time planning, ``run`` plans as it goes
  and ``prepare`` only checks the mean-copy bound;
- ``host_ms``: how long the call itself holds the host;
- ``whole_plan``: ``full`` with every plan made whole before the first copy (as before
  ``ChunkedPlan``), A/B in the same run;
and with ``--variants``:
- ``kernel_ratio``, ``auto_ratio``: the same transfer by the zero-copy kernel and by auto;
- ``staging256``: ``full`` with 256 MiB staging buffers (MLA and DSA only);
- DSA layer_first page 1 also with scattered host slots.
GB/s = payload / device time, median of 5 after a warm-up.
Usage: python bench/probes/host_plan.py OUT.json [--tokens N] [--variants]
"""

from __future__ import annotations

import contextlib
import sys
import time

import numpy as np
import torch

import kvtier.transfer.dma as dma_mod
import kvtier.transfer.dma_plan as plan_mod
from kvtier.bench.transfer import Case, Clock, contiguous_limit
from kvtier.layouts import SUPPORTED
from kvtier.transfer import TransferEngine
from kvtier.transfer.dma import DMABackend, DMAConfig, MiB
from probelib import JsonLog, args, transfer

PATH, TOKENS = args("/tmp/probe_host_plan.json")
REPS = 5
log = JsonLog(PATH, tokens=TOKENS)
clock = Clock(True)


def prepared_seconds(eng, h, d, to_host) -> float:
    """Device time of the queued work alone: ``prepare`` runs before the start event."""
    parts = eng.host_pool.transfer_parts()
    ts = []
    for _ in range(REPS + 1):
        torch.cuda.synchronize()
        with torch.cuda.stream(eng.backup_stream if to_host else eng.load_stream):
            run = eng.backend.prepare(parts, h, d, to_host)
            torch.cuda.current_stream().synchronize()  # index copies done before timing
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            if to_host:
                run(None)
            else:
                for layer in range(eng.layer_num):
                    run(layer)
            b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return float(np.median(ts[1:]))


@contextlib.contextmanager
def whole_plans():
    """DMA plans made whole before the first copy, as before chunk-at-a-time planning."""
    saved = dma_mod.ChunkedPlan, plan_mod.ChunkedPlan
    dma_mod.ChunkedPlan = plan_mod.ChunkedPlan = plan_mod.plan
    try:
        yield
    finally:
        dma_mod.ChunkedPlan, plan_mod.ChunkedPlan = saved


def host_ms(eng, h, d, to_host) -> float:
    ts = []
    for _ in range(REPS):
        torch.cuda.synchronize()
        t = time.perf_counter()
        handle = eng.backup(h, d) if to_host else eng.load(h, d)
        ts.append(time.perf_counter() - t)
        handle.synchronize()
    return round(1e3 * float(np.median(ts)), 3)


def main():
    rng = np.random.default_rng(0)
    limits = None
    for kind in ("mla", "dsa", "mha"):
        for layout in (lay for lay in ("layer_first", "page_first") if lay in SUPPORTED[kind]):
            for ps in (1, 64):
                case = Case(kind, layout, ps, TOKENS, "cuda", None)
                if limits is None:
                    limits = contiguous_limit(case.nbytes, clock, 5)
                    log("limit_gbps_mla_size", {k: round(v, 2) for k, v in limits.items()})
                for scattered in (False, True) if "--variants" in sys.argv and (kind, layout, ps) == (
                        "dsa", "layer_first", 1) else (False,):
                    h, d = case.indices(scattered, rng)[:2]
                    eng = TransferEngine(case.host, "dma")
                    for to_host in (True, False):
                        way = "backup" if to_host else "load"
                        lim = limits[way]

                        def ratio(engine):
                            g = case.nbytes / clock.median(lambda: transfer(engine, h, d, to_host), REPS, 4) / 1e9
                            return round(g, 2), round(g / lim, 3)
                        full = ratio(eng)
                        prep = case.nbytes / prepared_seconds(eng, h, d, to_host) / 1e9
                        row = {"full_gbps": full[0], "full_ratio": full[1],
                               "prepared_gbps": round(prep, 2), "prepared_ratio": round(prep / lim, 3),
                               "host_ms": host_ms(eng, h, d, to_host)}
                        if "--variants" in sys.argv:
                            # The zero-copy kernel, alone and as auto runs it (auto's rows trailed
                            # the kernel's in H200 run 17 where it had picked the kernel: DSA 0.67x
                            # vs 0.81x), and 256 MiB staging.
                            row["kernel_ratio"] = ratio(TransferEngine(case.host, "kernel"))[1]
                            row["auto_ratio"] = ratio(TransferEngine(case.host, "auto"))[1]
                            if kind != "mha":
                                big = TransferEngine(case.host, "dma")
                                big.backend = DMABackend(DMAConfig(staging_bytes=256 * MiB))
                                row["staging256_gbps"], row["staging256_ratio"] = ratio(big)
                        # Whole plans made before the first copy (as before ChunkedPlan), A/B.
                        with whole_plans():
                            whole = TransferEngine(case.host, "dma")
                            whole.backend = DMABackend()
                            row["whole_plan_gbps"], row["whole_plan_ratio"] = ratio(whole)
                        log(f"{kind}/{layout}/p{ps}/{'scattered' if scattered else 'allocator'}/{way}", row)
                case.host.close()
                del case, eng
                torch.cuda.empty_cache()
    again = contiguous_limit(2 << 30, clock, 5)
    log("limit_gbps_end", {k: round(v, 2) for k, v in again.items()})


if __name__ == "__main__":
    main()
