"""The ``auto`` backend: per transfer, kernel or DMA, whichever was measured faster.

It is given its two candidates, a kernel backend and a DMA backend (which uses
that kernel backend for parts that do not suit copies), and imports neither.
Choice is online (:mod:`.online`): each transfer shape tries both on real
transfers, timed by device events, and then keeps the one with the best
sample.

The first try follows a prior: a cost model of the two ways of moving bytes,
calibrated once per device by timing the real copy paths on scratch buffers
(about a second, most of it Triton compiling): the copy engine's bandwidth for
rows of a few widths and its cost per queued copy, and the zero-copy kernel's
bandwidth for chunks of the same widths, each in both directions. A DMA plan
costs ``copies x per_copy + bytes / dma_bw(narrowest row)``, a kernel transfer
``bytes / kernel_bw(chunk width)``.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from ..layouts import Placement
from ..validate import require_positive_int
from . import streams
from .base import Backend
from .cuda_common import check_mapped, event_seconds, host_numpy, numpy_if_host
from .cudart import has_batch, memcpy2d, memcpy_batch
from .online import DUPLEX, OnlineChooser, PendingTimings, shape_key
from .slots import Runs
from .triton_kernels import copy_items, layer_ptr_table

WIDTHS = (256, 1024, 4096, 1 << 20)
# Candidates predicted more than this many times slower than the best are not tried: the prior
# overestimates DMA where the copy engine overlaps copies, and what it guards against (copies
# so small a transfer stalls) DMAConfig.kernel_below already sends to the kernel.
EXPLORE_WITHIN = 4.0
CAL_BYTES = 32 << 20
PITCH_ROWS = 32


@dataclass
class CostModel:
    """Measured seconds for the two ways of moving bytes; keys are (to_host, width)."""

    dma_bw: dict = field(default_factory=dict)
    kernel_bw: dict = field(default_factory=dict)
    per_copy: dict = field(default_factory=dict)   # one more 1-D copy in a batch
    per_call: dict = field(default_factory=dict)   # one more pitched copy (a runtime call each)

    @staticmethod
    def _bw(table: dict, to_host: bool, width: int) -> float:
        xs = np.log2(np.array(WIDTHS, dtype=float))
        ys = np.array([table[(to_host, w)] for w in WIDTHS])
        return float(np.interp(np.log2(max(width, 1)), xs, ys))

    def dma_seconds(self, p, nbytes: int, to_host: bool) -> float:
        return (p.n_calls * self.per_call[to_host] + p.n_flat * self.per_copy[to_host]
                + nbytes / self._bw(self.dma_bw, to_host, p.min_width))

    def kernel_seconds(self, pl: Placement, nbytes: int, to_host: bool) -> float:
        return nbytes / self._bw(self.kernel_bw, to_host, pl.chunk_bytes)


def calibrate(device: torch.device, kernel_blocks: int) -> CostModel:
    """Time each copy path on scratch buffers of ``CAL_BYTES`` (x2 for pitched rows)."""
    stream = streams.fresh(device, 0, (torch.cuda.current_stream(device),))
    with torch.cuda.stream(stream):
        return _calibrate(device, kernel_blocks, stream.cuda_stream)


def _calibrate(device: torch.device, kernel_blocks: int, s: int) -> CostModel:
    model = CostModel()
    host = torch.empty(2 * CAL_BYTES, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(2 * CAL_BYTES, dtype=torch.uint8, device=device)
    hp, dp = host.data_ptr(), dev.data_ptr()
    for to_host in (True, False):
        for w in WIDTHS:
            # Pitched rows as layouts make them (a row per layer apart: ~32 rows' pitch).
            # A 2x pitch flattered the copy engine: on an H200, 2 KiB rows 64 KiB apart
            # moved at 23 GB/s where the model had predicted near the 1-D rate.
            pitch = w if w >= (1 << 20) else PITCH_ROWS * w
            rows = min(CAL_BYTES // w, 2 * CAL_BYTES // pitch)

            def dma():
                if to_host:
                    memcpy2d(hp, pitch, dp, w, w, rows, s)
                else:
                    memcpy2d(dp, w, hp, pitch, w, rows, s)
            model.dma_bw[(to_host, w)] = rows * w / event_seconds(dma)
            kpitch = w if w >= (1 << 20) else 2 * w
            model.kernel_bw[(to_host, w)] = CAL_BYTES / event_seconds(_kernel_probe(host, dev, w, kpitch, to_host, kernel_blocks))
        # The cost of one more copy, queued as the DMA backend queues them: many
        # small 1-D copies in one batch (0.3 us each on an H200), else one by one.
        n = 256
        offs = np.arange(n, dtype=np.uint64) * np.uint64(2 * 4096)
        h_addr, d_addr = offs + np.uint64(hp), offs + np.uint64(dp)
        sizes = np.full(n, 4096, dtype=np.uint64)
        src, dst = (d_addr, h_addr) if to_host else (h_addr, d_addr)
        pairs = list(zip(dst.tolist(), src.tolist()))

        def one_by_one():
            for a, b in pairs:
                memcpy2d(a, 4096, b, 4096, 4096, 1, s)
        model.per_call[to_host] = event_seconds(one_by_one) / n
        if has_batch():
            model.per_copy[to_host] = event_seconds(lambda: memcpy_batch(dst, src, sizes, s)) / n
        else:
            model.per_copy[to_host] = model.per_call[to_host]
    return model


def _kernel_probe(host, dev, w, pitch, to_host, blocks):
    rows = CAL_BYTES // w
    pl = Placement(1, pitch, 0, 0, 0, w, 1, 1, rows * pitch)
    layer = dev[: rows * w].view(rows, w)
    ptrs = layer_ptr_table((layer,), dev.device)
    idx = torch.randperm(rows, device=dev.device)
    return lambda: copy_items(pl, host, (layer,), ptrs, idx, idx, 0, rows, 0, 1, to_host, blocks)


def rank(predicted: dict[str, float], within: float = EXPLORE_WITHIN) -> list[str]:
    """Candidates by predicted seconds, fastest first, leaving out any predicted more than
    ``within`` times slower than the fastest (never worth a trial transfer)."""
    fastest = min(predicted.values())
    return sorted((c for c, t in predicted.items() if t <= within * fastest), key=predicted.get)


# A zero-copy backup beside a zero-copy load takes most of the link; on this many blocks it
# leaves the load room. A candidate, kept only where its pairs moved more (pick_by_pairs).
SHARED_BACKUP_BLOCKS = 8
# A shape left with the kernel alone (its transfers' runs too short for copies) is ranked again
# every this many of its transfers: a shape key covers a range of run lengths, and other
# transfers of it may suit DMA.
RECHECK = 16
logger = logging.getLogger("kvtier")


@dataclass
class _Transfer:
    """What choosing for one transfer needs, worked out once at its start."""

    parts: list
    host_np: np.ndarray
    dev_np: np.ndarray | None
    to_host: bool
    whole: bool
    device: torch.device
    base: tuple       # the shape key (alone)
    key: tuple        # the shape key as this transfer will likely run (alone or sharing the link)
    per_run: int      # bytes one run() call moves
    for_dma: object   # () -> (host slots in DMA order, their runs, the order): made once, if needed


class AutoBackend(Backend):
    """Chooses kernel or DMA per transfer. Owns its cost models (per GPU), its samples and
    its per-shape state; ``kernel`` and ``dma`` are the candidates it is given.

    ``explore``: timed transfers of each candidate per shape before the choice is made.
    ``shared_backup_blocks``: a backup that shares the link with zero-copy loads and goes by
    the kernel is also tried on this many blocks (None: off)."""

    name = "auto"

    def __init__(self, kernel, dma, explore: int = 3, shared_backup_blocks: int | None = SHARED_BACKUP_BLOCKS):
        if shared_backup_blocks is not None:
            require_positive_int("shared_backup_blocks", shared_backup_blocks)
        self.kernel = kernel
        self.dma = dma
        self.shared_backup_blocks = shared_backup_blocks
        self._models: dict[int, CostModel] = {}
        self._lock = threading.Lock()
        self.chooser = OnlineChooser(explore)
        self.timings = PendingTimings()
        self._candidates: dict[tuple, list[str]] = {}  # per shape, ranked by the prior once
        # Shapes left with the kernel alone because their transfers' runs were too short for
        # copies: transfers since, ranked again every RECHECK (a shape's runs may differ).
        self._kernel_only: dict[tuple, int] = {}
        self._failed: dict[tuple, set[str]] = {}  # per shape: candidates whose transfer raised
        self.last_choice: list[str] = []
        self.last_blocks = 0
        self.picks: Counter = Counter()  # (direction, choice) -> transfers, for reports
        self._dma_able: dict[bool, bool] = {}  # per direction (to_host): could its last transfer use DMA?

    @property
    def settling_transfers(self) -> int:
        """Transfers of one shape after which the choice is made (each candidate explored)."""
        return 2 * self.chooser.explore

    def model(self, device: torch.device) -> CostModel:
        with self._lock:
            if device.index not in self._models:
                self._models[device.index] = calibrate(device, self.kernel.config.max_blocks)
            return self._models[device.index]

    def predicted_seconds(self, parts, plans, n_slots: int, to_host: bool) -> float:
        """The prior's time for one ``run`` call with these plans (None = kernel for that part)."""
        model = self.model(parts[0].device_layers[0].device)
        total = 0.0
        for part, p in zip(parts, plans):
            nbytes = n_slots * part.item_bytes * (part.layer_num if to_host else 1)
            total += model.kernel_seconds(part.host, nbytes, to_host) if p is None else model.dma_seconds(p, nbytes, to_host)
        return total

    def ranked(self, parts, dma_plans, n_slots: int, to_host: bool) -> list[str]:
        """Candidates worth trying, best predicted first."""
        if all(p is None for p in dma_plans):
            return ["kernel"]
        return rank({
            "kernel": self.predicted_seconds(parts, [None] * len(parts), n_slots, to_host),
            "dma": self.predicted_seconds(parts, dma_plans, n_slots, to_host),
        })

    def backup(self, parts, host_idx, dev_idx, block_quota=None):
        self.prepare(parts, host_idx, dev_idx, True, block_quota)(None)

    def load(self, parts, host_idx, dev_idx, layer):
        self.prepare(parts, host_idx, dev_idx, False, whole=False)(layer)

    def _set_aside(self, base: tuple, choice: str, to_host: bool) -> None:
        """A transfer of shape ``base`` by ``choice`` raised: the shape goes by the other
        candidates from now on (while it has any)."""
        with self._lock:
            if choice not in self._failed.setdefault(base, set()):
                self._failed[base].add(choice)
                others = [c for c in self._candidates.get(base, ()) if c not in self._failed[base]]
                if not others and "kernel" not in self._failed[base]:
                    others = ["kernel"]
                logger.warning("auto: a %s by %s raised; %s", "backup" if to_host else "load", choice,
                               f"that shape goes by {', '.join(others)} from now on" if others
                               else "that shape has no other candidate, and keeps it")

    def _throttled(self, block_quota: int | None) -> str | None:
        """The candidate name of a zero-copy backup on ``shared_backup_blocks`` (None where
        that is no fewer blocks than it would have anyway)."""
        n = self.shared_backup_blocks
        full = self.kernel.config.max_blocks if block_quota is None else block_quota
        return f"kernel@{n}" if n is not None and n < full else None

    def prepare(self, parts, host_idx, dev_idx, to_host: bool, block_quota: int | None = None, whole: bool = True,
                host_np: np.ndarray | None = None, dev_np: np.ndarray | None = None) -> "AutoRun":
        """Choose kernel or DMA for this transfer from measured times; returns ``run(layer)``.

        The transfer is timed with device events from this call (so the host's planning
        counts where the stream sat idle waiting for it; the one-off ranking of a new shape,
        with its DMA trial loads, does not) to the last ``run`` call's end; that time, over
        the bytes moved, becomes one sample for this transfer's shape.
        """
        for part in parts:
            check_mapped(part)
        start = _started(parts[0].device_layers[0].device)
        t = self._transfer(parts, host_idx, to_host, whole, host_np, dev_np)
        candidates = self._candidates_for(t)
        if candidates is None:  # first transfer of this shape: rank by the prior
            candidates = self._rank_shape(t)
            # The ranking planned every chunk up front, once per shape: the sample starts after
            # it, or the first candidate tried would carry that one-off cost in its sample.
            start = _started(t.device)
        self._dma_able[to_host] = "dma" in candidates
        choice, block_quota = self._choose(t, candidates, block_quota)
        choice, plans = self._plans_for(t, choice, candidates)
        self.picks[("backup" if to_host else "load", choice)] += 1
        try:
            inner = self._inner(t, plans, host_idx, dev_idx, block_quota)
        except Exception:
            self._set_aside(t.base, choice, to_host)
            raise
        self.last_choice = ["kernel" if p is None else "dma" for p in (plans or [None] * len(parts))]
        # In flight from now: a backup's copies may be queued later, by the engine's
        # background thread, after the load that follows it asked whether it shares the link.
        timing = self.timings.open(t.key, choice, start, t.device.index)
        return AutoRun(self, inner, timing, t, choice)

    def _transfer(self, parts, host_idx, to_host: bool, whole: bool, host_np, dev_np) -> _Transfer:
        """The transfer's shape: its key alone (per GPU: another GPU's link is another link) and
        as it will likely run (a transfer the other way in flight shares the link, and its
        samples are kept apart)."""
        device = parts[0].device_layers[0].device
        host_np = host_numpy(host_idx) if host_np is None else host_np
        per_run = sum(host_np.size * p.item_bytes * (p.layer_num if to_host else 1) for p in parts)
        # The run class from a count of runs alone; the runs' lengths only if DMA is ranked or chosen.
        base = shape_key(to_host, parts, host_np, per_run) + (device.index,)
        self.timings.harvest(self.chooser)
        key = base + (DUPLEX,) if self.timings.sharing(to_host, device.index) else base
        for_dma = functools.cache(lambda: self.dma.in_host_order(parts, host_np, Runs.of(host_np)))
        return _Transfer(parts, host_np, dev_np, to_host, whole, device, base, key, per_run, for_dma)

    def _candidates_for(self, t: _Transfer) -> list[str] | None:
        """The shape's ranked candidates, None where it is to be ranked (first seen, or a
        kernel-only shape due for its :data:`RECHECK`)."""
        seen = self._kernel_only.get(t.base)
        if seen is not None:
            if seen + 1 >= RECHECK:
                self._candidates.pop(t.base, None)
                self._kernel_only.pop(t.base, None)
            else:
                self._kernel_only[t.base] = seen + 1
        return self._candidates.get(t.base)

    def _rank_shape(self, t: _Transfer) -> list[str]:
        """Rank a shape's candidates by the prior, from full DMA plans of this transfer."""
        s_np, s_runs, order = t.for_dma()
        ranking = self.dma.plan_parts(t.parts, s_np, s_runs, order, t.to_host, t.whole, t.dev_np)
        candidates = self._candidates[t.base] = self.ranked(t.parts, ranking, t.host_np.size, t.to_host)
        if all(p is None for p in ranking):
            self._kernel_only.setdefault(t.base, 0)
        return candidates

    def _choose(self, t: _Transfer, candidates: list[str], block_quota: int | None) -> tuple[str, int | None]:
        """The candidate this transfer goes by, and its block quota.

        A candidate whose transfer raised is set aside for the shape (else, never sampled, it
        would be explored again at every transfer); with every candidate failed, the kernel,
        which moves any shape, is tried before giving up. A shared kernel backup is also tried
        on fewer blocks, only where the loads beside are likely zero-copy too: this backup has
        no DMA candidate (nor, on the same rows, have the loads), or the loads have none."""
        partner_kernel_only = not self._dma_able.get(not t.to_host, True)
        failed = self._failed.get(t.base, ())
        working = ([c for c in candidates if c not in failed] or ([] if "kernel" in failed else ["kernel"])
                   or candidates)
        choice = self.chooser.pick(t.key, working, partner_kernel_only)
        if (t.to_host and choice == "kernel" and t.key[-1] == DUPLEX
                and ("dma" not in candidates or partner_kernel_only)
                and (throttled := self._throttled(block_quota)) and throttled not in failed):
            choice = self.chooser.pick_by_pairs(t.key, ["kernel", throttled])
            if choice == throttled:
                block_quota = self.shared_backup_blocks
        return choice, block_quota

    def _plans_for(self, t: _Transfer, choice: str, candidates: list[str]) -> tuple[str, list | None]:
        """DMA plans where the choice is DMA (planned chunk by chunk as the chunks are queued),
        else None. A transfer whose runs are too short for copies (its shape key's were not)
        goes by the kernel, and its sample is the kernel's; where DMA has no sample for the
        shape yet, DMA is set aside for it (else every later transfer would be planned for DMA
        first while DMA waits for samples it never gets) and looked at again every
        :data:`RECHECK` transfers."""
        if choice != "dma":
            return choice, None
        s_np, s_runs, order = t.for_dma()
        plans = self.dma.plan_parts(t.parts, s_np, s_runs, order, t.to_host, t.whole, t.dev_np)
        if not all(p is None for p in plans):
            return choice, plans
        if not (any(self.chooser.samples.get(k, {}).get("dma") for k in (t.base, t.base + (DUPLEX,)))
                or self.timings.pending(t.base, "dma")):
            self._candidates[t.base] = [c for c in candidates if c != "dma"] or ["kernel"]
            self._kernel_only.setdefault(t.base, 0)
        return "kernel", None

    def _inner(self, t: _Transfer, plans, host_idx, dev_idx, block_quota):
        """The DMA backend's runner for ``plans`` (None: every part by the kernel)."""
        kernel_np = (t.host_np, numpy_if_host(dev_idx, t.dev_np))
        if plans is not None:
            s_np, _, order = t.for_dma()
            return self.dma.runner_for(t.parts, plans, order, s_np, host_idx, dev_idx, block_quota,
                                       lazy_dev=not t.to_host, kernel_np=kernel_np, to_host=t.to_host)
        return self.dma.runner(t.parts, [None] * len(t.parts), host_idx, dev_idx, block_quota,
                               kernel_np=kernel_np, to_host=t.to_host)


