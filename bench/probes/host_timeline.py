"""Probe: when the host reaches each step of a DMA transfer, and when the device starts it.

Run 20 (``probe_host_plan_h200.json``): a DMA transfer timed from before the
engine call runs 1-2 ms longer than the same transfer timed from its ``run``,
and planning is no longer in that gap. This finds the rest. Each step of the
engine call (``_cuda``, the index check, ``prepare``, the mean-copy bound, the
index copy, each part's chunk loop) is wrapped here, for this probe only, so
that on entry and exit it notes the host clock and records an event on an
idle "marker" stream: such an event fires as soon as the host has queued it,
so its device time says when the host got there. The first gather or copy of
each part is bracketed by events on its own stream, which fire when the
device actually runs it. All times are milliseconds after a start event
recorded just before the call, as the bench records it.

Cases: MLA page_first page 1 backup and per-layer load, MLA layer_first page
1 backup and per-layer load, MHA layer_first page 1 backup, and a backup and a
load queued back to back (the bench's "both" row), allocator slots, 32,768
tokens; three calls of each after two warm-ups, the last logged in full and
the first-copy start of each. (Until run 25 "both" also ran with the backup
queued inline by the caller, ``background_backups=False``: the A/B below.)

Run 21 (inline then, ``probe_host_timeline_h200_run21.json``): the first copy
started 1.8-2.4 ms after the call (planning bound 0.6 ms, index copy 0.5 ms,
the first chunk's gather and copies 0.8 ms); queueing a backup's chunks
held the host 8-10 ms per part, so in "both" the load's first copy started
at 15 ms (MLA) and 23 ms (MHA) of a 61 and 105 ms pair. Run 22 (the A/B):
MLA pairs 77.8-79.5 GB/s in the background against 66.6-69.3 inline, MHA
87-92 against 75-84 (``probe_host_timeline_h200_run22.json``). Run 23, the thread
giving way to a load being prepared: the load's first copy at 7.2-7.8 ms,
not 11-12 (``probe_host_timeline_h200_run23.json``). Run 27
(``probe_host_timeline_h200_run27.json``): the first copy of an MLA backup, page_first or
layer_first, starts 1.07-1.13 ms after the call (2.8 ms in run 24), and the transfers run at
52.9-53.2 GB/s (0.96x).
Run 59 (``probe_host_timeline_h200_run59.json``; the caller now also queues the backup's first
96 MiB): MLA page_first p1 backup, the first gather at 1.43 ms and the first copy at 1.78 ms
after the call (1.32-1.43 ms to the first device work over three calls), 43.9 ms in all.
On the way: index check 0.09 ms; the engine 0.18 ms; ``prepare`` to its host order 0.23 ms
(``check_mapped`` and ``Runs.of``, 0.04 ms alone on a CI machine); the planning bound 0.11 ms;
**the device slots to the device 0.46 ms** (``fetch_index`` alone: 0.08 ms); then 0.35 ms
between launching the first gather and queueing its copy (the host is behind: the copy starts
as soon as it is queued). The load: its first copy at 1.59 ms. Each step of those is now
timed alone as well ("host costs"), to find where the 0.4 ms of the index copy goes.
Run 61 (``probe_host_timeline_h200_run61.json``): the same picture (first device work at
1.48-1.59 ms over three calls, the index copy 0.58 ms in the call), while each step alone,
back to back, takes a fraction: ``is_pinned`` 0.0008 ms and ``check_mapped`` 0.0006 ms (so the
switch to the pool's own record saved nothing measurable), ``Runs.of`` 0.025, the index copy
0.07, the index check 0.005. ``cold_host`` and ``host_steps`` (runs 63-64) take it from there.
Usage: python bench/probes/host_timeline.py OUT.json [--tokens N]
"""

from __future__ import annotations

import time

import numpy as np
import torch

import kvtier.host_pool as host_pool_mod
import kvtier.transfer.dma as dma_mod
import kvtier.transfer.engine as engine_mod
from kvtier.bench.transfer import Case
from kvtier.transfer import TransferEngine
from probelib import JsonLog, args

