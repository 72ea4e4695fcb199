"""Probe: MLA page_first per-layer loads, by layers per copy, timed in turn.

MLA page_first page-1 loads on allocator slots sit at 0.938-0.947x in every device call
(runs 55, 63, 65) where the same pool's backups reach 0.952-0.956x. The DMA backend copies
them 32 layers at a time, chosen by trial loads (``DMABackend.load_group``: the fewest layers
whose trial rate is within ``group_target`` of all layers'); in run 65 those trials were
noisy (61 layers 49.0-52.3 GB/s, 32 layers 14.8-52.2 over five trials of the same shape).

Arms, timed in turn in one process (each its own backend): the trials' choice, and
``DMAConfig.load_group`` forced to 16, 32 and 61 (all layers); MLA page_first at pages 1 and
64, and MHA page_first page 1 (32 layers: 16 against 32) for comparison. Logged: GB/s, ratio
to the limit and the layers per copy each arm used.
Prediction: if the trials chose badly, 61 layers at 0.95x or more where 32 gives 0.94x.
Usage: python bench/probes/load_groups.py OUT.json [--tokens N]
"""

from __future__ import annotations

import torch

from kvtier.bench.transfer import Case, measure
from kvtier.transfer import TransferEngine
from kvtier.transfer.dma import DMABackend, DMAConfig
from probelib import JsonLog, args, cell, in_turn, start

PATH, TOKENS = args("/tmp/probe_load_groups.json")
log = JsonLog(PATH, tokens=TOKENS)
SHAPES = [("mla", "page_first", 1, (16, 32, 61)), ("mla", "page_first", 64, (16, 32, 61)),
          ("mha", "page_first", 1, (16, 32))]


def main():
    clock, limits, rng = start(log)
    for kind, layout, ps, groups in SHAPES:
        case = Case(kind, layout, ps, TOKENS, "cuda", None)
        idx = case.indices(False, rng)
        engines = {"trials' choice": TransferEngine(case.host, DMABackend(DMAConfig()))}
        engines.update({f"{g} layers": TransferEngine(case.host, DMABackend(DMAConfig(load_group=g)))
                        for g in groups})
        for eng in engines.values():
            measure(case, eng, "load", idx, clock, 1)  # trials, plans, staging
        rates = in_turn(engines, lambda eng: measure(case, eng, "load", idx, clock, 3), warmups=1, rounds=3)
        log(f"{kind}/{layout}/p{ps}/allocator/load",
            {k: dict(cell(v, limits["load"]), layers_per_copy=getattr(engines[k].backend, "last_groups", None))
             for k, v in rates.items()})
        case.host.close()
        del case, engines
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
