"""Probe: is the host slow before a transfer's first copy because it was idle just before?

Run 61 (``probe_host_timeline_h200_run61.json``): an MLA page_first p1 backup's first device work
starts 1.5 ms after the call, and every step on the way takes 5-20x what it takes alone
(the index check 0.10 ms against 0.005; ``prepare`` to its host order 0.24 ms against 0.03;
the device slots to the device 0.58 ms against 0.07). The steps alone are medians of 20 calls
back to back; in the bench each runs once, right after the caller waited ~44 ms for the last
transfer. If the core slept in that wait (deep idle states drop its caches; its clock falls),
the host code after it runs cold. 1 ms of 44 is 0.023x of the link: what the MLA rows on
allocator slots lack (0.002-0.024x).

Arms, each timed as the bench times a transfer (start event, the call, end event), in turn:
- ``as bench``: synchronize, then the call;
- ``spin 2 ms``: synchronize, 2 ms of Python spinning (a busy scheduler thread), the call;
- ``sleep 20 ms``: synchronize, sleep 20 ms, the call;
- ``gc off``: the garbage collector off around the call;
- ``device slots on cuda``: the device slots already on the GPU, as an engine's device allocator
  hands them out (the bench passes host tensors).
Each arm logs GB/s, its ratio to the limit, and how long the call held the caller.
Prediction if a cold host is the cause: ``spin 2 ms`` about 1 ms shorter than ``as bench``
(+0.02x), ``sleep 20 ms`` no better than ``as bench``.
Run 63 (``probe_cold_host_h200.json``): refuted. MLA page_first p1 backup 0.952x as bench,
0.952x after spinning, 0.950x after sleeping, 0.953x with the collector off; with the device
slots already on the GPU 0.956x (0.17 ms sooner, though the index copy takes 0.4 ms of the
call). The load (0.933-0.938x), MLA layer_first (0.955-0.959x) and MHA page_first
(0.968-0.970x) backups alike. The steps are not slow for want of a warm core.
Usage: python bench/probes/cold_host.py OUT.json [--tokens N]
"""

from __future__ import annotations

import gc
import os
import platform
import time

import torch

from kvtier.bench.transfer import Case
from kvtier.transfer import TransferEngine
from probelib import JsonLog, args, cell, in_turn, read_text, start

PATH, TOKENS = args("/tmp/probe_cold_host.json")
log = JsonLog(PATH, tokens=TOKENS)
CASES = [("mla", "page_first", 1, "backup"), ("mla", "page_first", 1, "load"), ("mla", "layer_first", 1, "backup"),
         ("mha", "page_first", 1, "backup")]


def machine() -> dict:
    idle = "/sys/devices/system/cpu/cpu0/cpuidle"
    states = sorted(os.listdir(idle)) if os.path.isdir(idle) else []
    return {"python": platform.python_version(), "cpus": os.cpu_count(),
            "governor": read_text("/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor"),
            "cur_khz": read_text("/sys/devices/system/cpu/cpu0/cpufreq/scaling_cur_freq"),
            "idle_states": [read_text(f"{idle}/{s}/name") for s in states],
            "gc_threshold": gc.get_threshold()}


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def timed(eng, h, d, what: str, before) -> tuple[float, float]:
    """(device seconds from the start event to the end event, host seconds the call took)."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    gc_was = gc.isenabled()
    if before == "gc off":
        gc.disable()
    elif before == "spin":
        spin(2e-3)
    elif before == "sleep":
        time.sleep(0.02)
    try:
        a.record()
        t0 = time.perf_counter()
        if what == "backup":
            hd = eng.backup(h, d)
            call = time.perf_counter() - t0
            hd.wait()
        else:
            ld = eng.load(h, d)
            call = time.perf_counter() - t0
            ld.wait_layer(ld.layer_num - 1)
        b.record()
    finally:
        if gc_was:
            gc.enable()
    b.synchronize()
    return a.elapsed_time(b) / 1e3, call


def main():
    log("machine", machine())
    clock, limits, rng = start(log)
    for kind, layout, ps, what in CASES:
        case = Case(kind, layout, ps, TOKENS, "cuda", None)
        h, d = case.indices(False, rng)[:2]
        d_cuda = d.cuda()
        eng = TransferEngine(case.host, "dma")
        arms = {"as bench": (d, None), "spin 2 ms": (d, "spin"), "sleep 20 ms": (d, "sleep"),
                "gc off": (d, "gc off"), "device slots on cuda": (d_cuda, None)}
        times = in_turn(arms, lambda arm: timed(eng, h, arm[0], what, arm[1]), warmups=2, rounds=7)
        log(f"{kind}/{layout}/p{ps}/allocator/{what}",
            {k: dict(cell([case.nbytes / t / 1e9 for t, _ in v], limits[what]),
                     ms=round(sorted(t for t, _ in v)[len(v) // 2] * 1e3, 3),
                     call_ms=[round(c * 1e3, 2) for _, c in v]) for k, v in times.items()})
        case.host.close()
        del case, eng
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
