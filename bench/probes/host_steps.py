"""Probe: the host time of every step of a transfer call, measured inside the call itself.

Run 61 (``probe_host_timeline_h200_run61.json``): an MLA page_first p1 backup's first device work
starts 1.5 ms after the call (3.4% of its 44 ms: the rows on allocator slots miss 0.95x by
0.002-0.024x), and the steps on the way take 5-20x what each takes alone, back to back.
``cold_host`` (run 62) ruled out an idle core: 2 ms of spinning before the call changed
nothing (0.952x either way), nor did sleeping or the garbage collector. That timeline's marks
record an event each; here each step is wrapped with the host clock alone (about 1 us a
call), so the sums are the steps' own costs in the call as the bench makes it.

Logged per case: for every wrapped step, the median over seven calls of its host ms within
one call (nested steps count in their callers too) and how often it ran; and the whole call.
Run 64 (``probe_host_steps_h200_run64.json``), MLA page_first p1 backup, 2.68 ms in the call:
``prepare`` 0.76 ms (the device slots to the device 0.41 ms: ``pin_memory`` 0.11, the Triton
launch of the index copy 0.19; ``Runs.of`` 0.19), the head's chunks 0.99 ms (4 gather
launches, 0.11 ms each), ``torch.cuda.current_stream`` 0.18 ms over 9 calls (20 us each: the
stream context managers), ``Event.record`` 0.01 ms each, the conflict check 0.07 ms, the index
check 0.08 ms. The load: 4.9 ms in the call, 19 gather/scatter launches at 0.09 ms each.
In the call every step costs 5-10x its time alone, and a Triton launch 0.1-0.2 ms.
``--scattered`` (after run 87, not yet run): MLA layer_first page-64 backups and loads to
scattered host pages instead, with the host-order sort (``HostOrder.of``) and each chunk's
planning (``ChunkedPlan.calls``) wrapped too: their first copy came 1.9-2.9 ms after the call
and a backup's call returned after 3.8-4.3 ms (runs 82-85), 4-6% of the transfer.
Usage: python bench/probes/host_steps.py OUT.json [--tokens N] [--scattered]
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import defaultdict

import torch

import kvtier.host_pool as host_pool_mod
import kvtier.transfer.dma as dma_mod
import kvtier.transfer.dma_plan as plan_mod
import kvtier.transfer.engine as engine_mod
import kvtier.transfer.kernel as kernel_mod
import kvtier.transfer.streams as streams_mod
import kvtier.transfer.triton_kernels as tk_mod
from kvtier.bench.transfer import Case
from kvtier.transfer import TransferEngine
from probelib import JsonLog, args

PATH, TOKENS = args("/tmp/probe_host_steps.json")
SCATTERED = "--scattered" in sys.argv
# (kind, layout, page size, direction)
CASES = ([("mla", "layer_first", 64, "backup"), ("mla", "layer_first", 64, "load")] if SCATTERED else
         [("mla", "page_first", 1, "backup"), ("mla", "page_first", 1, "load"), ("mha", "layer_first", 1, "backup")])
log = JsonLog(PATH, tokens=TOKENS)
ON = [False]
SUMS: dict[str, float] = defaultdict(float)
COUNTS: dict[str, int] = defaultdict(int)


def wrap(owner, name: str, label: str | None = None, static: bool = False) -> None:
    real = getattr(owner, name)
    label = label or f"{getattr(owner, '__name__', owner)}.{name}"

    def wrapper(*a, **k):
        if not ON[0]:
            return real(*a, **k)
        t0 = time.perf_counter()
        try:
            return real(*a, **k)
        finally:
            SUMS[label] += time.perf_counter() - t0
            COUNTS[label] += 1
    setattr(owner, name, staticmethod(wrapper) if static else wrapper)


def install() -> None:
    E, H, D = engine_mod.TransferEngine, host_pool_mod.HostKVCache, dma_mod.DMABackend
    for name in ("backup", "load", "_cuda", "_stream", "_order_after_conflicts", "_runner", "_started_backlog"):
        wrap(E, name)
    wrap(engine_mod, "_queue_head")
    for name in ("_check_indices", "transfer_parts"):
        wrap(H, name)
    for name in ("prepare", "in_host_order", "plan_part", "runner_for", "runner", "run_part", "_backup_chunks",
                 "_load_chunks", "ring"):
        wrap(D, name)
    for mod, name in ((dma_mod, "check_mapped"), (dma_mod, "host_numpy"), (dma_mod, "on_device"),
                      (dma_mod, "mean_copy_bound"), (dma_mod, "copy_items"), (dma_mod, "_issue"),
                      (kernel_mod, "fetch_index"), (tk_mod, "_copy_words"), (streams_mod, "apart")):
        wrap(mod, name)
    wrap(plan_mod.Runs, "of", "Runs.of", static=True)
    wrap(plan_mod.HostOrder, "of", "HostOrder.of", static=True)
    wrap(plan_mod.ChunkedPlan, "calls", "ChunkedPlan.calls")
    wrap(host_pool_mod, "_numpy")
    for name in ("is_pinned", "pin_memory", "record_stream"):
        wrap(torch.Tensor, name, f"Tensor.{name}")
    wrap(torch.cuda.Event, "record", "Event.record")
    wrap(torch.cuda.Stream, "wait_stream", "Stream.wait_stream")
    wrap(torch.cuda, "current_stream", "torch.cuda.current_stream")


def call(eng, h, d, what: str) -> dict[str, float]:
    """One call of ``what``; its steps' host ms, then wait for it."""
    torch.cuda.synchronize()
    SUMS.clear()
    COUNTS.clear()
    ON[0] = True
    t0 = time.perf_counter()
    handle = eng.backup(h, d) if what == "backup" else eng.load(h, d)
    total = time.perf_counter() - t0
    ON[0] = False
    out = {k: v * 1e3 for k, v in SUMS.items()}
    out["(whole call)"] = total * 1e3
    counts = dict(COUNTS)
    handle.wait() if what == "backup" else handle.wait_layer(handle.layer_num - 1)
    torch.cuda.synchronize()
    return out, counts


def main():
    install()
    import numpy as np
    rng = np.random.default_rng(0)
    for kind, layout, ps, what in CASES:
        case = Case(kind, layout, ps, TOKENS, "cuda", None)
        h, d = case.indices(SCATTERED, rng)[:2]
        eng = TransferEngine(case.host, "dma")
        for _ in range(2):
            call(eng, h, d, what)
        runs = [call(eng, h, d, what) for _ in range(7)]
        keys = sorted({k for r, _ in runs for k in r}, key=lambda k: -statistics.median(r.get(k, 0) for r, _ in runs))
        log(f"{kind}/{layout}/p{ps}/{'scattered' if SCATTERED else 'allocator'}/{what}",
            {k: {"ms": round(statistics.median(r.get(k, 0.0) for r, _ in runs), 4),
                 "calls": runs[-1][1].get(k, 1)} for k in keys})
        case.host.close()
        del case, eng
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
