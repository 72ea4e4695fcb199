"""Probe: do transfers slow down once a process has allocated and freed large host pools?

Run 65, the full transfer table: MLA layer_first allocator loads at 0.930x (page 1) and
0.933x (page 64), the page-1 pair at 1.448x. Run 66, the same rows alone in a fresh process,
same code: 0.962x, 0.957x and 1.616x; the pair's backup ended at 47.8 ms in both, the load at
57.1 ms against 51.6. So something earlier rows leave behind slows the later loads (the GPU
reading host memory). One candidate: a pool registered after many GB were mapped and freed
is backed by fewer huge pages, and every DMA read then needs more IOMMU translations.

Here, in one process: an MLA layer_first page-1 pool ("A") is made and timed (dma backup,
load, pair); then MHA pools as the table makes them (8.6 GB each) are made, moved once each
way and closed; then a second MLA pool ("B") is made and timed, and A is timed again. Each
timing logs the pool's host memory as the kernel backs it (``AnonHugePages`` of its mapping,
from ``/proc/self/smaps``) and the transparent-huge-page settings.
Predictions: if it is the pages, B loads slower than A and has fewer huge pages, and A
stays as fast as at first; if it is some other state of the process, A slows too.
Run 67 (``probe_host_pages_h200.json``): not the pages. Transparent huge pages are
``madvise`` only there, and every pool, first or last, is in 4 KiB pages (AnonHugePages 0).
A fresh: backup 52.17, load 51.77, pair 86.34 GB/s; B after six MHA pools: 52.26, 51.07,
78.41; A again: 52.08, 51.20, 83.37. Both pools' pairs fell (-9% B, -3% A), one sample each;
loads by about 1%. Some state of the process, then, not where the pool lies.
Usage: python bench/probes/host_pages.py OUT.json [--tokens N]
"""

from __future__ import annotations

import numpy as np

from kvtier.bench.transfer import Case, measure
from kvtier.transfer import TransferEngine
from probelib import JsonLog, args, read_text, six_mha_pools_moved, start

PATH, TOKENS = args("/tmp/probe_host_pages.json")
log = JsonLog(PATH, tokens=TOKENS)


def backing(ptr: int) -> dict:
    """The mapping that holds ``ptr``: its size and how much of it is in huge pages (kB)."""
    found, out = False, {}
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                if found:
                    break
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                found = lo <= ptr < hi
            elif found and head[0] in ("Size:", "Rss:", "AnonHugePages:", "KernelPageSize:"):
                out[head[0][:-1]] = int(head[1])
    return out


def pool_backing(case) -> list[dict]:
    return [backing(b.tensor.data_ptr()) for b in case.host._buffers]


def timed(name: str, case, clock) -> None:
    rng = np.random.default_rng(1)
    idx = case.indices(False, rng)
    eng = TransferEngine(case.host, "dma")
    out = {}
    for direction in ("backup", "load", "both"):
        measure(case, eng, direction, idx, clock, 1)
        g = [measure(case, eng, direction, idx, clock, 3) for _ in range(2)]
        out[direction] = round(float(np.median(g)), 2)
    log(name, {"gbps": out, "backing": pool_backing(case)})


def main():
    log("thp", {k: read_text(f"/sys/kernel/mm/transparent_hugepage/{k}") for k in ("enabled", "defrag")}
        | {"meminfo": [ln for ln in (read_text("/proc/meminfo") or "").splitlines()
                       if ln.startswith(("MemFree", "AnonHugePages", "HugePages_Total"))]})
    clock, limits, _ = start(log)
    a = Case("mla", "layer_first", 1, TOKENS, "cuda", None)
    timed("A, fresh process", a, clock)
    six_mha_pools_moved(TOKENS, clock, np.random.default_rng(2))
    b = Case("mla", "layer_first", 1, TOKENS, "cuda", None)
    timed("B, after six MHA pools", b, clock)
    timed("A again", a, clock)


if __name__ == "__main__":
    main()
