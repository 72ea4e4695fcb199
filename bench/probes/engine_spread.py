"""Probe: do engines of one backend differ from one another, transfer for transfer?

Since the stream fix (run 50) no dma or auto row one way on allocator slots is more than
0.02x below its sibling, but pairs (a backup and a load at once) still are: in run 50 auto
ran MHA page_first p64 scattered pairs at 1.55x in both rounds where the dma engine, by the
same DMA both ways, ran 1.64x in both rounds; MLA page_first p64 allocator pairs 1.51x
against 1.60x (in run 47 the two had swapped). A gap that holds across rounds but swaps
between runs belongs to an engine instance, not to the backend.

Hypothesis: CUDA maps streams onto a few hardware queues (``CUDA_DEVICE_MAX_CONNECTIONS``,
8 by default), so two distinct streams can share a queue and run in turn, as two aliased
streams did before the fix. A pair keeps six of kvtier's streams busy (the engine's backup
and load streams, each staging ring's side and drain-tick streams), and which of them share
a queue depends on where each engine's streams fall in PyTorch's pool.

Per shape, ``ENGINES`` dma engines on the same slots, timed in turn, after two warm-up
passes, three rounds (a round: each engine's median of five pairs or three one-way
transfers). Logged per engine: its cell, and its streams as ``priority#index`` in
PyTorch's pool (drawn once at the start to map handles to indices). Per shape: the spread
between engines (highest engine median minus lowest, as a ratio of the limit) against the
spread within one (the median over engines of highest round minus lowest). Run it once
with the default and once with ``CUDA_DEVICE_MAX_CONNECTIONS=32``. Prediction, if the
hypothesis holds: with 8 connections the spread between engines in pairs is at least twice
the spread within one, and with 32 it falls to the spread within one; one-way rows show
little of either.
Run 51 (``probe_engine_spread_h200_c8.json``, ``_c32.json``): refuted. The named dma engines
share one backend, so their staging rings and ring streams are the same; only the engines'
backup and load streams differ. Spread between engines against within one, as a ratio of
the limit: MHA page_first p64 scattered pairs 0.062 / 0.044 with 8 connections, 0.042 /
0.078 with 32; MLA page_first p64 allocator pairs 0.063 / 0.064 and 0.060 / 0.102; MLA
page_first p1 allocator backups 0.009 / 0.005 and 0.002 / 0.014. Pairs spread as much from
one round to the next as from one engine to the next, with 8 hardware queues or 32: a
pair row moves by about 0.06x with nothing changed, so auto's pair misses in run 50 are
within that. The one-way backups (0.933-0.942x) are steady, so their shortfall is real.
Usage: python bench/probes/engine_spread.py OUT.json [--tokens N]
"""

from __future__ import annotations

import os

import torch

from kvtier.bench.transfer import Case, measure
from kvtier.transfer import TransferEngine, streams
from probelib import JsonLog, args, cell, in_turn, start

PATH, TOKENS = args("/tmp/probe_engine_spread.json")
log = JsonLog(PATH, tokens=TOKENS, connections=os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "default (8)"))
ENGINES = 5
SHAPES = [("mha", "page_first", 64, True, "both"), ("mla", "page_first", 64, False, "both"),
          ("mla", "page_first", 1, False, "backup")]


def pool_index() -> dict[int, str]:
    """``{handle: "priority#index"}`` for PyTorch's pooled streams at both priorities kvtier
    uses; drawing a whole pool's worth leaves the round robin where it was."""
    names = {}
    for prio in (0, -1):
        for i in range(streams.POOL):
            names.setdefault(torch.cuda.Stream(priority=prio).cuda_stream, f"{prio}#{i}")
    return names


def engine_streams(eng, names) -> dict[str, str]:
    out = {"backup": eng.backup_stream, "load": eng.load_stream}
    for (_, to_host), ring in eng.backend._rings.items():
        side = "backup" if to_host else "load"
        out[f"{side} ring side"] = ring.side
        if ring._tick and ring._tick[0] is not None:
            out[f"{side} ring tick"] = ring._tick[0]
    return {k: names.get(s.cuda_stream, hex(s.cuda_stream)) for k, s in out.items()}


def main():
    clock, limits, rng = start(log)
    limits["both"] = (limits["backup"] + limits["load"]) / 2  # as the bench: a pair against one way
    names = pool_index()
    for kind, layout, ps, scattered, direction in SHAPES:
        case = Case(kind, layout, ps, TOKENS, "cuda", None)
        idx = case.indices(scattered, rng)
        engines = {f"dma{i}": TransferEngine(case.host, "dma") for i in range(ENGINES)}
        reps = 5 if direction == "both" else 3
        times = in_turn(engines, lambda eng: measure(case, eng, direction, idx, clock, reps))
        lim = limits[direction]
        row = {name: dict(cell(g, lim), streams=engine_streams(engines[name], names)) for name, g in times.items()}
        meds = [row[n]["ratio"] for n in engines]
        within = sorted((max(g) - min(g)) / lim for g in times.values())[ENGINES // 2]
        row["spread"] = {"between": round(max(meds) - min(meds), 3), "within": round(within, 3)}
        log(f"{kind}/{layout}/p{ps}/{'scattered' if scattered else 'allocator'}/{direction}", row)
        case.host.close()
        del case, engines


if __name__ == "__main__":
    main()
