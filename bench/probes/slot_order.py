"""Probe: does moving a transfer's slot pairs in host-slot order speed up scattered host slots?

The engine (``TransferEngine(sort_slots=True)``, the default since run 25) reorders
a transfer's (host, device) slot pairs so the host slots ascend, pages kept whole.
Host pages scattered at random then become ascending addresses, and pages that
happen to be neighbours join into one run (longer, fewer copies). This times the
same transfers with and without that order, in one process, alternating A and B:
the bench's scattered rows for shapes that miss their target (layer_first page-64
backups, page-major single tokens), by DMA and by the zero-copy kernel.
Each cell is the median of five after a warm-up; the ratio is to the contiguous
copy measured at the start.
Usage: python bench/probes/slot_order.py OUT.json [--tokens N]
"""

from __future__ import annotations

import numpy as np
import torch

from kvtier.bench.transfer import Case, Clock, contiguous_limit, measure
from kvtier.transfer import TransferEngine
from probelib import JsonLog, args

PATH, TOKENS = args("/tmp/probe_slot_order.json")
log = JsonLog(PATH, tokens=TOKENS)

CASES = [  # kind, layout, page size, direction, backend
    ("mla", "layer_first", 64, "backup", "dma"),
    ("mla", "layer_first", 64, "backup", "kernel"),
    ("dsa", "layer_first", 64, "backup", "dma"),
    ("mha", "layer_first", 64, "backup", "dma"),
    ("mha", "page_first", 1, "backup", "dma"),
    ("mha", "page_first", 1, "backup", "kernel"),
    ("mha", "page_head", 1, "load", "kernel"),
    ("mha", "page_head", 1, "load", "dma"),
    ("mla", "page_first", 1, "backup", "kernel"),
    ("mla", "layer_first", 1, "load", "kernel"),
    ("mla", "layer_first", 64, "both", "dma"),
]


def main():
    clock = Clock(True)
    limits = contiguous_limit(1 << 30, clock, 5)
    log("limit_gbps", {k: round(v, 2) for k, v in limits.items()})
    rng = np.random.default_rng(0)
    for kind, layout, ps, direction, backend in CASES:
        case = Case(kind, layout, ps, TOKENS, "cuda", None)
        idx = case.indices(True, rng)
        engines = {order: TransferEngine(case.host, backend, sort_slots=order) for order in (True, False)}
        times = {True: [], False: []}
        for _ in range(3):
            for order, eng in engines.items():
                times[order].append(measure(case, eng, direction, idx, clock, 3))
        limit = limits["duplex" if direction == "both" else direction]
        row = {("sorted" if order else "as given"): {"gbps": round(float(np.median(g)), 2),
                                                    "ratio": round(float(np.median(g)) / limit, 3),
                                                    "samples": [round(x, 2) for x in g]}
               for order, g in times.items()}
        log(f"{kind}/{layout}/p{ps}/{direction}/{backend}", row)
        del engines, case
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
