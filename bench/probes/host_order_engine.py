"""Probe: ``KernelConfig.host_order`` through the engine, in host pools 8x and 2x the transfer.

The GPU writes host memory slower the more 2 MiB host pages the rows in flight are spread over
(reads do not care), and a long-running cache draws its free host slots from a pool many times
one transfer. Here, MLA layer_first single tokens, 32k-token backups to host slots drawn at
random from a huge-page pool 8x and 2x the transfer, in turn: the kernel with ``host_order`` off
on the pairs as drawn, off on the pairs sorted by host slot before the call (the reference), on
(the sort queued on the device with the copy), and ``auto`` built on a kernel with it on; each
arm's GB/s and the host's wait for the call.

Run: ``PYTHONPATH=.:bench/probes python bench/probes/host_order_engine.py OUT.json [--tokens N]``.
Backs: ``KernelConfig.host_order`` = True (8x pool: 0.473x as drawn, 0.903x on, 0.905x sorted
before the call; 2x pool: 0.855x, 0.897x, 0.907x; the call 0.5-0.6 ms longer with the sort's
launches, which does not show in the rate).
Current answer: ``bench/results/h200/probes.json ("host_order_engine")``.
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
