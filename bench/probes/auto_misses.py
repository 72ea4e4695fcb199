"""Probe: are auto's three misses in run 32 its own cost, or order and noise?

In run 32 (``bench/results/transfer_h200_run32_verbose.log``) auto ran more than 5% below the best
backend on three rows. On two it took the same backend as the row it lost to, on every timed
transfer: MHA page_head p64 allocator slots, backup and load at once (auto 1.45x, dma 1.58x,
both by DMA) and DSA layer_first p1 scattered backups (auto 0.709x, kernel 0.761x, both by
kernels). On the third it chose: MHA page_first p1 scattered, both at once, auto took DMA
(0.937x) where kernels both ways gave 1.028x. Run 29 (``auto_dma.py``) found a like gap gone
when the two were timed alternately in one process.

Here each shape's kernel, dma and auto engines are timed in turn, four rounds, after each has
warmed up (auto until it has chosen), on the same slots. Prediction: on the first two shapes,
auto within 0.02x of the backend it picks (its per-transfer work, about 0.1 ms, is 0.1% of a
transfer at 32k tokens); on the third, auto below the kernel pair by about 0.09x, as in run 32,
because it chooses per direction. Logged per shape: each engine's cell (median of its round
medians, each a median of five), its rounds, and auto's picks for the shape (warm-up included).
Run 46 (``probe_auto_misses_h200.json``): no miss recurred. MHA page_head p64 allocator pair:
auto 1.662x, dma 1.681x (auto by DMA both ways). DSA layer_first p1 scattered backup: auto
0.729x, kernel 0.739x (auto by kernels). MHA page_first p1 scattered pair: auto 1.131x (DMA both
ways), dma 1.017x, kernel 1.010x; the prediction for it was refuted: DMA both ways was the best
pair here, and auto's 1.131 beside the dma engine's 1.017 on the same choice is the spread pairs
show (0.04x median, more at the edges). The three run 32 misses are order and noise.
Usage: python bench/probes/auto_misses.py OUT.json [--tokens N]
"""

from __future__ import annotations

from kvtier.bench.transfer import Case, measure
from kvtier.transfer import TransferEngine
from probelib import JsonLog, args, cell, start

PATH, TOKENS = args("/tmp/probe_auto_misses.json")
log = JsonLog(PATH, tokens=TOKENS)
SHAPES = [("mha", "page_head", 64, False, "both"), ("dsa", "layer_first", 1, True, "backup"),
          ("mha", "page_first", 1, True, "both")]


def main():
    clock, limits, rng = start(log)
    limits["both"] = (limits["backup"] + limits["load"]) / 2  # as the bench: a pair against one way
    for kind, layout, ps, scattered, direction in SHAPES:
        case = Case(kind, layout, ps, TOKENS, "cuda", None)
        idx = case.indices(scattered, rng)
        engines = {name: TransferEngine(case.host, name) for name in ("kernel", "dma", "auto")}
        times = {name: [] for name in engines}
        auto = engines["auto"].backend  # the one registered auto backend: its picks add up over shapes
        before = dict(auto.picks)
        for _ in range(4):
            for name, eng in engines.items():
                times[name].append(measure(case, eng, direction, idx, clock, 5))
        row = {name: cell(g, limits[direction]) for name, g in times.items()}
        row["auto_picks"] = {f"{d}/{c}": n - before.get((d, c), 0) for (d, c), n in auto.picks.items()
                             if n > before.get((d, c), 0)}
        log(f"{kind}/{layout}/p{ps}/{'scattered' if scattered else 'allocator'}/{direction}", row)
        case.host.close()
        del case, engines


if __name__ == "__main__":
    main()
