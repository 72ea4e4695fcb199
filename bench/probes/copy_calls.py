"""Probe: does the runtime call that queues a staging chunk's copy, or the host memory it lands
in, cost the MLA page_first allocator rows their last few percent?

MLA page_first single-token backups on allocator slots run at 0.93-0.94x in every recent run,
and steadily so (run 51, ``probe_engine_spread_h200_c8.json``: five engines 0.933-0.942x, rounds
within 0.005x). The host slots are one run, so each 128 MiB staging chunk is one copy, and the
DMA backend queues a chunk of fewer than ``batch_min`` 1-D copies as ``cudaMemcpy2DAsync``
calls of height 1. layer_first backups of one run go 61 (MLA) or 32 (MHA) copies per chunk
through ``cudaMemcpyBatchAsync`` and run 0.95-0.98x. The limit is one ``cudaMemcpyAsync``
(torch ``copy_``) into memory from ``cudaHostAlloc``, where the host pool is ordinary memory
registered with ``cudaHostRegister``.

Arms, each way, for the bytes of a 32k MLA transfer (2.3 GB) in 128 MiB chunks from (to) one
device buffer, on one stream: ``cudaMemcpyAsync`` per chunk, ``cudaMemcpy2DAsync`` of height
1 per chunk (as the DMA backend queues them), ``cudaMemcpyBatchAsync`` of one copy per chunk,
and the whole in one ``cudaMemcpyAsync``; each into the host pool's own registered memory
(where the backup's allocator slots land) and into a ``cudaHostAlloc`` buffer; and the DMA
engine's backup and load of the same slots. All timed in turn, three rounds of three.
Prediction, if the call is the cause: height-1 2-D copies run 2-4% below ``cudaMemcpyAsync``
chunks into the same memory, and the engine's backup sits with the 2-D arm, and with height-1 copies queued by
``cudaMemcpyAsync`` (patched in, an arm of its own) it gains as much. If the memory is:
every arm into the host pool runs 2-4% below the same arm into ``cudaHostAlloc`` memory.
Run 52 (``probe_copy_calls_h200.json``): both refuted. Every raw arm ran at 0.998-1.004x
device to host and 0.992-0.996x host to device, whatever the call and the memory; the
engine's backup 0.942x and load 0.955x, and 0.940x / 0.954x with height-1 copies queued by
``cudaMemcpyAsync``. The loss is in the engine's own schedule (``backup_pace.py``).
Usage: python bench/probes/copy_calls.py OUT.json [--tokens N]
"""

from __future__ import annotations

import numpy as np
import torch

from kvtier.bench.transfer import Case, measure
import kvtier.transfer.dma as dma_mod
from kvtier.transfer import TransferEngine, cudart
from probelib import JsonLog, args, cell, in_turn, start

PATH, TOKENS = args("/tmp/probe_copy_calls.json")
log = JsonLog(PATH, tokens=TOKENS)
CHUNK = 128 << 20


def chunked(call: str, host: int, dev: int, nbytes: int, to_host: bool, stream: int) -> None:
    for off in range(0, nbytes, CHUNK):
        n = min(CHUNK, nbytes - off)
        dst, src = (host + off, dev) if to_host else (dev, host + off)
        if call == "memcpy":
            cudart.memcpy1d(dst, src, n, stream)
        elif call == "2d height 1":
            cudart.memcpy2d(dst, n, src, n, n, 1, stream)
        else:  # "batch of 1"
            cudart.memcpy_batch(np.array([dst], np.uint64), np.array([src], np.uint64), np.array([n], np.uint64), stream)


def as_1d(dst, dpitch, src, spitch, width, height, stream):
    """``memcpy2d`` as the DMA backend calls it, a height-1 copy queued by cudaMemcpyAsync."""
    if height == 1:
        cudart.memcpy1d(dst, src, width, stream)
    else:
        cudart.memcpy2d(dst, dpitch, src, spitch, width, height, stream)


def patched(fn):
    """``fn`` run with the DMA backend queueing height-1 copies by cudaMemcpyAsync."""
    def run():
        dma_mod.memcpy2d = as_1d
        try:
            return fn()
        finally:
            dma_mod.memcpy2d = cudart.memcpy2d
    return run


def main():
    clock, limits, rng = start(log)
    case = Case("mla", "page_first", 1, TOKENS, "cuda", None)
    idx = case.indices(False, rng)
    nbytes = case.nbytes
    eng = TransferEngine(case.host, "dma")
    pool = case.host.transfer_parts()[0].host_raw
    assert pool.numel() >= nbytes
    own = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(CHUNK, dtype=torch.uint8, device="cuda")
    one = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    work = torch.cuda.Stream()  # batched copies refuse the legacy default stream
    log("setup", {"nbytes": nbytes, "host slots": f"{int(idx[0][0])}..{int(idx[0][-1])}",
                  "pool base": hex(pool.data_ptr()), "cudaHostAlloc base": hex(own.data_ptr())})

    def raw(call, host, to_host):
        def fn():
            work.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(work):
                if call == "one memcpy":
                    a, b = (host, one.data_ptr()) if to_host else (one.data_ptr(), host)
                    cudart.memcpy1d(a, b, nbytes, work.cuda_stream)
                else:
                    chunked(call, host, dev.data_ptr(), nbytes, to_host, work.cuda_stream)
            torch.cuda.current_stream().wait_stream(work)
        return lambda: nbytes / clock.median(fn, 3, 1) / 1e9

    for direction, to_host in (("backup", True), ("load", False)):
        engine = lambda d=direction: measure(case, eng, d, idx, clock, 3)  # noqa: E731
        arms = {"engine (dma)": engine, "engine, height 1 by cudaMemcpyAsync": patched(engine)}
        for where, base in (("pool", pool.data_ptr()), ("cudaHostAlloc", own.data_ptr())):
            for call in ("memcpy", "2d height 1", "batch of 1", "one memcpy"):
                arms[f"{call} -> {where}"] = raw(call, base, to_host)
        times = in_turn(arms, lambda fn: fn())
        log(direction, {k: cell(g, limits[direction]) for k, g in times.items()})


if __name__ == "__main__":
    main()
