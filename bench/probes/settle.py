"""Probe: how fast transfers run in the seconds after large host buffers are pinned and freed.

Run 68 (``process_state``): one MLA pool's load fell from 51.1 to 48.9 GB/s and its
backup-and-load pair from 84.2 to 79.2 right after six 8.6 GB host buffers were pinned and
released, and were back a phase later. The transfer table makes and closes each case's pools
just before timing it, and its late rows come out lower than the same rows alone (run 65
against run 66: MLA layer_first p1 load 0.930x against 0.960x, pair 1.448x against 1.613x).
A server pins its host pool once, at start; if a transient after pinning is what the table
times, the table understates what a server gets, and the bench should let it pass.

One MLA layer_first page-1 pool ("A") and one dma engine on it; arms, in turn, twice each:
- ``pinned and freed``: three 8.6 GB host buffers (an MHA case's host pool) registered with
  CUDA and released;
- ``case made and closed``: an MHA page_first page-1 case made (host and device pools, as the
  table makes it) and closed;
- ``nothing``: as long a pause.
After each, A's per-layer load and pair are timed in turn for ``SERIES_S`` seconds, each
point with the seconds since the arm ended. Predictions: if a transient, the first points
after ``pinned and freed`` and ``case made and closed`` are low and recover within the
series while ``nothing`` stays flat; if the link drifts, all arms wander alike.
Usage: python bench/probes/settle.py OUT.json [--tokens N]
"""

from __future__ import annotations

import time

import torch

from kvtier.bench.transfer import Case, measure
from kvtier.memory import HostBuffer
from probelib import JsonLog, args, mha_host_bytes, mla_pool_and_engine, start

PATH, TOKENS = args("/tmp/probe_settle.json")
log = JsonLog(PATH, tokens=TOKENS)
SERIES_S = 10.0


def pinned_and_freed() -> None:
    for _ in range(3):
        HostBuffer((mha_host_bytes(TOKENS),), torch.uint8).release()


def case_made_and_closed() -> None:
    c = Case("mha", "page_first", 1, TOKENS, "cuda", None)
    c.host.close()
    del c
    torch.cuda.empty_cache()


def series(a, eng, idx, clock) -> list[list[float]]:
    """[seconds since the arm ended, load GB/s, pair GB/s] until ``SERIES_S`` has passed."""
    t0, out = time.perf_counter(), []
    while time.perf_counter() - t0 < SERIES_S:
        at = time.perf_counter() - t0
        out.append([round(at, 2), round(measure(a, eng, "load", idx, clock, 1), 2),
                    round(measure(a, eng, "both", idx, clock, 1), 2)])
    return out


def main():
    clock, limits, _ = start(log)
    a, idx, eng = mla_pool_and_engine(TOKENS, clock)
    pause = [2.0]

    def nothing() -> None:
        time.sleep(pause[0])
    arms = {"pinned and freed": pinned_and_freed, "case made and closed": case_made_and_closed, "nothing": nothing}
    for rep in range(2):
        for name, arm in arms.items():
            t = time.perf_counter()
            arm()
            took = time.perf_counter() - t
            if name != "nothing":
                pause[0] = max(pause[0], took)
            log(f"{name} #{rep + 1} (arm took {took:.1f} s)", series(a, eng, idx, clock))


if __name__ == "__main__":
    main()
