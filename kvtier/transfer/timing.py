"""Timing queued GPU work by device events (calibration and measurements)."""

from __future__ import annotations

import numpy as np
import torch


def event_seconds(fn, reps: int = 3, best: bool = False) -> float:
    """Median device time of ``fn`` (which queues work on the current stream), after one warm-up call;
    ``best``: the shortest instead (what ``fn`` can do, when other work may disturb a sample).

    Blocks the host until each timed call's work is done.
    """
    fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return float(min(times) if best else np.median(times))
