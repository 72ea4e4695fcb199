"""Probe: does an engine's small device -> host read wait behind a DMA backup?

Runs 37-43 found that during a 32k DMA load, any host -> device copy another stream queued waited
for the whole load (80 ms), whatever its stream's priority, until the load's copy queue ran dry
(``copy_priority.py``); loads now drain every 4 layers (``DMAConfig.load_drain``). A backup copies
device -> host on the caller's stream, chunk after chunk. An engine reads its sampled tokens with
``.tolist()`` after every step (a device -> host copy, and the host waits for it), while the KV of
requests that finished is written back to the host. Prediction: without drains that read returns
only when the whole backup has landed (about 80 ms for 32k tokens, 4.29 GB); with
``DMAConfig.backup_drain=K`` within about K staging chunks (128 MiB each, about 2.4 ms); by the
zero-copy kernel backend at once.

Per arm: a 32k backup (MHA layer_first page 64, allocator slots) through an engine whose
background thread queues the chunks (or, "no background thread", queued before backup()
returns), then, right away or 30 ms later, ``.tolist()`` of an 8-element tensor made on the
current stream. Host clock from the backup call: when it returned, when the read was issued and
when it returned, when the engine's thread was free (the whole backup queued), and when the
backup was done (``synchronize`` after the read).

Runs 44 (``probe_output_copies_h200_run44.json``, code 94bb6e7: drains 0/1/4/8) and 45
(``..._run45.json``, this code): the prediction was refuted as put. With no drains and every
chunk queued, the read returned at 40 ms, not 80. Hypothesis: the backup's two parts (K, V) are
queued one after the other, the second one's first gather waits for the first one's copies (the
side stream joins the caller's at each part), so the copy queue runs dry between the parts and a
read waits for the rest of the part in flight: up to half an MHA backup, all of an MLA one. Issued 30 ms in, it returned 8.4-8.9 ms later with no
drains, 7.1-7.6 with a drain every 4 chunks, 2.1-2.5 every 1 or 2; issued when backup() had
queued all (4-9 ms in): 33-36 ms later with none, 2-4 with drains every 1, 2 or 4. The kernel
backend: 0.4-0.5 ms. Backups took 79.0-80.1 ms in every dma arm.
``--sweep``: the read issued 0 to 70 ms in, MHA and MLA (:func:`sweep`). Prediction (run 46): with
no drains an MHA read waits until 40 or 80 ms, whichever part it lands in, an MLA read until
80 ms; with drains every 4 chunks under 10 ms at any delay, for both. Met
(``probe_output_sweep_h200.json``, median waits): no drains, MHA 28.7, 18.7, 8.4 ms issued 10,
20, 30 ms in (the K part ends at 39 ms), 37.4, 27.3, 17.3, 7.4 issued 40-70 ms in (the backup
ends at 79); MLA 31.4, 21.0, 11.0 issued 10-30 ms in (its only part ends at 43). With drains
every 4 chunks: MHA 6.2-8.2 ms at any delay, MLA 0.3-4.2 (one wait of 8.5); backups took 79.3
and 43.3 ms, as without. The kernel backend: 0.3-0.5 ms.
Usage: python bench/probes/output_copies.py OUT.json [--tokens N] [--sweep]
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
