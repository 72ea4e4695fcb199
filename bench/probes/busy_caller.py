"""Probe: a backup while the caller's thread stays busy in Python.

Run 55 (``backup_pace``, the caller spinning 20 ms after ``backup()``): an MLA page_first p1
backup took 16 ms longer (0.946x -> 0.658x), an MHA one 20 ms longer (0.967x -> 0.776x): the
engine's background thread, which queues a backup's chunks after the head, got almost no
turn while the caller ran Python. A serving engine's scheduler thread is such a caller.
CPython hands the GIL to a waiting thread only when the holder releases it (any call into
CUDA or a kernel launch does) or, when it runs pure Python, after ``sys.getswitchinterval()``
(5 ms); every chunk the thread queues calls into CUDA several times, and each time may wait
that long to get the GIL back.

Here every arm times a backup from the call to its completion as the caller sees it: between
checks every 0.2 ms the caller sleeps (idle), spins in Python (busy), or spins and launches a
tiny kernel every 1 ms (busy, launching: closer to an engine's scheduler).
Run 58 (``probe_busy_caller_h200_run58.json``, the caller checking with ``_finished()``, which
queues nothing): idle 0.966x (MLA) / 0.975x (MHA); busy 0.047x / 0.039x (2-3 GB/s); busy with
the switch interval at 1 ms 0.26x / 0.23x, at 0.25 ms 0.94x / 0.87x; busy, launching
0.20x / 0.16x; queued inline (``background_backups=False``) 0.96x / 0.98x busy or idle, the
call holding the caller 3.5-5.4 ms (MLA) and 5.6-8.4 ms (MHA).
So a handle's ``wait``/``synchronize``, and its ``done`` once the engine's thread has queued
nothing for 1 ms, now queue in the caller's thread whatever that thread has not yet queued
(:mod:`kvtier.transfer.backlog`). Arms since: the caller
not asking (as run 58), with a 0.25 ms switch interval, asking ``done()`` every 0.2 ms and
every 5 ms (a scheduler's step), busy launching and asking every 1 ms, and inline.
Prediction: asking every 0.2 ms as inline (0.95-0.98x); every 5 ms about 5 ms late at most
(0.90x or better for MLA's 44 ms); not asking as run 58.
Run 59 (``probe_busy_caller_h200.json``, with the backlog), MLA / MHA: idle 0.960x / 0.977x;
busy, not asking 0.047x / 0.043x; busy asking ``done()`` every 0.2 ms 0.968x / 0.979x, every
5 ms 0.922x / 0.959x; busy launching and asking every 1 ms 0.950x / 0.973x; inline 0.966x /
0.979x (the call held the caller 3.6-4.9 ms and 9.5-9.8 ms). Predictions met.
Usage: python bench/probes/busy_caller.py OUT.json [--tokens N]
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
    queues anything (the engine's thread alone queues the backup: run 58's case)."""
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
