"""Probe: a DMA backup while the caller's thread stays busy in Python.

A backup's chunks after its head are queued by the engine's background thread, which needs the
GIL; CPython hands it over when the holder calls into CUDA or, in pure Python, only every
``sys.getswitchinterval()`` (5 ms). A serving engine's scheduler thread is such a caller. Each
arm times a 32k-token MLA and MHA page_first single-token backup on allocator slots from the call
until the caller sees it complete; between checks every 0.2 ms the caller sleeps (idle), spins
in Python (busy: not asking, which queues nothing; with a 0.25 ms switch interval; asking
``done()`` every 0.2 ms or every 5 ms), spins and launches a tiny kernel every 1 ms, or queues
the whole backup inline (``background_backups=False``).

Run: ``PYTHONPATH=.:bench/probes python bench/probes/busy_caller.py OUT.json [--tokens N]``.
Backs: the backlog (``kvtier.transfer.backlog``: ``wait``/``synchronize``, and ``done`` once the
thread has queued nothing for ``STALL_S`` = 1 ms, queue what is pending in the caller's thread):
busy and not asking 0.047x (MLA) / 0.043x (MHA); asking ``done()`` every 0.2 ms 0.968x / 0.979x,
every 5 ms 0.922x / 0.959x; idle 0.960x / 0.977x; inline 0.966x / 0.979x but the call holds the
caller 3.6-9.8 ms.
Current answer: ``bench/results/h200/probes.json ("busy_caller")``.
"""

from __future__ import annotations

import time

import torch

from kvtier.bench.transfer import Case, measure
from kvtier.transfer import TransferEngine
from probelib import JsonLog, args, cell, in_turn, start, switch_interval

PATH, TOKENS = args("/tmp/probe_busy_caller.json")
log = JsonLog(PATH, tokens=TOKENS)
SHAPES = [("mla", "page_first", 1), ("mha", "page_first", 1)]
POLL_S = 0.0002


def idle(_):
    time.sleep(POLL_S)


def spin(_):
    end = time.perf_counter() + POLL_S
    while time.perf_counter() < end:
        pass


def spin_launching(state):
    spin(state)
    now = time.perf_counter()
    if now - state["launched"] >= 1e-3:
        state["x"].add_(1)  # a kernel on the caller's stream: a call into CUDA, as a scheduler makes
        state["launched"] = now


def timed_backup(eng, h, d, between, ask_s: float | None = None, switch_s: float | None = None) -> tuple[float, float]:
    """(seconds from the call until the caller saw the backup complete, seconds the call took).
    ``ask_s``: the caller calls ``done()`` (which queues what is still pending) at most this
    often; between those, and always when None, it checks with ``_finished()``, which never
    queues anything (the engine's thread alone queues the backup)."""
    torch.cuda.synchronize()
    state = {"x": torch.zeros(1, device="cuda"), "launched": 0.0}
    with switch_interval(switch_s):
        t0 = asked = time.perf_counter()
        handle = eng.backup(h, d)
        returned = time.perf_counter() - t0
        while True:
            between(state)
            now = time.perf_counter()
            if ask_s is not None and now - asked >= ask_s:
                asked = now
                if handle.done():
                    break
            elif handle._finished():
                break
        total = time.perf_counter() - t0
    handle.synchronize()
    return total, returned


def main():
    clock, limits, rng = start(log)
    for kind, layout, ps in SHAPES:
        case = Case(kind, layout, ps, TOKENS, "cuda", None)
        idx = case.indices(False, rng)
        h, d = idx[:2]
        thread, inline = TransferEngine(case.host, "dma"), TransferEngine(case.host, "dma", background_backups=False)
        for eng in (thread, inline):
            measure(case, eng, "backup", idx, clock, 1)
        arms = {"idle": (thread, idle, POLL_S, None), "busy, not asking": (thread, spin, None, None),
                "busy, not asking, switch 0.25 ms": (thread, spin, None, 2.5e-4),
                "busy, done() every 0.2 ms": (thread, spin, POLL_S, None),
                "busy, done() every 5 ms": (thread, spin, 5e-3, None),
                "busy, launching, done() every 1 ms": (thread, spin_launching, 1e-3, None),
                "inline, busy": (inline, spin, None, None)}
        times = in_turn(arms, lambda arm: timed_backup(arm[0], h, d, *arm[1:]))
        name = f"{kind}/{layout}/p{ps}/allocator/backup"
        log(f"{name}: caller", {k: dict(cell([case.nbytes / t / 1e9 for t, _ in v], limits["backup"]),
                                        call_ms=[round(r * 1e3, 2) for _, r in v]) for k, v in times.items()})
        case.host.close()
        del case, thread, inline


if __name__ == "__main__":
    main()