PATH, TOKENS = args("/tmp/probe_host_timeline.json")
log = JsonLog(PATH, tokens=TOKENS)


class Timeline:
    """Marks (label, host ms, event on the marker stream or on a working stream)."""

    def __init__(self):
        self.marker = torch.cuda.Stream()
        self.marks: list[tuple[str, float, torch.cuda.Event]] = []
        self.start_host = 0.0
        self.start: torch.cuda.Event | None = None
        self.on = False
        self.gen = 0  # one per begin(): "first" calls are first within a traced call

    def begin(self):
        self.gen += 1
        self.marks.clear()
        self.start = torch.cuda.Event(enable_timing=True)
        self.start.record()
        self.start_host = time.perf_counter()
        self.on = True

    def mark(self, label: str, stream=None):
        if not self.on:
            return
        e = torch.cuda.Event(enable_timing=True)
        e.record(stream or self.marker)
        self.marks.append((label, 1e3 * (time.perf_counter() - self.start_host), e))

    def end(self) -> list[dict]:
        self.on = False
        torch.cuda.synchronize()
        return [{"step": label, "host_ms": round(h, 3), "device_ms": round(self.start.elapsed_time(e), 3)}
                for label, h, e in self.marks]


T: Timeline  # made in main(): it needs CUDA


def traced(owner, name: str, label: str):
    """Wrap ``owner.name`` so each call marks its entry and exit."""
    real = getattr(owner, name)

    def wrapper(*a, **k):
        T.mark(f"{label} >")
        try:
            return real(*a, **k)
        finally:
            T.mark(f"{label} <")
    setattr(owner, name, wrapper)


def first_on_stream(owner, name: str, label_of, stream_of):
    """Bracket the first call of ``owner.name`` per traced call and label (``label_of(args)``:
    which direction) by events on the stream it runs on: they fire when the device runs it."""
    real = getattr(owner, name)
    seen = set()

    def wrapper(*a, **k):
        label = label_of(*a, **k)
        first = T.on and (label, T.gen) not in seen
        if first:
            seen.add((label, T.gen))
            s = stream_of(*a, **k)
            T.mark(f"{label}: device starts", s)
        out = real(*a, **k)
        if first:
            T.mark(f"{label}: device done", s)
        return out
    setattr(owner, name, wrapper)


def install():
    traced(engine_mod.TransferEngine, "_cuda", "engine call")
    traced(host_pool_mod.HostKVCache, "_check_indices", "index check")
    traced(dma_mod.DMABackend, "prepare", "prepare")
    traced(dma_mod.DMABackend, "in_host_order", "host order")
    traced(dma_mod.DMABackend, "plan_part", "plan_part (bound)")
    traced(dma_mod, "on_device", "index to device")
    traced(dma_mod.DMABackend, "_backup_chunks", "backup chunk loop")
    traced(dma_mod.DMABackend, "_load_chunks", "load chunk loop")
    # The first gather or scatter (on the current stream; ``to_buf`` is argument 10) and the
    # first batch of copies each way (its stream is argument 5, ``to_host`` argument 4).
    first_on_stream(dma_mod, "copy_items", lambda *a, **k: "first gather" if a[10] else "first scatter",
                    lambda *a, **k: torch.cuda.current_stream())
    first_on_stream(dma_mod, "_issue", lambda *a, **k: "first copies " + ("D2H" if a[4] else "H2D"),
                    lambda *a, **k: torch.cuda.ExternalStream(a[5]))


