"""Probe: host time of one gather launch, by Triton's full launch path and by the kept launcher.

A DMA transfer launches one gather (backup) or scatter (load) kernel per staging chunk; on a
slow host the run-134 profile put those launches at 11 ms of an 80 ms single-token load call
(``probe_host_profile_h200_run134_mha_page_first_p1_scattered_load.txt``: ``copy_items`` 0.34 ms
a call, Triton's ``run`` 0.15 ms of it). ``triton_kernels.FAST_LAUNCH`` keeps the compiled
kernel per specialization and calls its launcher. Here: ``copy_items`` as a DMA backup calls
it (MHA llama-3-8b shape, K part, page_first staging of 1,024 single tokens over 32 layers,
``item0`` stepping by 1,024), ``--calls`` calls per arm and round, in turn, three rounds,
the stream synchronized every 32 calls (the kernels are not what is timed); and one
cProfile of each arm. Prediction: the launcher path 40-70% less host time a call.
Usage: python bench/probes/launch_cost.py OUT.json [--calls N]
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time

import torch

from kvtier.layouts import LAYOUTS
from kvtier.spec import KVSpec
from kvtier.transfer import triton_kernels as tk
from kvtier.transfer.dma_plan import compact
from probelib import JsonLog, args

PATH, _ = args("/tmp/probe_launch_cost.json")
CALLS = int(sys.argv[sys.argv.index("--calls") + 1]) if "--calls" in sys.argv else 640
log = JsonLog(PATH, calls=CALLS)


def main() -> None:
    spec = KVSpec("mha", 32, torch.bfloat16, head_num=8, head_dim=128)
    comp = spec.components[0]
    slots, tokens = 1024, 32768
    pl = LAYOUTS["page_first"].placement(comp, spec.layer_num, tokens, 1)
    stg_pl = compact(pl, slots, spec.layer_num)
    dev = torch.empty((spec.layer_num, tokens, comp.item_bytes), dtype=torch.uint8, device="cuda")
    layers = tuple(dev.unbind(0))
    ptrs = tk.layer_ptr_table(layers, "cuda")
    stg = torch.empty(stg_pl.total_bytes, dtype=torch.uint8, device="cuda")
    d = torch.randperm(tokens, device="cuda")
    wp = tk.WordPlan.for_copy(stg_pl, stg, layers)

    def calls(fast: bool, n: int) -> float:
        tk.FAST_LAUNCH = fast
        spent = 0.0
        for k in range(0, n, 32):
            t0 = time.perf_counter()
            for j in range(k, min(n, k + 32)):
                tk.copy_items(stg_pl, stg, layers, ptrs, None, d, (j * slots) % tokens, slots, 0,
                              spec.layer_num, True, 48, wp)
            spent += time.perf_counter() - t0
            torch.cuda.synchronize()
        tk.FAST_LAUNCH = True
        return spent / n * 1e6

    for fast in (False, True):
        calls(fast, 64)  # compile, keep the launcher
    rounds = {"triton launch": [], "kept launcher": []}
    for _ in range(3):
        for name, fast in (("triton launch", False), ("kept launcher", True)):
            rounds[name].append(round(calls(fast, CALLS), 1))
    log("us per call", rounds)
    for name, fast in (("triton launch", False), ("kept launcher", True)):
        prof = cProfile.Profile()
        prof.enable()
        calls(fast, 256)
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(12)
        log(f"profile {name}", out.getvalue().splitlines()[:30])


if __name__ == "__main__":
    main()
