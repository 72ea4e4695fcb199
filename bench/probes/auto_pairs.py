"""Probe: why auto's backup-and-load pairs on single-token scattered host slots trail dma's.

Run 71: MHA page_first and page_head page-1 pairs on scattered host slots ran at 59.1 and
57.2 GB/s by auto against 62.8 and 63.0 by dma (auto's only misses of "within 5% of the
best"; run 65 had them within it, 55.6 against 57.9). auto took dma for 20 of 22 backups and
every load, as the dma backend does, so the copies should be the same. In the pair timeline
its `load()` returned 87-98 ms after the backup call against 72-92: such a load is bound by the
host (a copy per token and layer), and its thread shares the GIL with the engine's thread
queueing the backup.

Both engines on each case, the bench's warm-up first (a backup, a load, then pairs, auto until
it has settled), then pairs in turn, eight rounds, each logged with its GB/s, its timeline
(when `backup()` and `load()` returned and the backup was wholly queued, when each ended on
the device) and, for auto, what it picked in that pair.
Predictions: if auto's own host work (its timings, `Runs.of`, the shape key) slows the load's
queueing, `load_returned` is later by auto in every round and picks are dma/dma; if a
kernel backup now and then, those rounds show `backup:kernel` and a late backup end.
Usage: python bench/probes/auto_pairs.py OUT.json [--tokens N]
"""

from __future__ import annotations

import statistics
from collections import Counter

import torch

from kvtier.bench.transfer import Case, measure, pair, pair_note, round_order
from kvtier.transfer import TransferEngine
from probelib import JsonLog, args, start

PATH, TOKENS = args("/tmp/probe_auto_pairs.json")
log = JsonLog(PATH, tokens=TOKENS)
ROUNDS = 8


def one_pair(case, eng, idx) -> dict:
    h1, d1, h2, d2 = idx
    before = Counter(getattr(eng.backend, "picks", {}))
    timeline: list = []
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    pair(eng, h1, d1, h2, d2, True, timeline)
    t1.record()
    t1.synchronize()
    out = {"gbps": round(2 * case.nbytes / t0.elapsed_time(t1) / 1e6, 2), "pair_ms": pair_note(timeline)}
    if hasattr(eng.backend, "picks"):
        out["picks"] = {f"{d}:{c}": n for (d, c), n in (Counter(eng.backend.picks) - before).items()}
    return out


def main():
    clock, limits, rng = start(log)
    for layout in ("page_first", "page_head"):
        case = Case("mha", layout, 1, TOKENS, "cuda", None)
        idx = case.indices(True, rng)
        engines = {name: TransferEngine(case.host, name) for name in ("dma", "auto")}
        for eng in engines.values():  # as the bench: one-way rows, then pairs
            for direction in ("backup", "load", "both"):
                measure(case, eng, direction, idx, clock, 3)
        rows = {name: [] for name in engines}
        for rnd in range(ROUNDS):
            for name in round_order(list(engines), rnd):
                rows[name].append(one_pair(case, engines[name], idx))
        log(f"mha/{layout}/p1/scattered/both", {
            "limit_gbps": limits["duplex"],
            "median_gbps": {n: statistics.median(r["gbps"] for r in rs) for n, rs in rows.items()},
            "rounds": rows})
        case.host.close()
        del case, engines
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
