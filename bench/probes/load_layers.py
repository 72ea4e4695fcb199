"""Probe: where a slow per-layer load loses its time, layer by layer, round by round.

MLA layer_first allocator loads met 0.95x in the full table of run 71 (0.955x at page 1,
0.956x at page 64) and were short alone in a fresh process minutes later (run 73: 0.945x and
0.947x), where one round of the page-1 row ran at 53.6 GB/s and the next at 51.0. Such a load
moves one layer at a time: a 37.7 MB copy from the host into staging on a side stream, then a
scatter of it into the device slots on the caller's stream. A round is slow either because
the copies themselves run slower (the link), or because the copy engine sits idle between
them (the host, or the scatters holding the staging ring), or at the ends (the host before
the first copy, the last scatter after the last copy).

Every chunk's copies (``dma._issue``) and scatter (``dma.copy_items``) are bracketed by
events on the stream each runs on, tagged with the layer (``DMABackend._load_chunks``); so
each round splits into: the start (call to the first copy), the copies' own time, the copy
engine's idle time between copies, the tail (last copy's end to the last scatter's end).
Ten rounds of each case, MLA layer_first pages 1 and 64, allocator slots, a dma engine,
32,768 tokens, after two untimed loads; then, without the events, ten loads with the default
drains (``DMAConfig.load_drain``: every 4 layers the copies wait behind a one-element kernel,
0.02-0.05 ms each in run 40) and ten with none, in turn.
Predictions: if the link, a slow round's copies are slower in every layer and the idle time is
the same; if the host or the ring, the copies run at one rate and the idle time grows. The
drains: 15 in a 61-layer load (7 in MHA's 32), so 0.3-0.75 ms of a 43 ms MLA load, 0.7-1.7%;
MLA page_first loads (32 layers a copy: one drain) lose none of it, and they are the MLA loads
that meet 0.95x. If so, no drains run 0.007-0.017x faster, and the marked rounds show gaps
before layers 4, 8, ...
Run 75 (`probe_load_layers_h200.json`): no slow round came; 0.55-0.62 ms to the first copy,
copies at 54.7 GB/s a layer, 0.18 ms idle between them, 0.16 ms of tail.

``--scattered`` (after run 81): MLA and DSA layer_first page-64 loads from scattered host
pages instead, the rows that swing between processes (MLA 0.841x in run 79, 0.925x in run
75; DSA by DMA 0.70-0.92x). Each copy call is also stamped with the host's clock when it is
queued, against the device's clock from an event recorded on an idle stream at the same
moment: ``lead_ms`` is how far ahead of the copy engine the host queued each layer's copies.
Predictions: a host-bound load has leads near zero (the engine waits for each layer's copies
to be queued; idle between copies grows with the host's time in the copy calls); a link-bound one has
leads growing through the load (the host finishes queueing long before the engine) and idle
time flat.
Run 82 (``probe_load_layers_scattered_h200.json``): link-bound. The host queued each layer's
copies a median of 8.6-11.9 ms (MLA) and 17.3-17.8 ms (DSA) ahead; only the first two copies
had leads under 0.05 ms. 1.9-2.7 ms before the first copy; MLA's layers copied at 52.5 GB/s
for seven rounds and 54.6 for three, DSA's at 47.3; unmarked 0.933x (MLA) and 0.909x (DSA).
Usage: python bench/probes/load_layers.py OUT.json [--tokens N] [--scattered]
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np
import torch

import kvtier.transfer.dma as dma_mod
from kvtier.bench.transfer import Case
from kvtier.transfer import TransferEngine
from kvtier.transfer.dma import DMABackend, DMAConfig
from probelib import JsonLog, args, cell, in_turn, start, transfer

PATH, TOKENS = args("/tmp/probe_load_layers.json")
SCATTERED = "--scattered" in sys.argv
# (kind, page size, scattered host pages)
CASES = [("mla", 64, True), ("dsa", 64, True)] if SCATTERED else [("mla", 1, False), ("mla", 64, False)]
log = JsonLog(PATH, tokens=TOKENS, cases=CASES)
ROUNDS = 10


class Marks:
    """Events around each chunk's copies and scatter while ``on``: (layer, kind, start, end)."""

    def __init__(self):
        self.on = False
        self.layer = None
        # (layer, kind, start, end, host seconds when the call began, and when it returned)
        self.spans: list[tuple[int, str, torch.cuda.Event, torch.cuda.Event, float, float]] = []

    def bracket(self, kind: str, stream, fn, *a, **k):
        if not self.on:
            return fn(*a, **k)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        called = time.perf_counter()
        s.record(stream)
        out = fn(*a, **k)
        e.record(stream)
        self.spans.append((self.layer, kind, s, e, called, time.perf_counter()))
        return out


M = Marks()


def install() -> None:
    real_issue, real_copy, real_chunks = dma_mod._issue, dma_mod.copy_items, dma_mod.DMABackend._load_chunks

    def issue(*a, **k):  # (tall, flat, host_base, stg_base, to_host, stream, batch_min)
        if a[4]:
            return real_issue(*a, **k)
        return M.bracket("copy", torch.cuda.ExternalStream(a[5]), real_issue, *a, **k)

    def copy_items(*a, **k):  # argument 10: to_buf (a gather); a scatter runs on the current stream
        if a[10]:
            return real_copy(*a, **k)
        return M.bracket("scatter", torch.cuda.current_stream(), real_copy, *a, **k)

    def load_chunks(self, *a, **k):  # (ring, cur, part, p, ptrs, d_of, host_base, layer, ...)
        M.layer = a[7]
        return real_chunks(self, *a, **k)
    dma_mod._issue, dma_mod.copy_items, dma_mod.DMABackend._load_chunks = issue, copy_items, load_chunks


