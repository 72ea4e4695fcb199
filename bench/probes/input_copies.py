"""Probe: how long does an engine's small input copy wait behind a DMA load?

Run 34: with the reference engine copying its inputs by ``.to("cuda", non_blocking=True)``
from pageable memory, a 32k host-tier hit by DMA took 118 ms; read by SMs
(``kvtier.transfer.kernel.on_device``), 83 ms (run 35). This times, just after a 32k per-layer
DMA load of the TTFT bench's shape (MHA layer_first page 64, allocator slots) is queued, five
256 KiB int64 copies to the GPU on the caller's stream, three ways: from pageable memory, from
pinned memory (pinned beforehand, ``non_blocking``), and by SMs (``on_device``). Per way: the host's time to issue
the five, and when (device clock, from the load's start) the last is done, against the load's
own end. Three rounds, the ways alternating.

Run 36 (``probe_input_copies_h200.json``): pageable and pinned copies alike landed only with the
whole load (79-80 ms; pageable also held the host 68-73 ms); by SMs at 9.0-9.5 ms. Next: the
same with ``CUDA_DEVICE_MAX_CONNECTIONS=32`` in the environment (logged with the entry), in case
the wait is the caller's stream sharing a hardware queue with the load's copy stream.
Usage: python bench/probes/input_copies.py OUT.json [--tokens N]
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch

from kvtier.bench.transfer import Case
from kvtier.transfer import TransferEngine
from kvtier.transfer.kernel import on_device
from probelib import JsonLog, args, in_turn

PATH, TOKENS = args("/tmp/probe_input_copies.json")
log = JsonLog(PATH, tokens=TOKENS)
N, WORDS = 5, 32768  # five copies of 256 KiB (one 32k-slot table each)


def copies(way: str, srcs):
    if way == "sms":
        return [on_device(s, torch.device("cuda")) for s in srcs]
    return [s.to("cuda", non_blocking=True) for s in srcs]


def one(eng, h, d, way: str) -> dict:
    srcs = [torch.arange(WORDS, dtype=torch.int64) + i for i in range(N)]
    if way == "pinned":  # pinned ahead, as an engine's reused input buffers are
        srcs = [s.pin_memory() for s in srcs]
    torch.cuda.synchronize()
    start, got, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    start.record()
    ld = eng.load(h, d)
    t0 = time.perf_counter()
    outs = copies(way, srcs)
    host_ms = 1e3 * (time.perf_counter() - t0)
    got.record()
    ld.wait_layer(ld.layer_num - 1)
    end.record()
    end.synchronize()
    ok = all(torch.equal(o.cpu(), s) for o, s in zip(outs, srcs))
    return {"host_ms": round(host_ms, 3), "inputs_done_ms": round(start.elapsed_time(got), 3),
            "load_done_ms": round(start.elapsed_time(end), 3), "correct": ok}


def main():
    case = Case("mha", "layer_first", 64, TOKENS, "cuda", None)
    h, d, _, _ = case.indices(False, np.random.default_rng(0))
    eng = TransferEngine(case.host, "dma")
    rows = in_turn({way: way for way in ("pageable", "pinned", "sms")}, lambda way: one(eng, h, d, way))
    conn = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "unset (8)")
    log(f"mha/layer_first/p64/allocator/load by dma, then 5 x 256 KiB inputs; CUDA_DEVICE_MAX_CONNECTIONS={conn}", rows)


if __name__ == "__main__":
    main()
