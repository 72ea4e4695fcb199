"""Load a host hit, or recompute it? Decided from bandwidth measured online.

Every completed transfer updates an exponentially weighted estimate of its
direction's bandwidth (bytes over issue-to-completion time). Advice for a
match compares the time to load its host part at the measured bandwidth
with the caller's prefill-time estimate for the same tokens. Completion
times on CUDA are seen when the cache polls, so the estimate errs low
(towards recomputing) when polling is sparse, never towards a slow load.
"""

from __future__ import annotations

from dataclasses import dataclass


class BandwidthMeter:
    """EWMA of bytes per second for one direction; 0 until the first sample."""

    def __init__(self, weight: float, prior_bps: float = 0.0):
        self.weight = weight
        self.bps = prior_bps
        self.samples = 0

    def add(self, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        rate = nbytes / seconds
        self.bps = rate if self.samples == 0 else self.weight * rate + (1 - self.weight) * self.bps
        self.samples += 1


@dataclass(frozen=True)
class Advice:
    """Whether to load a match's host part (``load``) or recompute it.

    Seconds are estimates; ``load_seconds`` is None when no bandwidth has
    been measured or assumed yet (then loading is advised, which measures it).
    """

    load: bool
    host_tokens: int
    host_bytes: int
    load_seconds: float | None
    recompute_seconds: float
    load_bytes_per_second: float

    @property
    def decision(self) -> str:
        return "load" if self.load else "recompute"


def advise(host_tokens: int, bytes_per_token: int, meter: BandwidthMeter,
           prefill_seconds_per_token: float, margin: float) -> Advice:
    nbytes = host_tokens * bytes_per_token
    recompute = host_tokens * prefill_seconds_per_token
    if host_tokens == 0:
        return Advice(False, 0, 0, 0.0, 0.0, meter.bps)
    if meter.bps <= 0:
        return Advice(True, host_tokens, nbytes, None, recompute, 0.0)
    load = nbytes / meter.bps
    return Advice(load <= margin * recompute, host_tokens, nbytes, load, recompute, meter.bps)
