"""Timing queued GPU work by device events (calibration and measurements)."""

from __future__ import annotations

import numpy as np
import torch


def event_seconds(fn, reps: int = 3) -> float:
    """Median device time of ``fn`` (which queues work on the current stream), after one warm-up call.

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
    return float(np.median(times))
