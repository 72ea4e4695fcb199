"""Probe: are small host -> device copies held behind a DMA load by stream priority?

Runs 36-38 (``probe_input_copies_h200*.json``): five 256 KiB pinned copies issued on the caller's
stream just after a 32k per-layer DMA load landed only with the whole load (79-80 ms), with
``CUDA_DEVICE_MAX_CONNECTIONS`` 8 or 32, and also with ``load_window=2``, where only two layers'
copies were queued ahead of them. Yet the reference engine's 32k host hit with pinned inputs
dropped from 118 to 90 ms with the window. Hypothesis: the copy engine serves the load's
high-priority side stream (priority -1) before the caller's normal-priority stream as long as
the former has copies pending; the window keeps it from ever emptying in the probe, while in the
engine the feeder thread sometimes comes late (the GIL) and leaves gaps.

Predictions, if so: with the load's side stream at normal priority (0), pinned inputs land after
the queued layers with a window of 2 (about 5 ms), and with the whole load queued at once (window
0) at the load's end; inputs issued on a high-priority stream land early either way.
Run 39 (``probe_copy_priority_h200.json``): refuted. Priority changed nothing: with windows of 0
and 2 the inputs landed at 79 ms whichever stream had which priority; with a window of 1 they
landed at 3.3-3.8 ms, and the load took 93 ms (79 without). What lets them through is the load's
queue running dry (window 1 leaves a gap between layers while the host queues the next).
Run 39's arms (windows, priorities) are in this probe as of 841aa73 on the ``load-window`` branch.
Second part, ``drain`` arms (``DMAConfig.load_drain=K``): the load queued at once, but every K
layers its copies wait on the device for the layers before to land, so the copy engine's queue
runs dry for about one scatter (~0.1 ms) with no host in the loop. Inputs issued right after the
load, or 30 ms into it. Prediction: inputs land within K layers (K x 2.5 ms) of being issued, and
the load slows by under 0.2 ms per drain (32/K drains).
Run 40: drains on the scatter. Inputs issued at 7 ms (queueing the load takes the host that long)
landed at 7.2-7.6 ms with K 1-2, 10.7 with 4, 20.5-21.0 with 8; issued 37-40 ms in, within 0.3-1.3
ms (K 1-2), 2.4-4.1 (4), 3.1-3.7 (8). The load: 79.5 ms without, 90.0 (K 1), 84.7 (2), 81.6 (4),
80.6 (8): 0.25-0.34 ms a drain, more than predicted (a 128 MiB scatter). Third part: drains on
the copy (the side stream waits for a tiny kernel queued on a third stream after the last
chunk's copy; ``on the copy``). Prediction: the same landing times, and a drain costs under
0.05 ms. Run 41 (``probe_copy_priority_h200_run41.json``): met. The load took 79.8-80.2 ms with a
drain every layer and 79.2-79.4 every 4 (none: 79.0-85.3); inputs landed within K layers.
Run 43 (``probe_copy_priority_h200.json``) adds ``on the copy, no kernel`` (the third stream
only waits and records): the inputs waited for the whole load (78.6-79.3 ms) at every K, so the
one-element kernel is what makes the gap. The other arms repeated run 41.
Usage: python bench/probes/copy_priority.py OUT.json [--tokens N]
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
