"""Probe: where do single-token kernel transfers lose between the kernel and the engine?

Run 99 (``probe_row_chunks_h200_run99.json``): MLA layer_first single tokens to scattered host
slots, by the kernel launched straight on indices already on the device, ran at 0.939x
(backup) and 0.912x (load); through the engine, as the table times them, 0.85-0.88x and
0.89-0.90x (runs 98 and 100, host pools wholly in huge pages). MHA: 0.947x against 0.93x.

Here, per kind (MLA, MHA, DSA), layer_first page 1, scattered host slots, in turn, each
timed by device events from the call to the end of the transfer as the table times it:
``kernel alone`` (the backend's parts launched on device indices), ``backend`` (the kernel
backend's ``prepare`` and ``run`` on the current stream, host index tensors: adds the index
copies and checks), ``engine, inline`` (TransferEngine with ``background_backups=False``),
``engine`` (as the table), and ``engine, device indices`` (index tensors already on the GPU).
Predictions: ``backend`` within 0.01x of ``kernel alone``; the engine arms lose the rest,
``engine, inline`` less than ``engine`` if the background thread's hand-off is the cost.
Usage: python bench/probes/engine_gap.py OUT.json [--tokens N]
"""

from __future__ import annotations

import torch

from kvtier.bench.transfer import Case
from kvtier.transfer import TransferEngine
from kvtier.transfer.kernel import KernelBackend, on_device
from probelib import JsonLog, args, cell, in_turn, start, transfer

PATH, TOKENS = args("/tmp/probe_engine_gap.json")
log = JsonLog(PATH, tokens=TOKENS)


def main() -> None:
    torch.cuda.set_stream(torch.cuda.Stream())
    clock, limits, rng = start(log)
    for kind in ("mla", "mha", "dsa"):
        case = Case(kind, "layer_first", 1, TOKENS, "cuda", None)
        h, d = case.indices(True, rng)[:2]
        parts = case.host.transfer_parts()
        layers = case.host.layer_num
        dev = torch.device("cuda")
        hg, dg = on_device(h, dev), on_device(d, dev)
        kb = KernelBackend()
        eng = TransferEngine(case.host, KernelBackend())
        inline = TransferEngine(case.host, KernelBackend(), background_backups=False)
        for direction, to_host in (("backup", True), ("load", False)):
            steps = [None] if to_host else list(range(layers))

            def alone():
                for layer in steps:
                    for p in parts:
                        kb.copy_part(p, hg, dg, layer, 32)

            def backend():
                run = kb.prepare(parts, h, d, to_host)
                for layer in steps:
                    run(layer)
            arms = {"kernel alone": alone, "backend": backend,
                    "engine, inline": lambda: transfer(inline, h, d, to_host),
                    "engine": lambda: transfer(eng, h, d, to_host),
                    "engine, device indices": lambda: transfer(eng, hg, dg, to_host)}
            times = in_turn(arms, lambda fn: case.nbytes / clock.once(fn) / 1e9)
            log(f"{kind}/layer_first/p1/scattered/{direction}",
                {k: cell(g, limits[direction]) for k, g in times.items()})
        case.host.close()
        del case, parts, eng, inline, hg, dg
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
