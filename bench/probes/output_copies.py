"""Probe: does an engine's small device -> host read wait behind a DMA backup?

An engine reads its sampled tokens with ``.tolist()`` after every step (a device -> host copy
the host waits for) while the KV of finished requests is written back. A DMA backup's copies go
device -> host chunk after chunk, and the copy engine serves one stream's queue until it runs
dry. Per arm, a 32k-token layer_first page-64 backup on allocator slots, then ``.tolist()`` of an
8-element tensor right away or later; host clock from the backup call: when it returned, when the
read was issued and returned, when the engine's thread had queued everything, when the backup was
done. Default: MHA, DMA with ``backup_drain`` 0, 1, 2, 4 and the kernel, reads at 0 and 30 ms.
``--sweep``: MHA (two parts, K then V) and MLA (one part), DMA with no drains and a drain every 4
chunks, and the kernel, the read issued 0 to 70 ms into the backup.

Run: ``PYTHONPATH=.:bench/probes python bench/probes/output_copies.py OUT.json [--tokens N] [--sweep]``.
Backs: ``DMAConfig.backup_drain`` = 4 (with ``--sweep``: without drains a read waits for the end
of the part in flight, up to 37.6 ms for MHA and 31.5 for MLA; with a drain every 4 chunks at
most 8.5 ms, and the backups take as long, 79.0-80.3 ms for MHA).
Current answer: ``bench/results/h200/probes.json ("output_copies")`` (the ``--sweep`` run).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from kvtier.bench.transfer import Case
from kvtier.transfer import TransferEngine
from kvtier.transfer.dma import DMABackend, DMAConfig
from probelib import JsonLog, args, in_turn

PATH, TOKENS = args("/tmp/probe_output_copies.json")
log = JsonLog(PATH, tokens=TOKENS)


def engine(host, backend: str, drain: int = 0, background: bool = True) -> TransferEngine:
    io = DMABackend(DMAConfig(backup_drain=drain)) if backend == "dma" else backend
    return TransferEngine(host, io, background_backups=background)


def one(eng, h, d, delay_ms: float) -> dict:
    sampled = torch.arange(8, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    handle = eng.backup(h, d)
    called = time.perf_counter()
    if delay_ms:
        time.sleep(delay_ms / 1e3)
    issued = time.perf_counter()
    got = (sampled + 1).tolist()
    returned = time.perf_counter()
    # when the engine's thread had queued the whole backup (at once if it has none)
    queued = eng._issuer.submit(time.perf_counter).result() if eng._issuer is not None else returned
    handle.synchronize()
    done = time.perf_counter()
    ms = lambda t: round(1e3 * (t - t0), 3)  # noqa: E731
    return {"backup_returned_ms": ms(called), "read_issued_ms": ms(issued), "read_returned_ms": ms(returned), "backup_done_ms": ms(done),
            "queued_by_ms": ms(queued),
            "correct": got == list(range(1, 9))}


def main():
    case = Case("mha", "layer_first", 64, TOKENS, "cuda", None)
    h, d, _, _ = case.indices(False, np.random.default_rng(0))
    arms = {}
    for name, backend, drain in [("dma, no drains", "dma", 0), ("dma, drain every chunk", "dma", 1),
                                 ("dma, drain every 2 chunks", "dma", 2), ("dma, drain every 4 chunks", "dma", 4),
                                 ("kernel", "kernel", 0)]:
        eng = engine(case.host, backend, drain)
        for delay in (0, 30):
            arms[f"{name}, read {delay} ms after the backup call"] = (eng, delay)
        if backend == "dma":  # every chunk queued before backup() returns: the queue is full
            arms[f"{name}, no background thread, read when backup() returns"] = (
                engine(case.host, backend, drain, background=False), 0)
    for k, v in in_turn(arms, lambda arm: one(arm[0], h, d, arm[1])).items():
        log(k, v)


def sweep():
    """``--sweep``: the read issued 0-70 ms into the backup, MHA (two parts) and MLA (one), dma
    with no drains and every 4 chunks, and the kernel; per delay, how long the read waited."""
    for kind in ("mha", "mla"):
        case = Case(kind, "layer_first", 64, TOKENS, "cuda", None)
        h, d, _, _ = case.indices(False, np.random.default_rng(0))
        engines = {"dma, no drains": engine(case.host, "dma", 0), "dma, drain every 4 chunks": engine(case.host, "dma", 4),
                   "kernel": engine(case.host, "kernel")}
        delays = range(0, 80, 10)
        for eng in engines.values():  # warm-up
            one(eng, h, d, 0)
        waits = {name: {t: [] for t in delays} for name in engines}
        for _ in range(3):
            for t in delays:
                for name, eng in engines.items():
                    r = one(eng, h, d, t)
                    waits[name][t].append([r["read_issued_ms"], round(r["read_returned_ms"] - r["read_issued_ms"], 3),
                                           r["backup_done_ms"]])
        for name, by in waits.items():
            log(f"{kind}: {name} (per delay: [issued, waited, backup done] ms)", {str(t): v for t, v in by.items()})
        case.host.close()
        del case, engines


if __name__ == "__main__":
    import sys
    sweep() if "--sweep" in sys.argv else main()
