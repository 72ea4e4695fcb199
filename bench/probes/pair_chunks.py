"""Probe: in a DMA backup and load at once, when the host queued each chunk's copies and when
the device finished them, per direction.

After run 140: planning a pair's chunks in doubling batches returned the load's call sooner
and still ended the pair later (reverted), so the host's total time is not the whole story;
when it is spent matters. This wraps the DMA backend's ``_issue`` (the call that queues one
chunk's copies on a stream) to note, for every chunk, the host clock after it was queued and
a timing event on its stream after its copies. Then, per direction, with ``queued[k]`` and
``done[k]`` in ms after the backup call: the copy stream waited on the host before chunk k
for ``max(0, queued[k] - done[k - 1])`` (it had finished everything queued before), and
``host_idle_ms`` sums that over the chunks. A direction whose stream never waits is
device-bound; one whose idle time is a large share of the pair is held by the host (or by
the other direction's thread holding the GIL). ``gaps`` lists the five longest waits and the
chunk each came before, to tell a stretch of planning from many small ones.
Each case: two untimed pairs, then three noted (``rounds``); ``pair_ms`` is the pair's end
(the caller's stream after both), ``ratio`` the pair's GB/s over the mean one-way limit.
Predictions: on a slow host (``host speed:`` above 40 ms a call), MHA page_first single
scattered tokens show load idle time of 20 ms or more within ~100 ms, most of it early
(before the backup is queued); allocator slots show under 2 ms either way.
``--switch-ms X``: each case noted again with the interpreter's switch interval at X ms (5 by
default): a thread back from the runtime waits up to that long for the other thread to hand
over the GIL, so if the waits are the GIL's, they shrink with it.
Usage: python bench/probes/pair_chunks.py OUT.json [--tokens N] [--case KIND/LAYOUT/PAGE[/SLOTS] ...] [--switch-ms X]
"""

from __future__ import annotations

import sys
import time

import torch

import kvtier.transfer.dma as dma_mod
from kvtier.bench.transfer import Case, pair
from kvtier.transfer import TransferEngine
from probelib import JsonLog, args, start, switch_interval

PATH, TOKENS = args("/tmp/probe_pair_chunks.json")
CASES = [(c[0], c[1], int(c[2]), c[3] if len(c) > 3 else "scattered") for c in
         (sys.argv[i + 1].split("/") for i, a in enumerate(sys.argv) if a == "--case")] or \
    [("mha", "page_first", 1, "scattered"), ("mla", "page_first", 1, "scattered"),
     ("mha", "page_first", 1, "allocator")]
if bad := [c for c in CASES if c[3] not in ("scattered", "allocator")]:
    sys.exit(f"--case slots must be 'scattered' or 'allocator', got {bad}")
SWITCH = [None] + ([float(sys.argv[sys.argv.index("--switch-ms") + 1]) / 1e3] if "--switch-ms" in sys.argv else [])
log = JsonLog(PATH, tokens=TOKENS, cases=["/".join(map(str, c)) for c in CASES], switch_s=SWITCH)


def idle_summary(chunks: list[tuple[float, float, float]]) -> dict:
    """``chunks``: (queued_ms, done_ms, MB) of one direction's chunks. How long its stream
    waited on the host in all (it had finished what was queued before), the five longest
    waits (ms, before which chunk), and when its first and last chunk were queued and done."""
    chunks = sorted(chunks)
    waits = [(max(0.0, q - prev_done), k) for k, ((q, _, _), prev_done) in
             enumerate(zip(chunks[1:], [d for _, d, _ in chunks[:-1]]), start=1)]
    return {"chunks": len(chunks), "MB": round(sum(mb for _, _, mb in chunks), 1),
            "first_queued_ms": round(chunks[0][0], 2) if chunks else None,
            "last_queued_ms": round(chunks[-1][0], 2) if chunks else None,
            "last_done_ms": round(max(d for _, d, _ in chunks), 2) if chunks else None,
            "host_idle_ms": round(sum(w for w, _ in waits), 2),
            "gaps": [[round(w, 2), k] for w, k in sorted(waits, reverse=True)[:5] if w > 0]}


def noted_pair(engine, idx, notes: list) -> dict:
    """One pair, every chunk noted; returns its end and each direction's :func:`idle_summary`."""
    h1, d1, h2, d2 = idx
    notes.clear()
    begin = torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    begin.record()
    t0 = time.perf_counter()
    pair(engine, h1, d1, h2, d2, True)  # the current stream waits for both
    end = torch.cuda.Event(enable_timing=True)
    end.record()
    torch.cuda.synchronize()
    out = {"pair_ms": round(begin.elapsed_time(end), 2)}
    for to_host, name in ((True, "backup"), (False, "load")):
        out[name] = idle_summary([(1e3 * (t - t0), begin.elapsed_time(ev), mb)
                                  for way, t, ev, mb in notes if way == to_host])
    return out


def main() -> None:
    torch.cuda.set_stream(torch.cuda.Stream())
    clock, limits, rng = start(log)
    notes: list = []
    plain = dma_mod._issue

    def noting(tall, flat, host_base, stg_base, to_host, stream, batch_min=8):
        plain(tall, flat, host_base, stg_base, to_host, stream, batch_min)
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.ExternalStream(stream))
        nbytes = int(flat[:, 2].sum()) if len(flat) else 0
        nbytes += int((tall[:, 2] * tall[:, 3]).sum()) if len(tall) else 0
        notes.append((to_host, time.perf_counter(), ev, nbytes / 2**20))

    for kind, layout, ps, slots in CASES:
        case = Case(kind, layout, ps, TOKENS, "cuda", None)
        idx = case.indices(slots == "scattered", rng)
        engine = TransferEngine(case.host, "dma")
        for _ in range(2):  # plans, staging and Triton warmed up
            pair(engine, *idx, True)
        torch.cuda.synchronize()
        for switch in SWITCH:
            dma_mod._issue = noting
            try:
                with switch_interval(switch):
                    rounds = [noted_pair(engine, idx, notes) for _ in range(3)]
            finally:
                dma_mod._issue = plain
            gbps = [2 * case.nbytes / r["pair_ms"] / 1e6 for r in rounds if r["pair_ms"]]
            one_way = (limits["backup"] + limits["load"]) / 2  # as the bench's pairs
            log(f"{kind}/{layout}/p{ps}/{slots}/both" + (f", switch {1e3 * switch:g} ms" if switch else ""), {
                "ratio": [round(g / one_way, 3) for g in gbps], "rounds": rounds})
        case.host.close()
        del case, engine
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
