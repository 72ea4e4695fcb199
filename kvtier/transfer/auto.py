"""The ``auto`` backend: per transfer, kernel or DMA, whichever was measured faster.

Choice is online (:mod:`.online`): each transfer shape tries both backends
on real transfers (twice each), timed by device events, and then keeps the
one with the best sample. The
first try follows a prior: a cost model calibrated once per device and
process, on first use, by timing the real copy paths on scratch buffers
(about a second, most of it Triton compiling): the copy engine's bandwidth
for rows of a few widths and its cost per queued copy, and the zero-copy
kernel's bandwidth for chunks of the same widths, each in both directions.
A DMA plan costs ``copies x per_copy + bytes / dma_bw(narrowest row)``, a
kernel transfer ``bytes / kernel_bw(chunk width)``.
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
from . import streams
from .base import Backend, TransferPart
from .cudart import has_batch, memcpy2d, memcpy_batch
from .dma import DMABackend
from .dma_plan import DMAPlan, Runs
from .kernel import KernelBackend, check_mapped, host_numpy, numpy_if_host
from .online import DUPLEX, OnlineChooser, PendingTimings, shape_key
from .timing import event_seconds
from .triton_kernels import copy_items, layer_ptr_table
from ..validate import require_positive_int

WIDTHS = (256, 1024, 4096, 1 << 20)
# Candidates predicted more than this many times slower than the best are not tried. The
# prior adds the cost per copy to the time on the wire, which overestimates DMA where
# the copy engine overlaps them: at 2.0 it kept DMA from scattered page-64 loads that
# ran at 0.92-0.95x by DMA and 0.81-0.85x by the kernel (H200 run 20). What it guards
# against, copies so small that a transfer stalls, the DMA backend already sends to
# the kernel (``DMAConfig.kernel_below``).
EXPLORE_WITHIN = 4.0
CAL_BYTES = 32 << 20
PITCH_ROWS = 32
# A zero-copy backup beside a zero-copy load takes most of the link: its writes crowd out
# the load's reads. On these many blocks it leaves them room. Single scattered tokens on an
# H200, kernel both ways with the backup on 8 blocks and the load on 32 against 32 and 32:
# 1.280x against 1.071x (MHA layer_first), 1.224x against 1.040x (MLA layer_first), 1.297x
# against 1.075x (MHA page_first), but 0.805x against 1.024x (MLA page_first) (run 121,
# bench/results/probe_pair_mix_h200_run121.json). So it is a candidate, kept only where
# its pairs moved more (OnlineChooser.pick_by_pairs).
SHARED_BACKUP_BLOCKS = 8
# A shape left with the kernel alone (its transfers' runs too short for copies) is ranked again
# every this many of its transfers: a shape key covers a range of run lengths (a power of two),
# and other transfers of it may suit DMA (a review: MLA page-1 runs of 20 and 30 share a key,
# and one transfer of the first kind kept the second off DMA for good, 40 GB/s against 50).
RECHECK = 16
logger = logging.getLogger("kvtier")


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

    def dma_seconds(self, p: DMAPlan, nbytes: int, to_host: bool) -> float:
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


class AutoBackend(Backend):
    name = "auto"

    def __init__(self, kernel: KernelBackend, dma: DMABackend, explore: int = 3,
                 shared_backup_blocks: int | None = SHARED_BACKUP_BLOCKS):
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

    def load(self, parts, host_idx, dev_idx, layer):
        self.prepare(parts, host_idx, dev_idx, False, whole=False)(layer)

    def _throttled(self, block_quota: int | None) -> str | None:
        """The candidate name of a zero-copy backup on ``shared_backup_blocks`` (None where
        that is no fewer blocks than it would have anyway)."""
        n = self.shared_backup_blocks
        full = self.kernel.config.max_blocks if block_quota is None else block_quota
        return f"kernel@{n}" if n is not None and n < full else None

    def prepare(self, parts, host_idx, dev_idx, to_host: bool, block_quota: int | None = None, whole: bool = True,
                host_np: np.ndarray | None = None, dev_np: np.ndarray | None = None):
        """Choose kernel or DMA for this transfer from measured times; returns ``run(layer)``.

        The transfer is timed with device events from this call (so the
        host's planning counts where the stream sat idle waiting for it; the
        one-off ranking of a new shape, with its DMA trial loads, does not) to
        the last ``run`` call's end; that time, over the bytes moved, becomes
        one sample for this transfer's shape. Planning 32k scattered slots
        for DMA takes the host 3-15 ms per part, which a sample timed from
        the first copy left out (H200 run 16: DMA looked within 0.8x of the
        kernel alone and was sent into "both" pairs it slowed).
        """
        for part in parts:
            check_mapped(part)
        device = parts[0].device_layers[0].device
        start = torch.cuda.Event(enable_timing=True)
        start.record(torch.cuda.current_stream(device))
        host_np = host_numpy(host_idx) if host_np is None else host_np
        per_run = sum(host_np.size * p.item_bytes * (p.layer_num if to_host else 1) for p in parts)
        # The run class from a count of runs alone; the runs' lengths (Runs.of: ~0.2 ms for 32k
        # scattered slots) only if DMA is ranked or chosen.
        # Kept per GPU: another GPU's link is another link.
        base = shape_key(to_host, parts, host_np, per_run) + (device.index,)
        # A transfer the other way shares the link: its samples are kept apart. A backup that
        # will likely share it goes by DMA where it can (a zero-copy backup held pairs to about
        # one direction's rate); a load goes by whichever candidate's pairs moved more, both
        # transfers' bytes from the first start to the last end (OnlineChooser.pick, pair_loads).
        self.timings.harvest(self.chooser)
        key = base + (DUPLEX,) if self.timings.sharing(to_host, device.index) else base
        seen = self._kernel_only.get(base)
        if seen is not None:
            if seen + 1 >= RECHECK:
                self._candidates.pop(base, None)  # ranked again below
                self._kernel_only.pop(base, None)
            else:
                self._kernel_only[base] = seen + 1
        candidates = self._candidates.get(base)
        # The host slots in the DMA backend's order, their runs and the order: worked out once, if DMA needs them.
        for_dma = functools.cache(lambda: self.dma.in_host_order(parts, host_np, Runs.of(host_np)))
        if candidates is None:  # first transfer of this shape: rank by the prior
            s_np, s_runs, order = for_dma()
            ranking = self.dma.plan_parts(parts, s_np, s_runs, order, to_host, whole, dev_np)
            candidates = self._candidates[base] = self.ranked(parts, ranking, host_np.size, to_host)
            if all(p is None for p in ranking):
                self._kernel_only.setdefault(base, 0)
            # Ranking plans every chunk up front (5-15 ms for 32k scattered slots), once per
            # shape: the sample starts after it, and the transfer plans afresh, as later ones
            # do, or the first candidate tried would carry that one-off cost in its sample.
            start = torch.cuda.Event(enable_timing=True)
            start.record(torch.cuda.current_stream(device))
        self._dma_able[to_host] = "dma" in candidates
        partner_kernel_only = not self._dma_able.get(not to_host, True)
        # A candidate whose transfer raised is set aside for the shape (else, never sampled, it
        # would be explored again at every transfer, and every one would fail).
        failed = self._failed.get(base, ())
        # (With every candidate failed, the kernel, which moves any shape, is tried before giving up.)
        working = ([c for c in candidates if c not in failed] or ([] if "kernel" in failed else ["kernel"])
                   or candidates)
        choice = self.chooser.pick(key, working, partner_kernel_only)
        # A shared kernel backup is also tried on fewer blocks, only where the loads beside are
        # likely zero-copy too: this backup has no DMA candidate (nor, on the same rows, have the
        # loads), or the loads have none. Beside DMA loads a kernel backup on 8 blocks ran at
        # 1.05x (MLA layer_first page 64, run 123).
        if (to_host and choice == "kernel" and key[-1] == DUPLEX and ("dma" not in candidates or partner_kernel_only)
                and (throttled := self._throttled(block_quota)) and throttled not in self._failed.get(base, ())):
            choice = self.chooser.pick_by_pairs(key, ["kernel", throttled])
            if choice == throttled:
                block_quota = self.shared_backup_blocks
        # DMA plans are made only for DMA (chunk by chunk as the chunks are queued).
        plans = None
        if choice == "dma":
            s_np, s_runs, order = for_dma()
            plans = self.dma.plan_parts(parts, s_np, s_runs, order, to_host, whole, dev_np)
            if all(p is None for p in plans):
                # This transfer's runs are too short for copies (its shape key's were not): it goes
                # by the kernel, and its sample is the kernel's, not filed as DMA's. Where DMA has no
                # sample for the shape yet, it is set aside (or every later transfer would be planned
                # for DMA first while DMA waits for samples it never gets), and looked at again every
                # RECHECK transfers; where it has, other transfers of the shape did go by it: kept.
                choice, plans = "kernel", None
                if not (any(self.chooser.samples.get(k, {}).get("dma") for k in (base, base + (DUPLEX,)))
                        or self.timings.pending(base, "dma")):
                    self._candidates[base] = [c for c in candidates if c != "dma"] or ["kernel"]
                    self._kernel_only.setdefault(base, 0)
        self.picks[("backup" if to_host else "load", choice)] += 1
        try:
            if plans is not None:
                inner = self.dma.runner_for(parts, plans, order, s_np, host_idx, dev_idx, block_quota,
                                            lazy_dev=not to_host, kernel_np=(host_np, numpy_if_host(dev_idx, dev_np)),
                                            to_host=to_host)
            else:
                plans = [None] * len(parts)
                inner = self.dma.runner(parts, plans, host_idx, dev_idx, block_quota,
                                        kernel_np=(host_np, numpy_if_host(dev_idx, dev_np)), to_host=to_host)
        except Exception:
            self._set_aside(base, choice, to_host)
            raise
        self.last_choice = ["kernel" if p is None else "dma" for p in plans]
        state = {"bytes": 0}
        # In flight from now: a backup's copies may be queued later, by the engine's
        # background thread, after the load that follows it asked whether it shares the link.
        timing = self.timings.open(key, choice, start, device.index)

        def failed(error: BaseException):
            self.timings.drop(timing)
            if isinstance(error, Exception):  # (an interrupt says nothing about the candidate)
                self._set_aside(base, choice, to_host)

        def run(layer):
            try:
                inner(layer)
            except BaseException as e:
                failed(e)
                raise
            state["bytes"] += per_run
            # The transfer ends with a backup, a whole load's last layer, or a single layer
            # prepared on its own (``load``): a timing left open would count as in flight for good.
            if layer is None or layer == parts[0].layer_num - 1 or not whole:
                end = torch.cuda.Event(enable_timing=True)
                end.record(torch.cuda.current_stream(device))
                self.timings.close(timing, state["bytes"], end)
            self.last_blocks = self.dma.last_blocks

        def head():
            try:
                inner.head()
            except BaseException as e:
                failed(e)
                raise
        run.head = head
        return run
