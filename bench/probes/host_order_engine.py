"""Probe: ``KernelConfig.host_order`` through the engine, in a pool 8x the transfer.

Run 107 (``probe_host_order_span_h200.json``): MLA single-token kernel backups to host slots
drawn from a pool 8x the transfer ran at 0.565x as drawn and 0.916x with the pairs sorted by
host slot before the call. Since then the kernel backend (and the DMA backend's kernel
parts, which ``auto``'s kernel picks use) can sort a backup's pairs itself
(``KernelConfig.host_order``, off by default until its GPU tests have run; not yet run).

Here, MLA layer_first page 1, pool 8x, huge pages, the pairs as drawn, in turn: the kernel
backend with ``host_order`` off (the default) and on, and ``auto`` built on a kernel backend
with it on; backups. Predictions: on, and ``auto``, within 0.02x of run 107's sorted 0.916x;
off near 0.565x.
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
    torch.cuda.set_stream(torch.cuda.Stream())
    clock, limits, rng = start(log)
    case = Case("mla", "layer_first", 1, TOKENS, "cuda", None)
    d = case.indices(True, rng)[1]
    case.host.close()
    host, h = spread_pool(case, 8, rng)
    on = KernelBackend(KernelConfig(host_order=True))
    engines = {"kernel, host_order off": TransferEngine(host, KernelBackend()),
               "kernel, host_order on": TransferEngine(host, on),
               "auto, host_order on": TransferEngine(host, AutoBackend(on, DMABackend(DMAConfig(), on)))}
    times = in_turn(engines, lambda e: case.nbytes / clock.once(lambda: transfer(e, h, d, True)) / 1e9)
    log("mla/layer_first/p1/pool 8x/backup", {k: cell(g, limits["backup"]) for k, g in times.items()})
    host.close()


if __name__ == "__main__":
    main()
