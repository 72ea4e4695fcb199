"""Probe: do layer_first page-64 backups to scattered host pages lose their time in the copies
themselves, or in the engine around them?

Run 82 (``probe_copy_streams_h200.json``) timed the copies such a backup is made of, alone:
one pitched copy per page, 61 rows (layers) of 64 KiB to random places in a 1 GiB pinned
buffer, at 0.897x of the link; 128 KiB rows at 0.946x; batched 1-D copies of 64 KiB at 0.878x.
The engine's DMA backups of these rows ran at 0.748x (MLA, 72 KiB a page and layer), 0.842x
(MHA, 128 KiB) and 0.706x (DSA) in run 81, and the kernel at 0.79-0.90x. The hardware was
said to block them (run 17: 64 KiB copies at 0.55x); run 17 queued 16,384 copies in one
batched call, the DMA backend queues a chunk's.

Per kind (MHA, MLA, DSA), layer_first, page 64, 32,768 tokens to scattered host pages as the
transfer table draws them, timed in turn (three rounds after two warm-ups):
- ``engine``: the dma engine's backup, as the table times it;
- ``copies``: the same backup's copies alone, as the engine plans them (its slot order, its
  chunks, pitched and batched calls as ``dma._issue`` queues them), from one staging-sized
  device buffer, no gathers, queued while the stream sleeps (so the host's queueing is off
  the clock; GB/s of the bytes they move: DSA's index-K pages go through the kernel and are
  left out);
- ``copies, host on the clock``: the same, the stream not held (the host's queueing counts);
- ``copies, shuffled``: ``copies`` with the pitched calls in a random order (the engine sorts
  pages by host address);
and once, the engine's backup paced chunk by chunk (each chunk's copies and gather bracketed
by events: the copies' own GB/s and the gaps between chunks).
Predictions: if the copies are the limit, ``copies`` runs as ``engine`` (0.75-0.84x) and below
run 82's copies in a 1 GiB buffer (the pool spreads pages over 4.6-8.6 GB); if the engine,
``copies`` runs near 0.9x and the paced chunks show gaps or slow copies beside the gathers.
Run 83 (``probe_scattered_backup_h200_run83.json``): the engine. Its own copies, queued ahead
in address order, ran at 0.879x (MLA), 0.921x (MHA), 0.870x (DSA); shuffled, or queued as
the host issued them, at 0.943-0.964x; the engine at 0.745x, 0.852x, 0.702x. Paced, its chunks
copied at the address-order rate (MLA 47.2, MHA 50.2 GB/s), 2.3-2.6 ms passed before the first
copy, and DSA's index-K part (through the kernel) ran 13.5 ms after the last copy, on the
copies' stream.
Run 84 (``_run84.json``), with two changes: the engine's backup chunks' pitched copies in a
shuffled order (``engine``) against address order: 0.859x against 0.879x (MHA), 0.775x against
0.787x (DSA): shuffling does nothing inside the engine, and was taken back. DSA's index-K part
beside the copies (``DMAConfig.kernel_aside``) against on their stream: 0.775x against 0.757x,
kept; paced, the copies ran at 11-13 GB/s while that kernel ran beside them.
So the engine's copies run slower than the same copies alone (MHA 50.6 GB/s a chunk against
53.2), and no order explains it. Since run 84 the engine is timed with its staging kernels
(gathers) on 16 and on 132 SMs, with 512 MiB staging and with no drains, and the paced
backup logs every gather's span: if the gathers beside the copies slow them, gentler ones
(16 SMs) cost the copies less, or fewer gathers (512 MiB chunks).
Run 85 (``_run85.json``): none of them. Engine 0.740x (MLA), 0.840x
(MHA), 0.738x (DSA); gathers on 16 SMs 0.733/0.823/0.732x, on 132 0.746/0.827/0.746x, 512 MiB
staging 0.776/0.839/0.721x, no drains 0.720/0.835/0.728x; DSA's kernel parts in line 0.684x.
A gather (0.27 ms) overlaps a tenth of each chunk's copy (2.7-2.9 ms). The copies alone as in
run 83. So what slows the engine's copies is still unknown: not the gathers' SMs, the chunk
size, the drains or the order of a chunk's copies.
Since run 85 (not yet run) ``copies`` grows toward the engine one trait at a time, all held:
``chunk waits`` (each chunk's copies wait for an event from a second stream, as for their
gather), ``3 buffers`` (chunks read three staging buffers in turn, each reused once the
copies that last read it are done), ``mini engine`` (and a kernel on the second stream
rewrites each buffer before its copies, as a gather does), and that shuffled; and the
engine with every chunk queued in the caller's thread (``engine, queued inline``: no
background thread). Prediction: the first arm that drops from about 0.88-0.92x (``copies``)
to the engine's rate names what slows the engine; if none does, the cause is outside this
pipeline (the host's threads, unless ``queued inline`` recovers it; else the gathers' own
reads of the device pool).
Run 88 (``_run88.json``): ``mini engine`` seemed to name it. The copies alone
0.940/0.963/0.944x (MLA, MHA, DSA) with chunk waits, and with three buffers; with a kernel
rewriting each buffer beside them 0.850/0.907/0.851x, shuffled the same; the engine
0.816/0.883/0.795x, queued inline the same (not the host's threads). Paced, a gather overlaps the first 0.17-0.27 ms of
each chunk's 2.6-2.9 ms copy. Page_first page-64 scattered backups, whose copies are 4.5 MB,
meet 0.9x through the same gathers: short rows suffer, long ones do not.
Since run 88 the engine copies such backups straight from the device pool
(``DMAConfig.pool_rows``, :class:`~kvtier.transfer.dma_plan.PoolPlan`: no staging, no
gather): arms ``engine, from the pool`` against ``engine, staged`` (``pool_rows=0``) and
the kernel, on scattered host pages and on allocator slots, and the pool path paced.
Predictions: from the pool near the copies alone (MHA 0.93-0.95x, MLA 0.90-0.93x; DSA lower,
its index-K part through the kernel beside them), the first copy sooner (no gather before
it); on allocator slots within 0.01x of staged.
Run 89 (``_run89.json``): wrong. In turn, from the pool against staged:
0.842/0.807x (MLA), 0.885/0.882x (MHA), 0.734/0.768x (DSA); the kernel 0.872/0.903/0.792x.
On allocator slots 0.844/0.964x, 0.890/0.981x, 0.848/0.975x: a page-long row on the host
side costs the copies more than any gather did, staging or not. The copies alone (chunk
waits) came out at 0.865/0.920/0.874x, not run 88's 0.940/0.963/0.944x, and the kernel
beside them (``mini engine``) cost them 0.010-0.015x, not 0.06-0.09x: so what sets the
copies' rate is the host rows' length (and the process), not the gather. The pool path
stays, off by default (``pool_rows=0``), for engines that want backups on no SMs.
Since run 89: the pool path's backup and a load at once (``both``) against staged, and the
backups again, in a second process.
Run 90 (``probe_scattered_backup_h200.json``): as run 89. From the pool against staged
0.848/0.816x (MLA), 0.888/0.890x (MHA), 0.773/0.799x (DSA); allocator slots 0.857/0.972x,
0.892/0.988x, 0.857/0.984x; with a load at once 1.447/1.418x, 1.549/1.548x, 1.216/1.269x. The
copies alone 0.875/0.926/0.882x, beside a kernel 0.861/0.917/0.867x. Paced, the pool path's
first copy 1.5-2.6 ms after the call against 2.0-2.9 staged.
Usage: python bench/probes/scattered_backup.py OUT.json [--tokens N]
"""

from __future__ import annotations

import numpy as np
import torch

import kvtier.transfer.dma as dma_mod
from kvtier.bench.transfer import Case, measure
from kvtier.transfer import TransferEngine, streams
from kvtier.transfer.dma import DMABackend, DMAConfig
from kvtier.transfer.dma_plan import Runs
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
        dma_mod._issue(tall, flat, base, buf.data_ptr(), True, s.cuda_stream)
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
        # Runs 83-88's arms that named nothing new are not timed again (the docstring has them).
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