def _started(device: torch.device) -> torch.cuda.Event:
    """A timing event recorded now on ``device``'s current stream."""
    start = torch.cuda.Event(enable_timing=True)
    start.record(torch.cuda.current_stream(device))
    return start


class AutoRun:
    """One transfer by ``auto``'s choice: ``run(layer)`` and ``head()`` as the chosen runner's,
    timing the transfer from its start to its last call and filing the sample; a call that
    raises drops the timing and sets the candidate aside for the shape."""

    def __init__(self, auto: AutoBackend, inner, timing, t: _Transfer, choice: str):
        self.auto, self.inner, self.timing, self.t, self.choice = auto, inner, timing, t, choice
        self._bytes = 0

    def _failed(self, error: BaseException) -> None:
        self.auto.timings.drop(self.timing)
        if isinstance(error, Exception):  # (an interrupt says nothing about the candidate)
            self.auto._set_aside(self.t.base, self.choice, self.t.to_host)

    def __call__(self, layer: int | None) -> None:
        try:
            self.inner(layer)
        except BaseException as e:
            self._failed(e)
            raise
        self._bytes += self.t.per_run
        # The transfer ends with a backup, a whole load's last layer, or a single layer
        # prepared on its own (``load``): a timing left open would count as in flight for good.
        if layer is None or layer == self.t.parts[0].layer_num - 1 or not self.t.whole:
            self.auto.timings.close(self.timing, self._bytes, _started(self.t.device))
        self.auto.last_blocks = self.auto.dma.last_blocks

    def head(self) -> None:
        try:
            self.inner.head()
        except BaseException as e:
            self._failed(e)
            raise
