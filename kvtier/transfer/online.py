"""Choosing between backends from transfers actually timed.

The calibrated model of :mod:`.auto` is a prior: it ranks the candidates the
first time a transfer shape is seen. Each candidate is then tried on real
transfers of that shape until it has ``explore`` (3) timed samples, and from
then on the one with the best score runs. The score is a candidate's
second-best sample: a transfer's time is most often inflated (a kernel
compiled on first use, staging buffers allocated, other work on the GPU), so
one inflated sample must not condemn a path, and one lucky sample must not
pick it either. A candidate scoring within ``tie`` (2%) of the top keeps its
place in the prior's order: samples that close cannot tell two paths apart.
A shape is what changes the answer: direction, each part's geometry, the size
class and how long the host runs are. Timings are device events read back only
once they have completed, so choosing never blocks the host.
"""

from __future__ import annotations

import math
import threading
from collections import defaultdict, deque
from dataclasses import dataclass, field

import numpy as np

from ..validate import require_positive_int
from .slots import Runs, run_class


DUPLEX = "duplex"
# Samples kept per shape and candidate, the latest: every pick scores them all, and a
# long-running server times millions of transfers of one shape.
WINDOW = 32


def shape_key(to_host: bool, parts, host_np: np.ndarray, nbytes: int, runs: Runs | None = None) -> tuple:
    """What makes one transfer behave like another for backend choice (``runs``: :meth:`Runs.of`
    ``host_np``, if the caller has it)."""
    geometry = tuple((p.host.page_size, p.host.token, p.host.chunk_bytes, p.host.n_chunks, p.item_bytes)
                     for p in parts)
    return (to_host, geometry, int(math.log2(max(nbytes, 1))), run_class(host_np, runs))


@dataclass
class OnlineChooser:
    """Per shape: explore each candidate ``explore`` times, then keep the one with the best
    :func:`score` (the prior's order breaks a tie within ``tie``).

    A backup that will share the link with a load (its key ends with ``DUPLEX``) takes
    ``when_shared`` whenever that is a candidate, without exploring: each sample times only
    its own direction, and a zero-copy kernel's cost falls on the other one (a backup and a
    load together move about 1.6x of one direction's limit through the copy engines, about
    1.1x as zero-copy kernels). The exception: where ``when_shared`` has been timed alone at
    under ``shared_margin`` of the best (copies of single scattered tokens), the best alone
    is taken; likewise when the transfers the other way can only go by the kernel.

    ``pair_loads``: a shared load with more than one candidate is instead explored like a
    transfer alone and scored by what its pairs moved: the bytes of the load and of the
    backups beside it over the time from the first start to the last end
    (:meth:`record_pair`, filed by :class:`PendingTimings`). What suits a load in a pair
    depends on the rows, and a load's own samples cannot tell; the pair's can. Where a shared
    backup goes by the kernel all the same, :mod:`.auto` also tries it on fewer blocks and
    keeps whichever pairs moved more (:meth:`pick_by_pairs`).
    Thresholds were measured on an H200 (docs/performance.md).
    """

    explore: int = 3
    samples: dict = field(default_factory=lambda: defaultdict(lambda: defaultdict(list)))
    when_shared: str | None = "dma"
    shared_margin: float = 0.7
    pair_loads: bool = True
    # Per shared key and candidate: GB/s of the pairs it was part of (its bytes and those
    # beside it, first start to last end).
    pairs: dict = field(default_factory=lambda: defaultdict(lambda: defaultdict(list)))
    tie: float = 0.02

    def __post_init__(self) -> None:
        require_positive_int("OnlineChooser.explore", self.explore)
        self._lock = threading.Lock()

    def pick(self, key, candidates: list[str], partner_kernel_only: bool = False) -> str:
        """``candidates`` in prior order (best predicted first). ``partner_kernel_only``: the
        transfers the other way, sharing the link, can only go by the kernel; DMA then gains
        nothing in the pair, and the best alone is taken. (Only what the other way *can* do
        counts, not what it last chose: two directions each waiting for the other to take
        DMA first would keep a pair on kernels for good.)"""
        shared = bool(key) and key[-1] == DUPLEX
        if shared and self.pair_loads and key[0] is False and len(candidates) > 1 and not partner_kernel_only:
            return self._explored_pick(key, candidates, by_pair=True)
        if self.when_shared in candidates and shared:
            solo = {c: v for c, v in self._scores(key[:-1]).items() if c in candidates}
            others = [v for c, v in solo.items() if c != self.when_shared]
            fit = (self.when_shared not in solo or not others
                   or solo[self.when_shared] >= self.shared_margin * max(others))
            if fit and not partner_kernel_only:
                return self.when_shared
            # The best alone, once every candidate has been timed alone; until then they are
            # explored under the shared key (one timed candidate would be kept for good).
            if solo and (len(solo) == len(candidates) or not partner_kernel_only):
                return max(solo, key=solo.get)
        return self._explored_pick(key, candidates)

    def pick_by_pairs(self, key, candidates: list[str]) -> str:
        """Among ``candidates`` for a transfer under shared ``key``: explore each, then keep
        the one whose pairs moved most (as a shared load with ``pair_loads``)."""
        return self._explored_pick(key, candidates, by_pair=True)

    def _explored_pick(self, key, candidates: list[str], by_pair: bool = False) -> str:
        """The first candidate short of ``explore`` samples, else the best :func:`score`
        (``by_pair``: the score of its pairs instead, where every candidate has pair samples)."""
        with self._lock:
            seen = self.samples[key]
            for c in candidates:
                if len(seen[c]) < self.explore:
                    return c
            scores = {c: score(seen[c]) for c in candidates}   # in the prior's order
            pairs = self.pairs.get(key, {})
            if by_pair and all(pairs.get(c) for c in candidates):
                scores = {c: score(pairs[c]) for c in candidates}
            high = max(scores.values())
            return next(c for c, s in scores.items() if s >= (1 - self.tie) * high)

    def _scores(self, key) -> dict:
        """Each timed candidate's :func:`score` for ``key``."""
        with self._lock:
            return {c: score(v) for c, v in self.samples.get(key, {}).items() if v}

    def record(self, key, candidate: str, gbps: float) -> None:
        if gbps > 0 and math.isfinite(gbps):
            with self._lock:
                _keep_latest(self.samples[key][candidate], gbps)

    def record_pair(self, key, candidate: str, gbps: float) -> None:
        """A transfer of ``candidate`` under shared ``key`` and those beside it moved ``gbps`` together."""
        if gbps > 0 and math.isfinite(gbps):
            with self._lock:
                _keep_latest(self.pairs[key][candidate], gbps)

    def best(self, key) -> str | None:
        """The candidate with the highest :func:`score` for ``key`` (None: nothing timed)."""
        seen = self._scores(key)
        return max(seen, key=seen.get) if seen else None