def dma_layer_bytes(case, eng, idx) -> int:
    """Bytes a layer of this load moves by copies: the parts the DMA backend plans (DSA's
    index-K pages, under ``kernel_below``, go through the kernel, which is not bracketed)."""
    h = idx[0].cpu().numpy()
    return sum(p.item_bytes * h.size for p in case.host.transfer_parts()
               if eng.backend.plan_part(p, h, False) is not None)


def one_load(case, eng, idx, marked: bool, layer_bytes: int = 0) -> dict:
    h, d = idx[0], idx[1]
    torch.cuda.synchronize()
    M.spans.clear()
    M.on = marked
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()  # the device is idle: t0 runs at about host0 (plus a launch, ~0.01 ms)
    host0 = time.perf_counter()
    transfer(eng, h, d, False)
    t1.record()
    t1.synchronize()
    M.on = False
    total = t0.elapsed_time(t1)
    out = {"gbps": round(case.nbytes / total / 1e6, 2), "total_ms": round(total, 3)}
    if not marked:
        return out
    ms = [(layer, kind, t0.elapsed_time(s), t0.elapsed_time(e), (q0 - host0) * 1e3, (q1 - host0) * 1e3)
          for layer, kind, s, e, q0, q1 in M.spans]
    copies = sorted((a, b, layer) for layer, kind, a, b, *_ in ms if kind == "copy")
    scatters = sorted((a, b, layer) for layer, kind, a, b, *_ in ms if kind == "scatter")
    # How far ahead of the copy engine the host had each copy call queued: its start on the
    # device less the host's clock when the call returned (both from the load's call). Near
    # zero or below: the engine was waiting for the host (a batched call submits at its end).
    leads = [a - q1 for layer, kind, a, b, q0, q1 in ms if kind == "copy"]
    busy = [b - a for a, b, _ in copies]
    idle = [max(0.0, copies[i + 1][0] - copies[i][1]) for i in range(len(copies) - 1)]
    per_layer: dict[int, float] = {}
    for a, b, layer in copies:
        per_layer[layer] = per_layer.get(layer, 0.0) + (b - a)
    out.update({
        "start_ms": round(copies[0][0], 3),
        "copy_ms": round(sum(busy), 3),
        "idle_between_copies_ms": round(sum(idle), 3),
        "tail_ms": round(scatters[-1][1] - copies[-1][1], 3),
        "copies": len(copies),
        "host_queued_all_ms": round(max(q1 for *_, q1 in ms), 3),
        "host_in_copy_calls_ms": round(sum(q1 - q0 for _, kind, a, b, q0, q1 in ms if kind == "copy"), 3),
        "lead_ms": {"min": round(min(leads), 3), "median": round(statistics.median(leads), 3),
                    "max": round(max(leads), 3), "under_0.05": sum(x < 0.05 for x in leads)},
        "copy_gbps_by_layer": [round(layer_bytes / t / 1e6, 2) for _, t in sorted(per_layer.items())],
        # [layer of the copy after the gap, ms]: drains (DMAConfig.load_drain, every 4 layers,
        # 0.02-0.05 ms each in run 40) show as gaps before layers 4, 8, ...
        "idle_gaps_over_0.01ms": [[copies[i + 1][2], round(g, 3)] for i, g in enumerate(idle) if g > 0.01],
    })
    return out


def summary(rounds: list[dict]) -> dict:
    keys = ("gbps", "start_ms", "copy_ms", "idle_between_copies_ms", "tail_ms", "host_queued_all_ms",
            "host_in_copy_calls_ms")
    out = {k: [r[k] for r in rounds] for k in keys}
    out["lead_ms_median"] = [r["lead_ms"]["median"] for r in rounds]
    out["copies_with_lead_under_0.05ms"] = [r["lead_ms"]["under_0.05"] for r in rounds]
    rates = [statistics.median(r["copy_gbps_by_layer"]) for r in rounds]
    out["median_layer_copy_gbps"] = [round(x, 2) for x in rates]
    return out


def main():
    clock, limits, _ = start(log)
    install()
    for kind, ps, scattered in CASES:
        case = Case(kind, "layer_first", ps, TOKENS, "cuda", None)
        idx = case.indices(scattered, np.random.default_rng(1))
        engines = {"default drains": TransferEngine(case.host, "dma"),
                   "no drains": TransferEngine(case.host, DMABackend(DMAConfig(load_drain=0)))}
        for eng in engines.values():
            for _ in range(2):
                one_load(case, eng, idx, False)
        eng = engines["default drains"]
        layer_bytes = dma_layer_bytes(case, eng, idx)
        marked = [one_load(case, eng, idx, True, layer_bytes) for _ in range(ROUNDS)]
        # The drains' cost: the default against none, unmarked, in turn.
        plain = in_turn(engines, lambda e: one_load(case, e, idx, False)["gbps"], warmups=0, rounds=ROUNDS)
        log(f"{kind}/layer_first/p{ps}/{'scattered' if scattered else 'allocator'}/load", {
            "limit_gbps": limits["load"], "summary": summary(marked),
            "unmarked": {k: cell(v, limits["load"]) for k, v in plain.items()},
            "slowest": min(marked, key=lambda r: r["gbps"]), "fastest": max(marked, key=lambda r: r["gbps"])})
        case.host.close()
        del case, eng, engines
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
