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
Usage: python bench/probes/scattered_backup.py OUT.json [--tokens N]
"""

from __future__ import annotations

import numpy as np
import torch

import kvtier.transfer.dma as dma_mod
from kvtier.bench.transfer import Case, measure
from kvtier.transfer import TransferEngine
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


def copies_alone(calls, stg: torch.Tensor, nbytes: int, held: bool, shuffle=None) -> float:
    """GB/s of queueing ``calls`` (:func:`planned_calls`) from ``stg`` on the current stream.
    ``held``: the stream sleeps first, so the host has queued everything before the clock
    starts. ``shuffle``: an rng that puts each chunk's pitched calls in a random order."""
    s = torch.cuda.current_stream()
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if held:
        torch.cuda._sleep(200_000_000)  # about 100 ms: longer than queueing a backup's calls
    t0.record(s)
    for base, tall, flat in calls:
        if shuffle is not None and len(tall):
            tall = tall[shuffle.permutation(len(tall))]
        dma_mod._issue(tall, flat, base, stg.data_ptr(), True, s.cuda_stream)
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
        stg = torch.empty(eng.backend.config.staging_bytes, dtype=torch.uint8, device="cuda")
        tall = [c[1] for c in calls if len(c[1])]
        flat = [c[2] for c in calls if len(c[2])]
        shape = {"bytes": copied, "of": case.nbytes, "chunks": len(calls),
                 "pitched calls": sum(map(len, tall)), "1-D copies": sum(map(len, flat)),
                 "pitched width": sorted({int(w) for t in tall for w in t[:, 2]})[:4],
                 "pitched rows": sorted({int(r) for t in tall for r in t[:, 3]})[:4]}
        log(f"{kind}/plan", shape)
        shuffle = np.random.default_rng(1)
        arms = {"engine": lambda: measure(case, eng, "backup", idx, clock, 1),
                "copies": lambda: copies_alone(calls, stg, copied, True),
                "copies, host on the clock": lambda: copies_alone(calls, stg, copied, False),
                "copies, shuffled": lambda: copies_alone(calls, stg, copied, True, shuffle)}
        times = in_turn(arms, lambda fn: fn())
        log(f"{kind}/layer_first/p64/scattered/backup", {k: cell(g, limits["backup"]) for k, g in times.items()})
        paced = [pace.transfer(eng, idx[0], idx[1], True) for _ in range(3)]
        best = min(paced, key=lambda r: r["total_ms"])
        gbps = [c["copy_gbps"] for c in best["chunks"]]
        log(f"{kind}/paced", {k: v for k, v in best.items() if k != "chunks"}
            | {"chunk_copy_gbps_median": float(np.median(gbps)), "chunk_copy_gbps": gbps,
               "chunk_gaps_ms": [c["gap_ms"] for c in best["chunks"]]})
        case.host.close()
        del case, eng, stg, calls
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
