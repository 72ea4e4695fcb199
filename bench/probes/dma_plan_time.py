"""CPU probe: the host time DMA planning takes for one 32k-token transfer to scattered slots.

After run 112: DMA's single-token pairs on scattered slots looked host-bound (the load call
returned after 70-110 ms in a pair). This times, without a GPU, what the DMA backend plans
for one transfer: ``in_host_order`` and ``plan_parts``, then every chunk's runtime calls
(``calls(i)``), and counts those calls. Loads are planned one layer a copy unless GROUP is
given (the GPU's trial loads pick the group there; here it is set by hand).
Outcome on the CI-like CPU: MHA page_first page 1, backup: 1.1 ms of plans, 20 ms of chunks,
32,822 calls; a load in one group of 32 layers: 18.5 ms, 32,818 calls.
2026-12-04, same CPU, in turn three times each: MHA page_head page 1 backup, chunks 5.9 ms with
the lengths by ``np.unique`` and the run templates from the shared cache, 4.5 ms with them
counted (``_lengths_by_value``) and kept per plan (``_templates``).
2026-12-04 (later), same CPU, in turn three times each (backups): a run of one copy taken from its
template without unrolling, 1-D rows passed through as they are, page-1 offsets by one multiply,
``Runs.of`` counting short runs: MHA page_head page 1 plans 1.6-1.7 -> 1.4-1.5 ms, chunks
4.3-4.4 -> 2.3-2.4 ms; MLA page_first page 1 plans 1.6 -> 1.4 ms, chunks 2.3 -> 1.2 ms.
Usage: python bench/probes/dma_plan_time.py KIND LAYOUT PAGE [GROUP]
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np

from kvtier.bench.transfer import SHAPES, slots
from kvtier.device_pool import pool_from_spec
from kvtier.host_pool import host_pool_for
from kvtier.spec import preset
from kvtier.transfer.dma import DMABackend, DMAConfig
from kvtier.transfer.dma_plan import Runs

TOKENS = 32768


def main() -> None:
    kind, layout, ps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    group = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    dev = pool_from_spec(preset(SHAPES[kind]), 2 * 64, ps, "cpu")  # its size does not enter the plan
    host = host_pool_for(dev, layout, host_size_tokens=2 * TOKENS, validate_indices=False)
    h = slots(host.page_num, ps, TOKENS // ps, np.random.default_rng(0), True, host).numpy()
    parts = host.transfer_parts()
    dma = DMABackend(DMAConfig())
    if group:
        dma.load_group = lambda part, host_np, runs=None: group  # the GPU's trial loads, by hand
    for to_host in (True, False):
        times = []
        for _ in range(9):  # the median of the last 8 (single timings on a shared core swung 7-14 ms)
            t0 = time.perf_counter()
            s_np, runs, order = dma.in_host_order(parts, h, Runs.of(h))
            plans = dma.plan_parts(parts, s_np, runs, order, to_host, to_host or bool(group))
            t1 = time.perf_counter()
            calls = 0
            for p in plans:
                for q in ([] if p is None else p.plans.values() if hasattr(p, "plans") else [p]):
                    for i in range(q.n_chunks):
                        tall, flat = q.calls(i)
                        calls += len(tall) + len(flat)
            t2 = time.perf_counter()
            times.append((t1 - t0, t2 - t1))
        plan_s, chunk_s = (statistics.median(t[k] for t in times[1:]) for k in (0, 1))
        print(f"{kind} {layout} p{ps} {'backup' if to_host else 'load'}: plans {1e3 * plan_s:.1f} ms, "
              f"chunks {1e3 * chunk_s:.1f} ms, {calls} calls, {[type(p).__name__ for p in plans]}")
    host.close()


if __name__ == "__main__":
    main()
