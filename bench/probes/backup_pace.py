"""Probe: where does an MLA page_first allocator backup lose its last 6%?

Run 52 (``probe_copy_calls_h200.json``): the bytes of a 32k MLA transfer (2.3 GB) copied in
128 MiB chunks from one device buffer into the host pool's registered memory run at 1.00x of
the limit, whatever runtime call queues them (``cudaMemcpyAsync``, ``cudaMemcpy2DAsync`` of
height 1, a batch of one) and whichever memory they land in (the pool's or ``cudaHostAlloc``'s);
the DMA engine's backup of the same slots runs at 0.94x (load 0.955x). So the loss is in the
engine, not in the copies: 2.6 ms of 44.3.

Part 1, a paced backup: every staging chunk's gather and copy is bracketed by events on the
stream it runs on (an event fires when its stream reaches it, so a copy's "start" is when its
stream got past its waits: the gather, a drain). Logged per chunk: bytes, gather start and
end, copy start and end (ms after an event recorded just before the call), the copy's GB/s,
and the gap before it (its start minus the previous copy's end); and the totals: before the
first copy, in copies, in gaps, after the last copy.

Part 2, engines with one setting changed, timed in turn: the default; no drains
(``backup_drain=0``); gathers on all SMs (``gather_blocks=132``); 256 MiB staging; 4 buffers
(runs 53-54; the arms since, below).
Prediction: before the first copy about 1.1 ms (run 27), gaps under 0.5 ms in all, and the
chunk copies at 0.98-1.00x; the rest, about 1 ms, is unknown going in.
Run 53 (``probe_backup_pace_h200_run53.json``): MLA 45.2 ms: 1.37 ms before the first copy,
then a gap of 1.12 ms before the second (MHA: 1.52, 0.92): the caller's thread queued only
the first chunk (8 MiB, 0.2 ms of copying) and the background thread's first gather came
0.6 ms after that copy had ended. Every other gap 0.001-0.055 ms, 1.24 ms in all. Chunk
copies at 54.0-54.7 GB/s while a gather runs beside them, 55.3 for the last two (none
does). No setting moved the backup: 0.936-0.944x (MLA), 0.964-0.966x (MHA). So
``DMAConfig.head_bytes``: the caller's thread now queues the first 96 MiB (the ramp's four
chunks). Run 54 (``probe_backup_pace_h200_run54.json``), with it: MLA 43.5 ms, 0.86 ms before
the first copy, gaps 0.34 ms in all (the largest 0.28 ms, at the thread's first chunk),
0.964x against 0.936x; MHA 80.1 ms, gaps 0.34 ms, 0.967x against 0.964x. Gathers beside
copies still cost those copies about 2% (54.1-54.4 GB/s against 55.3-55.6 alone).
Since run 54 the probe paces per-layer loads too (a chunk's copies on the ring's side
stream, its scatter after them), and the settings are: no drains (either way), staging
kernels (gathers, scatters) on 16 and on 8 SMs (longer, gentler: do they cost the copies
beside them less?), 256 MiB staging (132 SMs and 4 buffers moved nothing in runs 53-54).
Prediction: loads show no gap like the backups' (their first copies need no gather), and
copies beside a staging kernel lose about 2% either way; with 8 SMs less, if the staging
kernel still keeps up (a 128 MiB chunk's gather took 0.27 ms on 48 SMs, its copy 2.47 ms).
Prediction for the caller-busy arms (the caller's thread runs Python for 20 ms after
``backup()``): the default head loses about 3 ms (0.06-0.08x: the background thread waits for
the GIL up to the 5 ms switch interval) and a 376 MiB head (about 7 ms of copying) loses
under 0.01x.
It also logs how long the call itself held the host (``call_returned_ms``): a backup now
queues its first 96 MiB before it returns.
Run 55 (``probe_backup_pace_h200.json``, branch head-join: chunks after the head no longer
join the caller's stream again): MLA backup 44.0 ms, gaps 0.17 ms in all (run 54: 0.34;
predicted 0.07), before the first copy 1.56 ms, the call returned after 2.5 ms; MHA gaps
0.31 ms. Loads: gaps 0.05 ms (MLA) and 0.10 ms (MHA), as predicted. Gentler staging kernels
refuted: on 16 SMs the same or worse (MLA load 0.957 -> 0.929x), on 8 SMs the scatters no
longer keep up (MLA load 0.54x), backups -0.01x. The busy caller lost far more than
predicted: MLA 0.946 -> 0.658x, MHA 0.967 -> 0.776x (about the whole 16-20 ms of Python),
and a 376 MiB head won back only a third (0.755x, 0.828x): the thread got almost no turn
while the caller ran Python. ``bench/probes/busy_caller.py`` follows that up.
So the largest loss left in an idle MLA backup is before its first copy (1.56 ms of 44).
Usage: python bench/probes/backup_pace.py OUT.json [--tokens N]
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
        # The caller busy after backup(): the default head, and one of about 5 ms of copying.
        busy = {"default, caller busy": engines["default"],
                "376 MiB head, caller busy": TransferEngine(case.host, DMABackend(DMAConfig(head_bytes=376 << 20)))}
        times = in_turn(busy, lambda eng: case.nbytes / busy_caller_backup(eng, idx[0], idx[1]) / 1e9)
        log(f"{kind}/{layout}/p{ps}/allocator/backup: caller busy", {k: cell(g, limits["backup"]) for k, g in times.items()})
        case.host.close()
        del case, engines, busy


if __name__ == "__main__":
    main()
