"""Probe: why does auto, having chosen DMA, back up MLA layer_first page-64 allocator slots
slower than the DMA backend does?

In every full bench since run 20 the auto row for that shape ran at 0.85-0.87x where the
dma row, just before it in the same process, ran at 0.92-0.96x; auto and the dma engine
share one DMA backend instance (``kvtier.transfer.gpu``). In run 28 auto chose DMA for
every timed transfer (explored three times, scored 47.9 GB/s) and still ran at 0.864x
beside the dma row's 0.963x. In run 26 (MLA rows only) auto ran that shape at 0.95x.

This replays the bench's order for the rows before it (MHA layer_first page 64, then MLA
layer_first page 1, every backend and direction, as the bench does), then times MLA
layer_first page-64 allocator backups, alternating: the dma engine, the registered auto
backend, and a fresh auto backend over the same kernel and DMA backends. Each cell: the
median of three medians of three after the bench's warm-up. Also logged: what auto chose,
its samples for the shape, and how many timings it holds open.

Run 29 (``probe_auto_dma_h200.json``): not reproduced. After the replay, the dma engine,
the registered auto and a fresh auto all backed the shape up at 0.947-0.953x, auto by DMA
(samples 52.5-53.2 GB/s). Run 30, the full bench again with the dma backend timed a second
time after auto: auto 0.938x, dma 0.949x and 0.953x. What slowed auto's DMA backups of
that shape in runs 20-28 is not found; it did not recur.
Usage: python bench/probes/auto_dma.py OUT.json [--tokens N]
"""

from __future__ import annotations


from kvtier.bench.transfer import DIRECTIONS, Case, measure
from kvtier.transfer import TransferEngine
from kvtier.transfer.auto import AutoBackend
from kvtier.transfer.gpu import DMA, KERNEL
from probelib import JsonLog, args, cell, start

PATH, TOKENS = args("/tmp/probe_auto_dma.json")
log = JsonLog(PATH, tokens=TOKENS)


def bench_rows(kind, layout, ps, clock, rng, limits):
    """The bench's rows for one case (allocator then scattered slots; kernel, dma, auto)."""
    case = Case(kind, layout, ps, TOKENS, "cuda", None)
    out = {}
    for scattered in (False, True):
        idx = case.indices(scattered, rng)
        for backend in ("kernel", "dma", "auto"):
            eng = TransferEngine(case.host, backend)
            for direction in DIRECTIONS:
                g = measure(case, eng, direction, idx, clock, 3)
                out[f"{'scattered' if scattered else 'allocator'}/{backend}/{direction}"] = round(g / limits[direction], 3)
    case.host.close()
    del case
    return out


def main():
    clock, limits, rng = start(log)
    limits["both"] = (limits["backup"] + limits["load"]) / 2
    for kind, layout, ps in (("mha", "layer_first", 64), ("mla", "layer_first", 1)):
        log(f"replayed {kind}/{layout}/p{ps}", bench_rows(kind, layout, ps, clock, rng, limits))
    case = Case("mla", "layer_first", 64, TOKENS, "cuda", None)
    idx = case.indices(False, rng)
    engines = {"dma": TransferEngine(case.host, "dma"), "auto": TransferEngine(case.host, "auto"),
               "fresh auto": TransferEngine(case.host, "dma")}
    engines["fresh auto"].backend = AutoBackend(KERNEL, DMA)
    times = {name: [] for name in engines}
    for _ in range(3):
        for name, eng in engines.items():
            times[name].append(measure(case, eng, "backup", idx, clock, 3))
    row = {name: cell(g, limits["backup"]) for name, g in times.items()}
    for name in ("auto", "fresh auto"):
        b = engines[name].backend
        row[name]["last_choice"] = list(b.last_choice)
        row[name]["picks"] = {f"{d}/{c}": n for (d, c), n in b.picks.items()}
        row[name]["open_timings"] = len(b.timings._pending)
        row[name]["backup_samples"] = {str(k[1:]): {c: [round(x, 1) for x in v] for c, v in by.items()}
                                       for k, by in b.chooser.samples.items() if k[0] and k[1][0][0] == 64}
    log("mla/layer_first/p64/allocator/backup", row)


if __name__ == "__main__":
    main()