def _keep_latest(samples: list[float], gbps: float) -> None:
    samples.append(gbps)
    del samples[:-WINDOW]


def score(samples: list[float]) -> float:
    """What a candidate's samples say it runs at: the second best of three or more (one
    inflated sample and one lucky one both left out), else the best."""
    return sorted(samples)[-2] if len(samples) >= 3 else max(samples)


def _before(a, b) -> bool:
    """Event ``a`` fired before event ``b`` (both complete)."""
    return a.elapsed_time(b) > 0


class _Timing:
    """One timed transfer: ``end`` is None until its last copy is queued."""

    __slots__ = ("key", "candidate", "nbytes", "start", "end", "device")

    def __init__(self, key, candidate: str, start, nbytes: int = 0, end=None, device=None):
        self.key, self.candidate, self.start, self.nbytes, self.end = key, candidate, start, nbytes, end
        self.device = device  # transfers on different GPUs share no link (and their events cannot be compared)

    def complete(self) -> bool:
        return self.end is not None and self.end.query()


class PendingTimings:
    """Start/end events of transfers in flight; harvested when they complete.

    A transfer that ran while one in the other direction did shares the
    link with it, so its sample is filed under its key plus ``DUPLEX`` and
    never mixes with the samples of transfers that had the link alone.
    Keys start with the direction (``to_host``). A transfer counts as in
    flight from :meth:`open` (when it is prepared), not only once its copies
    are queued: a backup's copies may still be being queued by a background
    thread when the load after it asks whether it will share the link.
    """

    def __init__(self, history: int = 16):
        self._pending: list[_Timing] = []
        self._recent: deque = deque(maxlen=history)  # finished timings, for the overlaps of later ones
        self._last_shared: dict[tuple, bool] = {}  # per (device, direction): did its last sample share the link?
        self._paired: list[_Timing] = []  # finished beside others still in flight: pair samples to come
        self._lock = threading.Lock()

    def open(self, key, candidate: str, start, device=None) -> _Timing:
        """A transfer starts (``start``: its start event, recorded) on ``device`` (its GPU's
        index); :meth:`close` it once queued."""
        t = _Timing(key, candidate, start, device=device)
        with self._lock:
            self._pending.append(t)
        return t

    def close(self, t: _Timing, nbytes: int, end) -> None:
        with self._lock:
            t.nbytes, t.end = nbytes, end

    def drop(self, t: _Timing) -> None:
        """Forget a transfer that failed: no sample, and no longer in flight."""
        with self._lock:
            self._pending = [p for p in self._pending if p is not t]

    def add(self, key, candidate: str, nbytes: int, start, end, device=None) -> None:
        self.close(self.open(key, candidate, start, device), nbytes, end)

    def pending(self, key, candidate: str) -> bool:
        """Whether a transfer of ``key`` (alone or sharing the link) by ``candidate`` is in flight."""
        with self._lock:
            return any(p.candidate == candidate and _solo(p.key) == key for p in self._pending)

    def busy(self, to_host: bool, device=None) -> bool:
        """True while a timed transfer in direction ``to_host`` on ``device`` has not finished."""
        with self._lock:
            return any(p.key[0] == to_host and p.device == device and not p.complete() for p in self._pending)

    def sharing(self, to_host: bool, device=None) -> bool:
        """Whether a transfer in direction ``to_host`` on ``device`` starting now will likely share
        its link: one the other way is in flight there, or the last finished one this way did
        share it (backups and loads tend to keep coming together; the first transfer of such a
        pair is issued while the other way is still idle)."""
        return self.busy(not to_host, device) or self._last_shared.get((device, to_host), False)

    def harvest(self, chooser: OnlineChooser) -> None:
        with self._lock:
            done = [p for p in self._pending if p.complete()]
            self._pending = [p for p in self._pending if all(p is not q for q in done)]
            spans = done + self._pending + list(self._recent)
            self._recent.extend(done)
            paired, self._paired = self._paired, []
        found = {}  # id of a transfer finished now: those beside it (each a few event queries)
        for p in done:
            ms = p.start.elapsed_time(p.end)
            if ms <= 0:
                continue
            beside = found[id(p)] = _beside(p, spans)
            self._last_shared[(p.device, p.key[0])] = bool(beside)
            chooser.record(_solo(p.key) + (DUPLEX,) if beside else _solo(p.key), p.candidate, p.nbytes / ms / 1e6)
            if beside:
                paired.append(p)
        # What each transfer and those beside it moved together, once all of them have finished.
        waiting = []
        for p in paired:
            beside = found[id(p)] if id(p) in found else _beside(p, spans)
            if not beside:  # those beside it have left the recent history: no pair to file
                continue
            if not all(q.complete() for q in beside):
                waiting.append(p)
                continue
            t0 = min([0.0] + [p.start.elapsed_time(q.start) for q in beside])
            t1 = max(p.start.elapsed_time(q.end) for q in [p] + beside)
            if t1 > t0:
                chooser.record_pair(_solo(p.key) + (DUPLEX,), p.candidate,
                                    (p.nbytes + sum(q.nbytes for q in beside)) / (t1 - t0) / 1e6)
        with self._lock:
            self._paired = (waiting + self._paired)[-self._recent.maxlen:]


def _beside(p: _Timing, spans) -> list[_Timing]:
    """The transfers in ``spans`` the other way on the same GPU whose time overlapped ``p``'s (complete)."""
    return [q for q in spans if q.key[0] != p.key[0] and q.device == p.device
            and _overlaps(p.start, p.end, q.start, q.end)]


def _solo(key) -> tuple:
    """``key`` without ``DUPLEX``: how a transfer ran decides where its sample goes, not what was expected."""
    return key[:-1] if key[-1] == DUPLEX else key


def _overlaps(start, end, s, e) -> bool:
    """Whether [start, end] (complete) and [s, e] (``e`` may still be pending, or not yet
    recorded: None) intersect."""
    if not s.query() or not _before(s, end):
        return False
    return e is None or not e.query() or _before(start, e)
