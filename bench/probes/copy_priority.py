"""Probe: do small host -> device copies issued during a DMA load wait for the whole load?

An engine copies its step inputs (token ids, positions, slot tables) with pinned
``non_blocking`` copies while the next request's KV loads. The copy engine serves one stream's
queue until it runs dry, whatever the stream priorities. Here five 256 KiB pinned copies are
issued on the caller's stream right after a 32k-token MHA layer_first per-layer DMA load starts,
or 30 ms into it, with the load drained every K layers (``DMAConfig.load_drain``, K = 0, 1, 2,
4, 8) three ways: ``on the copy`` (the default: the copy stream waits behind a one-element kernel
on a third stream queued after the last copy), ``on the copy, no kernel`` (the third stream only
waits and records) and ``on the scatter`` (the copy stream waits for the last chunk's scatter).
Logs when the inputs landed and when the load ended, three rounds in turn.

Run: ``PYTHONPATH=.:bench/probes python bench/probes/copy_priority.py OUT.json [--tokens N]``.
Backs: ``DMAConfig.load_drain`` = 4 (inputs wait 0.4-3.9 ms instead of 40-73 ms; the load takes
79.1-79.8 ms against 78.8-79.3 undrained; every layer: 79.6-80.8; on the scatter a drain costs
0.25-0.34 ms) and ``load_drain_bytes`` (what a drain costs the copy engine).
Current answer: ``bench/results/h200/probes.json ("copy_priority")``.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from kvtier.bench.transfer import Case
from kvtier.transfer import TransferEngine
from kvtier.transfer.dma import DMABackend, DMAConfig
from probelib import JsonLog, args, in_turn

PATH, TOKENS = args("/tmp/probe_copy_priority.json")
log = JsonLog(PATH, tokens=TOKENS)
N, WORDS = 5, 32768  # five copies of 256 KiB


def engine(host, drain: int, after: str) -> TransferEngine:
    backend = DMABackend(DMAConfig(load_drain=drain))  # its own staging ring
    backend._drain_after = after
    return TransferEngine(host, backend)


def one(eng, h, d, delay_ms: float) -> dict:
    srcs = [(torch.arange(WORDS, dtype=torch.int64) + i).pin_memory() for i in range(N)]
    torch.cuda.synchronize()
    start, issued, got, end = (torch.cuda.Event(enable_timing=True) for _ in range(4))
    start.record()
    ld = eng.load(h, d)
    if delay_ms:
        time.sleep(delay_ms / 1e3)
    issued.record()
    outs = [x.to("cuda", non_blocking=True) for x in srcs]
    got.record()
    ld.wait_layer(ld.layer_num - 1)
    end.record()
    end.synchronize()
    ok = all(torch.equal(o.cpu(), x) for o, x in zip(outs, srcs))
    return {"inputs_done_ms": round(start.elapsed_time(got), 3),
            "inputs_issued_ms": round(start.elapsed_time(issued), 3),
            "load_done_ms": round(start.elapsed_time(end), 3), "correct": ok}


def main():
    case = Case("mha", "layer_first", 64, TOKENS, "cuda", None)
    h, d, _, _ = case.indices(False, np.random.default_rng(0))
    arms = {}
    for k in (0, 1, 2, 4, 8):
        for after in ("copy", "event", "scatter") if k else ("copy",):
            eng = engine(case.host, k, after)
            on = {"copy": "copy", "event": "copy, no kernel", "scatter": "scatter"}[after]
            for delay in (0, 30):
                arms[f"drain every {k} layers on the {on}, inputs {delay} ms after the load"] = (eng, delay)
    for k, v in in_turn(arms, lambda arm: one(arm[0], h, d, arm[1])).items():
        log(k, v)


if __name__ == "__main__":
    main()
