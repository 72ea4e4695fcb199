"""Probe: where the host's time goes in one DMA transfer call (cProfile), next to the device time.

``host_plan.py`` (H200 run 18) found DMA transfers at 0.98-0.998x of the limit when
``prepare`` ran before the timed span and 0.89-0.97x when it ran inside, a gap of
1.5-8 ms per transfer, where planning alone takes about 0.5 ms on a 2-core CI
machine. This profiles ``engine.backup`` / ``engine.load`` and ``prepare`` on their
own for MHA layer_first page 1 and MLA layer_first page 1 (allocator slots), and
times the host's stretch from the call to the end of ``prepare``.
Usage: python bench/probes/host_profile.py OUT.json [--tokens N]
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time

import numpy as np
import torch

from kvtier.bench.transfer import Case
from kvtier.transfer import TransferEngine
from probelib import JsonLog, args, transfer

PATH, TOKENS = args("/tmp/probe_host_profile.json")
log = JsonLog(PATH, tokens=TOKENS)


def profiled(fn, top=25) -> str:
    pr = cProfile.Profile()
    pr.enable()
    fn()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumtime").print_stats(top)
    return s.getvalue()


def main():
    rng = np.random.default_rng(0)
    for kind, layout in (("mha", "layer_first"), ("mla", "layer_first"), ("mla", "page_first")):
        case = Case(kind, layout, 1, TOKENS, "cuda", None)
        h, d = case.indices(False, rng)[:2]
        eng = TransferEngine(case.host, "dma")
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
            torch.cuda.synchronize()
            text = profiled(lambda: transfer(eng, h, d, to_host))
            torch.cuda.synchronize()
            key = f"{kind}/{layout}/p1/{'backup' if to_host else 'load'}"
            log(key, {"prepare_ms": [round(x, 3) for x in prep]})
            print(text, flush=True)
            with open(PATH.replace(".json", f"_{key.replace('/', '_')}.txt"), "w") as f:
                f.write(text)
        case.host.close()
        del case, eng
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
