"""Probe: where the host's time goes in one DMA transfer call (cProfile), and how long the call takes.

Per case (default MHA layer_first, MLA layer_first, MLA page_first, single tokens on allocator
slots; ``--scattered`` for scattered host slots), a DMA engine that queues backups in the
caller's thread: ``prepare`` timed alone, the whole call timed unprofiled (``call_ms``), and one
backup and one load profiled (written next to OUT as ``OUT_<case>.txt``).

Run: ``PYTHONPATH=.:bench/probes python bench/probes/host_profile.py OUT.json [--tokens N]
[--case KIND/LAYOUT/PAGE]... [--scattered]``.
Backs: the host-speed check of ``bench/run_gpu_all.sh`` (``--case mha/page_first/1 --scattered``):
one DMA call of 32k scattered single MHA tokens takes the host 21-29 ms on a fast lease machine
and 44-69 ms on a slow one, and DMA's single-token pairs follow it (docs/performance.md).
Current answer: the ``host speed:`` line at the top of ``bench/results/h200/gpu_tests.log``.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time

import numpy as np
import torch

from kvtier.bench.transfer import Case
from kvtier.transfer import TransferEngine
from probelib import JsonLog, args, transfer

PATH, TOKENS = args("/tmp/probe_host_profile.json")
CASES = [(k, lay, int(ps)) for k, lay, ps in
         (sys.argv[i + 1].split("/") for i, a in enumerate(sys.argv) if a == "--case")] or \
    [("mha", "layer_first", 1), ("mla", "layer_first", 1), ("mla", "page_first", 1)]
SCATTERED = "--scattered" in sys.argv
log = JsonLog(PATH, tokens=TOKENS, scattered=SCATTERED)


def profiled(fn, top=25) -> str:
    pr = cProfile.Profile()
    pr.enable()
    fn()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumtime").print_stats(top)
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(top)  # where the time itself is
    return s.getvalue()


def main():
    rng = np.random.default_rng(0)
    for kind, layout, ps in CASES:
        case = Case(kind, layout, ps, TOKENS, "cuda", None)
        h, d = case.indices(SCATTERED, rng)[:2]
        # Backups queued by the caller's thread, so the profile sees all of their host work.
        eng = TransferEngine(case.host, "dma", background_backups=False)
        parts = case.host.transfer_parts()
        for to_host in (True, False):
            for _ in range(3):
                transfer(eng, h, d, to_host)
            torch.cuda.synchronize()
            prep = []
            for _ in range(5):
                t = time.perf_counter()
                with torch.cuda.stream(eng.backup_stream if to_host else eng.load_stream):
                    eng.backend.prepare(parts, h, d, to_host)
                prep.append(1e3 * (time.perf_counter() - t))
                torch.cuda.synchronize()
            calls = []  # the host's time from the call until it returns (all queued), unprofiled
            for _ in range(3):
                t = time.perf_counter()
                (eng.backup if to_host else eng.load)(h, d)
                calls.append(1e3 * (time.perf_counter() - t))
                torch.cuda.synchronize()
            torch.cuda.synchronize()
            text = profiled(lambda: transfer(eng, h, d, to_host))
            torch.cuda.synchronize()
            key = f"{kind}/{layout}/p{ps}/{'scattered/' if SCATTERED else ''}{'backup' if to_host else 'load'}"
            log(key, {"prepare_ms": [round(x, 3) for x in prep], "call_ms": [round(x, 3) for x in calls]})
            print(text, flush=True)
            with open(PATH.replace(".json", f"_{key.replace('/', '_')}.txt"), "w") as f:
                f.write(text)
        case.host.close()
        del case, eng
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
