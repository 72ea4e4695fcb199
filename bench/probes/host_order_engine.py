"""Probe: ``KernelConfig.host_order`` through the engine, in a pool 8x the transfer.

Run 107 (``probe_host_order_span_h200.json``): MLA single-token kernel backups to host slots
drawn from a pool 8x the transfer ran at 0.565x as drawn and 0.916x with the pairs sorted by
host slot before the call. Since then the kernel backend (and the DMA backend's kernel
parts, which ``auto``'s kernel picks use) sort a backup's pairs themselves
(``KernelConfig.host_order``; on by default since run 110).

Run 108 (code c4213a8, its argsort): off 0.551x, on 0.838x, auto 0.819x; short of the
prediction (0.916x +- 0.02), with no in-process reference for the sorted rate (MLA single
tokens swing 0.85-0.95x between processes). Since then the kernel sorts with the DMA
planner's ``HostOrder.of`` (0.49 ms for 32k slots on this CPU, the stable argsort 2.3 ms).

Run 109 (``probe_host_order_engine_h200_run109.json``, HostOrder.of on the host): 8x pool,
sorted before the call 0.920x, off 0.525x, on 0.897x (its call 0.92 ms longer), auto 0.886x;
2x pool, 0.924 / 0.919 / 0.900 / 0.896x. The gap to the reference is the call's extra host
time (0.9 ms of a 45 ms transfer, 0.02x). Since then the kernel sorts on the device,
queued with the copy (``torch.sort`` of the slots already there; no host time).

Here, MLA layer_first page 1, pools 8x and 2x, huge pages, backups, in turn: the kernel with
``host_order`` off on the pairs as drawn and on the pairs sorted before the call (the
reference), and on, and ``auto`` built on a kernel with it on, on the pairs as drawn; with
each arm's GB/s, the host's wait for the call (ms). Predictions: on within 0.01x of the
reference at both sizes, its call within 0.2 ms of off's; auto within 0.02x of on.
Outcome, run 110 (``probe_host_order_engine_h200.json``): 8x pool, reference 0.905x, off
0.473x, on 0.903x, auto 0.882x; 2x pool, 0.907 / 0.855 / 0.897 / 0.876x. On within 0.01x:
yes; its call 0.5-0.6 ms longer than off's (the sort's launches): no, without showing in the
rate; auto 0.021x below on, just outside 0.02x (auto's own call is 1.1 ms longer).
Usage: python bench/probes/host_order_engine.py OUT.json [--tokens N]
"""

from __future__ import annotations

import torch

from kvtier.bench.transfer import Case
from kvtier.transfer import TransferEngine
from kvtier.transfer.auto import AutoBackend
from kvtier.transfer.dma import DMABackend, DMAConfig
from kvtier.transfer.kernel import KernelBackend, KernelConfig
from probelib import JsonLog, args, cell, in_turn, spread_pool, start, transfer

PATH, TOKENS = args("/tmp/probe_host_order_engine.json")
log = JsonLog(PATH, tokens=TOKENS)


def main() -> None:
    import time
    torch.cuda.set_stream(torch.cuda.Stream())
    clock, limits, rng = start(log)
    case = Case("mla", "layer_first", 1, TOKENS, "cuda", None)
    d = case.indices(True, rng)[1]
    case.host.close()
    on = KernelBackend(KernelConfig(host_order=True))
    off = KernelBackend(KernelConfig(host_order=False))
    for span in (8, 2):
        host, h = spread_pool(case, span, rng)
        order = torch.argsort(h)
        engines = {"off, sorted before the call": (off, h[order], d[order.to(d.device)]), "off, as drawn": (off, h, d),
                   "on, as drawn": (on, h, d), "auto on, as drawn": (AutoBackend(on, DMABackend(DMAConfig(), on)), h, d)}
        arms = {k: (k, TransferEngine(host, b), hh, dd) for k, (b, hh, dd) in engines.items()}
        call_ms = {k: [] for k in arms}

        def once(arm):
            k, eng, hh, dd = arm

            def go():
                t = time.perf_counter()
                handle = eng.backup(hh, dd)
                call_ms[k].append(1e3 * (time.perf_counter() - t))
                handle.wait()
            return case.nbytes / clock.once(go) / 1e9
        times = in_turn(arms, once)
        log(f"mla/layer_first/p1/pool {span}x/backup",
            {k: {**cell(g, limits["backup"]), "call_ms": round(sorted(call_ms[k])[len(call_ms[k]) // 2], 2)}
             for k, g in times.items()})
        host.close()
        del host, arms, engines


if __name__ == "__main__":
    main()
