"""Probe: do layer_first page-64 backups to scattered host pages lose their time in the copies,
or in the engine around them?

Such a backup is one host row per page and layer (72 KiB for MLA, 128 KiB for MHA's K or V,
plus DSA's 8.4 KB index-K rows, which go through the kernel). Per kind (MLA, MHA, DSA), 32k
tokens to scattered host pages as the transfer table draws them, in turn (two warm-ups, three
rounds): the DMA engine copying straight from the device pool (``DMAConfig.pool_rows``: no
staging, no gather, no SMs) against staging (``pool_rows=0``), the zero-copy kernel, and the
engine's planned copies alone, queued ahead on a sleeping stream (``copies, chunk waits``), and
with a kernel rewriting each staging buffer beside them (``copies, mini engine``); the pool path
and staging also on allocator slots and as a backup+load pair; both paced chunk by chunk.

Run: ``PYTHONPATH=.:bench/probes python bench/probes/scattered_backup.py OUT.json [--tokens N]``.
Backs: ``DMAConfig.pool_rows`` = 0 (from the pool 0.848x / 0.888x / 0.773x against staged 0.816x /
0.890x / 0.799x on scattered pages, MLA / MHA / DSA, and 0.857-0.892x against 0.972-0.988x on
allocator slots), and the finding that short host rows, not the engine, hold these rows below
0.9x by DMA: the planned copies alone run at 0.875x / 0.926x / 0.882x.
Current answer: ``bench/results/h200/probes.json ("scattered_backup")``.
"""

from __future__ import annotations

import numpy as np
import torch

from kvtier.bench.transfer import Case, measure
from kvtier.transfer import TransferEngine, streams
from kvtier.transfer.dma import DMABackend, DMAConfig, issue_copies
from kvtier.transfer.slots import Runs
from probelib import JsonLog, Pace, args, cell, in_turn, start

PATH, TOKENS = args("/tmp/probe_scattered_backup.json")
KINDS = ("mla", "mha", "dsa")
log = JsonLog(PATH, tokens=TOKENS, kinds=KINDS)


def planned_calls(eng: TransferEngine, h: torch.Tensor) -> tuple[list[tuple[int, np.ndarray, np.ndarray]], int]:
    """Every chunk's copies of a backup of host slots ``h``, as the engine's DMA backend plans
    them: ``(host base, pitched rows, 1-D copies)`` per chunk, parts in order (the parts it
    sends through the kernel left out: DSA's index-K pages); and the bytes they move."""
    be = eng.backend
    parts = eng.host_pool.transfer_parts()
    h_np = h.numpy()
    s_np, runs, _ = be.in_host_order(parts, h_np, Runs.of(h_np))
    out = []
    for part in parts:
        p = be.plan_part(part, s_np, True, True, runs)
        if p is not None:
            out += [(part.host_raw.data_ptr(), *p.calls(i)) for i in range(p.n_chunks)]
    nbytes = sum(int((t[:, 2] * t[:, 3]).sum()) + int(f[:, 2].sum()) for _, t, f in out)
    return out, nbytes


def copies_alone(calls, bufs: list[torch.Tensor], nbytes: int, held: bool, shuffle=None,
                 side: torch.cuda.Stream | None = None, gather: bool = False) -> float:
    """GB/s of queueing ``calls`` (:func:`planned_calls`) on the current stream, chunk ``k``'s
    from staging buffer ``bufs[k % len(bufs)]``.
    ``held``: the streams sleep first, so the host has queued everything before the clock
    starts. ``shuffle``: an rng that puts each chunk's pitched calls in a random order.
    ``side``: a second stream; each chunk's copies then wait for an event it records (as the
    engine's copies wait for their gather), with several buffers or ``gather`` after the
    copies that last read the chunk's buffer (as the engine's gathers wait for a free one);
    ``gather``: before that event, an elementwise
    kernel on ``side`` rewrites the whole buffer (reads and writes it, as a gather does)."""
    s = torch.cuda.current_stream()
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if held:
        torch.cuda._sleep(200_000_000)  # about 100 ms: longer than queueing a backup's calls
        if side is not None:
            side.wait_stream(s)
    t0.record(s)
    free: list[torch.cuda.Event | None] = [None] * len(bufs)
    for k, (base, tall, flat) in enumerate(calls):
        buf = bufs[k % len(bufs)]
        if side is not None:
            if free[k % len(bufs)] is not None and (gather or len(bufs) > 1):  # one buffer, no gather: waits only
                side.wait_event(free[k % len(bufs)])
            if gather:
                with torch.cuda.stream(side):
                    torch.bitwise_xor(buf, 0, out=buf)
            ready = torch.cuda.Event()
            ready.record(side)
            s.wait_event(ready)
        if shuffle is not None and len(tall):
            tall = tall[shuffle.permutation(len(tall))]
        issue_copies(tall, flat, base, buf.data_ptr(), True, s.cuda_stream)
        if side is not None:
            free[k % len(bufs)] = torch.cuda.Event()
            free[k % len(bufs)].record(s)
    t1.record(s)
    t1.synchronize()
    return nbytes / (t0.elapsed_time(t1) / 1e3) / 1e9


