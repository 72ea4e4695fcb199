"""Probe: where the host's time goes in one DMA transfer call (cProfile), next to the device time.

``host_plan.py`` (H200 run 18) found DMA transfers at 0.98-0.998x of the limit when
``prepare`` ran before the timed span and 0.89-0.97x when it ran inside, a gap of
1.5-8 ms per transfer, where planning alone takes about 0.5 ms on a 2-core CI
machine. This profiles ``engine.backup`` / ``engine.load`` and ``prepare`` on their
own for MHA layer_first page 1 and MLA layer_first page 1 (allocator slots), and
times the host's stretch from the call to the end of ``prepare``.
After run 128 (not yet run): ``--case KIND/LAYOUT/PAGE`` (repeatable) and ``--scattered``
(host slots scattered, as the table's scattered rows) profile other rows: DMA's single-token
pairs on page_first are host-bound, both ways' host work 87-135 ms on 2 x 32k copies, of which
the runtime's queueing is ~15 ms a way (0.40-0.48 us a copy, ``probe_queue_cost_h200_16k.json``)
and planning 13-14 ms a way (``dma_plan_time.py``, CPU): where is the rest? Command:
``--case mha/page_first/1 --case mla/page_first/1 --scattered``.
Usage: python bench/probes/host_profile.py OUT.json [--tokens N] [--case KIND/LAYOUT/PAGE ...] [--scattered]
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
