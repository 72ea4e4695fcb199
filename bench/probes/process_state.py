"""Probe: which state of a process slows its later transfers?

Runs 65-67: rows late in a full transfer table come out lower than the same rows timed alone
in a fresh process (MLA layer_first p1 allocator dma: load 0.930x against 0.960x, pair 1.448x
against 1.613x), and not because later pools lie in other pages (``host_pages``: every pool
is in 4 KiB pages; a pool made first also lost after six MHA pools came and went, pair
86.3 -> 83.4 GB/s, one sample).

Here one MLA layer_first page-1 pool ("A") and one engine on it, as a server keeps them, are
timed (dma; per-layer load and backup-and-load pair, three samples each) after each phase:
0. nothing yet (a fresh process);
1. six 8.6 GB host buffers registered with CUDA and released, nothing moved (what a pool's
   making and closing leaves in the driver);
2. six MHA pools made as the table makes them, moved once each way and closed (what other
   shapes' transfers leave in the shared backends, Triton and the allocators);
3. thirty more pairs on A itself (what its own use leaves).
Predictions: if registration state, A falls after phase 1; if the backends' or allocators'
state, after phase 2 only; if it is wear of A's own engine, after phase 3; if none falls by
more than the samples spread, run 65's late rows fell for the time into the run (heat).
Run 68 (``probe_process_state_h200.json``), medians of three, load / pair GB/s: fresh 51.1 /
84.2; after the registrations 48.9 / 79.2; after the MHA pools 50.6 / 86.0; after thirty more
pairs 51.3 / 87.1. No phase left A lastingly slower: the dip came right after 52 GB had been
pinned and released, and was gone after the next phase (which also registered six pools, but
moved data between them); the pairs rose as the run went on, as did the contiguous duplex limit
(97.1 GB/s at the start, 101.1 at the end). So neither registrations nor the backends' state
slow a process for good; the late rows of run 65 look like a transient (the minutes after
large pools are pinned and freed) or the link's own drift, not yet told apart.
Usage: python bench/probes/process_state.py OUT.json [--tokens N]
"""

from __future__ import annotations

import numpy as np
import torch

from kvtier.bench.transfer import contiguous_limit, measure
from kvtier.memory import HostBuffer
from probelib import JsonLog, args, mha_host_bytes, mla_pool_and_engine, six_mha_pools_moved, start

PATH, TOKENS = args("/tmp/probe_process_state.json")
log = JsonLog(PATH, tokens=TOKENS)


def timed(phase: str, case, eng, idx, clock) -> None:
    out = {}
    for direction in ("load", "both"):
        g = [measure(case, eng, direction, idx, clock, 3) for _ in range(3)]
        out[direction] = {"gbps": [round(x, 2) for x in g], "median": round(float(np.median(g)), 2)}
    log(phase, out)


def main():
    clock, limits, _ = start(log)
    a, idx, eng = mla_pool_and_engine(TOKENS, clock)
    timed("0: fresh", a, eng, idx, clock)
    for _ in range(6):
        HostBuffer((mha_host_bytes(TOKENS),), torch.uint8).release()
    timed("1: after six host registrations", a, eng, idx, clock)
    six_mha_pools_moved(TOKENS, clock, np.random.default_rng(2))
    timed("2: after six MHA pools moved", a, eng, idx, clock)
    for _ in range(6):
        measure(a, eng, "both", idx, clock, 5)
    timed("3: after thirty more pairs on A", a, eng, idx, clock)
    log("limit_gbps at the end", {k: round(v, 2) for k, v in contiguous_limit(1 << 30, clock, 5).items()})


if __name__ == "__main__":
    main()