def main() -> None:
    clock, limits, rng = start(log)
    work = torch.cuda.Stream()  # batched copies refuse the legacy default stream
    torch.cuda.set_stream(work)
    pace = Pace()
    pace.wrap()
    for kind in KINDS:
        case = Case(kind, "layer_first", 64, TOKENS, "cuda", None)
        idx = case.indices(True, rng)
        eng = TransferEngine(case.host, "dma")
        calls, copied = planned_calls(eng, idx[0])
        stg = [torch.zeros(eng.backend.config.staging_bytes, dtype=torch.uint8, device="cuda") for _ in range(3)]
        side = streams.fresh(torch.device("cuda"))  # none of the engine's streams
        tall = [c[1] for c in calls if len(c[1])]
        flat = [c[2] for c in calls if len(c[2])]
        shape = {"bytes": copied, "of": case.nbytes, "chunks": len(calls),
                 "pitched calls": sum(map(len, tall)), "1-D copies": sum(map(len, flat)),
                 "pitched width": sorted({int(w) for t in tall for w in t[:, 2]})[:4],
                 "pitched rows": sorted({int(r) for t in tall for r in t[:, 3]})[:4]}
        log(f"{kind}/plan", shape)
        eng = TransferEngine(case.host, DMABackend(DMAConfig(pool_rows=64 << 10)))
        staged = TransferEngine(case.host, DMABackend(DMAConfig(pool_rows=0)))
        kernel = TransferEngine(case.host, "kernel")
        arms = {"engine, from the pool": lambda: measure(case, eng, "backup", idx, clock, 1),
                "engine, staged": lambda: measure(case, staged, "backup", idx, clock, 1),
                "kernel": lambda: measure(case, kernel, "backup", idx, clock, 1),
                "copies, chunk waits": lambda: copies_alone(calls, stg[:1], copied, True, side=side),
                "copies, mini engine": lambda: copies_alone(calls, stg, copied, True, side=side, gather=True)}
        times = in_turn(arms, lambda fn: fn())
        log(f"{kind}/layer_first/p64/scattered/backup", {k: cell(g, limits["backup"]) for k, g in times.items()})
        alloc = case.indices(False, rng)
        arms = {"engine, from the pool": lambda: measure(case, eng, "backup", alloc, clock, 1),
                "engine, staged": lambda: measure(case, staged, "backup", alloc, clock, 1)}
        times = in_turn(arms, lambda fn: fn())
        log(f"{kind}/layer_first/p64/allocator/backup", {k: cell(g, limits["backup"]) for k, g in times.items()})
        arms = {"both, from the pool": lambda: measure(case, eng, "both", idx, clock, 1),
                "both, staged": lambda: measure(case, staged, "both", idx, clock, 1)}
        times = in_turn(arms, lambda fn: fn())
        log(f"{kind}/layer_first/p64/scattered/both", {k: cell(g, limits["backup"]) for k, g in times.items()})
        for name, e in (("pool", eng), ("staged", staged)):
            paced = [pace.transfer(e, idx[0], idx[1], True) for _ in range(3)]
            best = min(paced, key=lambda r: r["total_ms"])
            gbps = [c["copy_gbps"] for c in best["chunks"]]
            log(f"{kind}/paced/{name}", {k: v for k, v in best.items() if k != "chunks"}
                | {"chunk_copy_gbps_median": float(np.median(gbps)), "chunk_copy_gbps": gbps,
                   "chunk_gaps_ms": [c["gap_ms"] for c in best["chunks"]]})
        log(f"{kind}/sms", {"pool": eng.backend.last_blocks, "staged": staged.backend.last_blocks})
        case.host.close()
        del case, eng, staged, kernel, arms, stg, calls
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