def run_case(name, case, h1, d1, h2, d2, what, background=True):
    eng = TransferEngine(case.host, "dma", background_backups=background)

    def go():
        if what == "backup":
            eng.backup(h1, d1).wait()
        elif what == "load":
            ld = eng.load(h1, d1)
            ld.wait_layer(ld.layer_num - 1)
        else:
            hd = eng.backup(h1, d1)
            ld = eng.load(h2, d2)
            hd.wait()
            ld.wait_layer(ld.layer_num - 1)
    for _ in range(2):
        go()
        torch.cuda.synchronize()
    summary = []
    for rep in range(3):
        torch.cuda.synchronize()
        T.begin()
        go()
        T.mark("end of the caller's queue", torch.cuda.current_stream())
        marks = T.end()
        total = marks[-1]["device_ms"]
        starts = [m for m in marks if m["step"].endswith("device starts")]
        summary.append({"total_ms": total, "first_device_work_ms": starts[0]["device_ms"] if starts else None,
                        "gbps": round((2 if what == "both" else 1) * case.nbytes / total / 1e6, 2)})
    log(f"{name}/{what}" + ("" if background else " (backup queued inline)"), {"summary": summary, "last": marks})


def host_costs(case, h1, d1):
    """Host milliseconds of the steps before a backup's first copy, each timed alone (median
    of 20): run 21 saw 0.6 ms for the planning bound that takes 0.07 ms on a CI machine."""
    from kvtier.transfer import streams
    from kvtier.transfer.dma_plan import RAMP_MIN_BYTES, ChunkedPlan, Runs, mean_copy_bound
    from kvtier.transfer.kernel import check_mapped
    from kvtier.transfer.triton_kernels import fetch_index
    side = streams.fresh(torch.device("cuda"), 0)
    part, hn = case.host.transfer_parts()[0], h1.numpy()
    staging = dma_mod.DMAConfig().staging_bytes

    def ms(fn):
        fn()
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
        return round(float(np.median(times)), 4)
    plan = ChunkedPlan(part.host, hn, part.layer_num, staging, ramp=RAMP_MIN_BYTES)
    return {
        "mean_copy_bound": ms(lambda: mean_copy_bound(part.host, hn, part.layer_num, staging)),
        "chunked_plan_init": ms(lambda: ChunkedPlan(part.host, hn, part.layer_num, staging, ramp=RAMP_MIN_BYTES)),
        "first_chunk_calls": ms(lambda: (plan._calls.clear(), plan.calls(0))),
        "pin_memory": ms(lambda: d1.pin_memory()),
        "fetch_index": ms(lambda: fetch_index(d1, torch.device("cuda"))),
        "event_record": ms(lambda: torch.cuda.Event().record()),
        # Since run 59 (the timeline: 0.23 ms from ``prepare`` to its host order, 0.46 ms for the
        # index to the device, 0.18 ms in the engine before ``prepare``): the steps in there.
        "is_pinned (what check_mapped asked until after run 60)": ms(lambda: part.host_raw.is_pinned()),
        "check_mapped": ms(lambda: check_mapped(part)),
        "runs_of": ms(lambda: Runs.of(hn)),
        "on_device": ms(lambda: dma_mod.on_device(d1, torch.device("cuda"))),
        "index_check": ms(lambda: case.host._check_indices(h1, d1, case.host.device_pool, want_numpy=True)),
        "streams_apart": ms(lambda: streams.apart(side, torch.device("cuda"), 0, torch.cuda.current_stream())),
        "wait_stream": ms(lambda: side.wait_stream(torch.cuda.current_stream())),
    }


def main():
    global T
    T = Timeline()
    install()
    rng = np.random.default_rng(0)
    case = Case("mla", "layer_first", 1, TOKENS, "cuda", None)
    log("host costs, mla/layer_first/p1", host_costs(case, *case.indices(False, rng)[:2]))
    case.host.close()
    del case
    # MLA page_first first: its allocator rows (0.91-0.94x in runs 24-26) have no timeline yet.
    for kind, layout, whats in (("mla", "page_first", ("backup", "load")),
                                ("mla", "layer_first", ("backup", "load", "both")),
                                ("mha", "layer_first", ("backup", "both"))):
        case = Case(kind, layout, 1, TOKENS, "cuda", None)
        idx = case.indices(False, rng)
        for what in whats:
            run_case(f"{kind}/{layout}/p1/allocator", case, *idx, what)
        case.host.close()
        del case
        torch.cuda.empty_cache()

if __name__ == "__main__":
    main()
