"""Probe: where a DMA backup or load on allocator slots spends its time, chunk by chunk.

MLA and MHA page_first, single tokens, 32k tokens, allocator slots (each staging chunk one copy).
Part 1, paced: every chunk's gather (or scatter) and copy bracketed by events on its stream; per
chunk its bytes, copy GB/s and the gap before it, and the totals (before the first copy, in
copies, in gaps, after the last copy, and how long the call held the host). Part 2, engines with
one setting changed, in turn: no drains, staging kernels on 16 and on 8 SMs, 256 MiB staging.
Part 3, the caller's thread running Python for 20 ms after ``backup()``: the default head and a
376 MiB head.

Run: ``PYTHONPATH=.:bench/probes python bench/probes/backup_pace.py OUT.json [--tokens N]``.
Backs: ``DMAConfig.head_bytes`` = 96 MiB (the copy engine idles 0.17 ms in all between a 32k MLA
backup's chunks; with only the first 8 MiB chunk queued by the caller it idled 1.1 ms before the
second, 0.936x against 0.964x), ``gather_blocks`` = 48 (on 16 SMs MLA loads fall 0.957x -> 0.929x,
on 8 to 0.54x), ``staging_bytes`` (256 MiB gains under 0.01x) and the drains' cost (none here).
The busy-caller arms are why the engine has a backlog (``busy_caller.py``).
Current answer: ``bench/results/h200/probes.json ("backup_pace")``.
"""

from __future__ import annotations

import time

import torch

from kvtier.bench.transfer import Case, measure
from kvtier.transfer import TransferEngine
from kvtier.transfer.dma import DMABackend, DMAConfig
from probelib import JsonLog, Pace, args, cell, in_turn, start

PATH, TOKENS = args("/tmp/probe_backup_pace.json")
log = JsonLog(PATH, tokens=TOKENS)
SHAPES = [("mla", "page_first", 1), ("mha", "page_first", 1)]


def busy_caller_backup(eng, h, d, spin_ms: float = 20.0) -> float:
    """Seconds from the backup call to its last copy, the caller's thread running Python for
    ``spin_ms`` after the call (as a serving engine's main thread does), so the engine's
    background thread gets the GIL only at Python's switch interval (5 ms)."""
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    handle = eng.backup(h, d)
    end, x = time.perf_counter() + spin_ms / 1e3, 0
    while time.perf_counter() < end:
        x += 1
    handle.wait()
    t1.record()
    t1.synchronize()
    return t0.elapsed_time(t1) / 1e3


def main():
    clock, limits, rng = start(log)
    pace = Pace()
    pace.wrap()
    for kind, layout, ps in SHAPES:
        case = Case(kind, layout, ps, TOKENS, "cuda", None)
        idx = case.indices(False, rng)
        engines = {"default": TransferEngine(case.host, "dma")}
        for label, cfg in (("no drains", DMAConfig(backup_drain=0, load_drain=0)),
                           ("staging kernels on 16 SMs", DMAConfig(gather_blocks=16)),
                           ("staging kernels on 8 SMs", DMAConfig(gather_blocks=8)),
                           ("256 MiB staging", DMAConfig(staging_bytes=256 << 20))):
            engines[label] = TransferEngine(case.host, DMABackend(cfg))
        for direction in ("backup", "load"):
            name = f"{kind}/{layout}/p{ps}/allocator/{direction}"
            for eng in engines.values():
                measure(case, eng, direction, idx, clock, 1)
            runs = [pace.transfer(engines["default"], idx[0], idx[1], direction == "backup") for _ in range(3)]
            best = min(runs, key=lambda r: r["total_ms"])
            log(f"{name}: paced", {"totals_ms": [r["total_ms"] for r in runs], "fastest": best})
            times = in_turn(engines, lambda eng: measure(case, eng, direction, idx, clock, 3))
            log(f"{name}: settings", {k: cell(g, limits[direction]) for k, g in times.items()})
        # The caller busy after backup(): the default head, and one of about 7 ms of copying.
        busy = {"default, caller busy": engines["default"],
                "376 MiB head, caller busy": TransferEngine(case.host, DMABackend(DMAConfig(head_bytes=376 << 20)))}
        times = in_turn(busy, lambda eng: case.nbytes / busy_caller_backup(eng, idx[0], idx[1]) / 1e9)
        log(f"{kind}/{layout}/p{ps}/allocator/backup: caller busy", {k: cell(g, limits["backup"]) for k, g in times.items()})
        case.host.close()
        del case, engines, busy


if __name__ == "__main__":
    main()
