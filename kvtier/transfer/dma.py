"""The ``dma`` backend: copy engines move the bytes, SMs only gather and scatter.

A transfer is cut into staging chunks (:mod:`.dma_plan`). For a backup, a
gather kernel on a side stream packs chunk ``k`` into a staging buffer while
the copy engine drains chunk ``k-1`` to the host on the caller's stream; a
load runs the other way round. Staging is a small ring of device buffers per
direction, reused only after the event that last used a buffer has fired,
so memory stays bounded and no buffer is overwritten while a copy reads it.

Two things keep the copy engine at the PCIe limit where a layout makes its
work small. Many 1-D copies of a chunk are queued in one
``cudaMemcpyBatchAsync`` call (about 0.3 us each instead of about 2-4 us, so
the host keeps ahead of the engine). And a load from a page-major layout,
where one layer of a token is a short row between the other layers' rows,
copies several adjacent layers at once: on an H200 the copy engine moves
2 KiB rows spaced 64 KiB apart at 61% of a contiguous copy, and 32 KiB rows
at 100% (``bench/results/probe_copy_paths_h200.json``). How many layers is
measured once per row geometry (:meth:`DMABackend.row_rate`), not guessed;
``DMAConfig.load_group`` overrides it (1 = strictly one layer at a time).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch

from .base import Backend, TransferPart
from .cudart import has_batch, memcpy2d, memcpy_batch
from .dma_plan import (DMAPlan, GroupedPlan, choose_group, dma_capable, grouped_plan, plan, run_class,
                       split_copies)
from .kernel import KernelBackend, PartTables, check_mapped, on_device
from .timing import event_seconds
from .triton_kernels import copy_items
from ..validate import require_positive_int

MiB = 1 << 20


@dataclass(frozen=True)
class DMAConfig:
    """How the DMA backend stages and queues copies.

    ``staging_bytes`` per buffer, ``buffers`` per direction, ``gather_blocks``
    per gather or scatter kernel. ``load_group``: adjacent layers a load from
    a page-major layout copies at once; 0 measures the fewest that keep the
    copy engine at ``group_target`` of a contiguous copy with copies of
    ``min_copy_bytes`` on average, 1 keeps loads strictly layer by layer
    (finest overlap with the forward pass).
    ``batch_min``: a chunk with at least this many 1-D copies queues them in
    one batched call.
    """

    staging_bytes: int = 32 * MiB
    buffers: int = 3
    gather_blocks: int = 16
    load_group: int = 0
    group_target: float = 0.97
    min_copy_bytes: int = 256 * 1024
    batch_min: int = 8

    def __post_init__(self) -> None:
        for name in ("staging_bytes", "buffers", "gather_blocks", "batch_min", "min_copy_bytes"):
            require_positive_int(f"DMAConfig.{name}", getattr(self, name))
        if self.buffers < 2:
            raise ValueError(f"DMAConfig.buffers must be >= 2 so copies and kernels overlap, got {self.buffers}")
        if isinstance(self.load_group, bool) or not isinstance(self.load_group, int) or self.load_group < 0:
            raise ValueError(f"DMAConfig.load_group must be 0 (measure) or a positive layer count, got {self.load_group!r}")
        if not 0 < self.group_target <= 1:
            raise ValueError(f"DMAConfig.group_target must be in (0, 1], got {self.group_target!r}")


class _Slot:
    def __init__(self):
        self.buf: torch.Tensor | None = None
        self.free = None   # event: the last use of buf is complete once it fires
        self.ready = None  # event: buf holds the chunk the other stream waits for


class StagingRing:
    """Staging buffers and a side stream for one (device, direction)."""

    def __init__(self, device: torch.device, config: DMAConfig, priority: int):
        self.device = device
        self.config = config
        self.side = torch.cuda.Stream(device, priority=priority)
        self.slots = [_Slot() for _ in range(config.buffers)]
        self.next = 0
        self.lock = threading.Lock()

    def take(self, nbytes: int) -> _Slot:
        slot = self.slots[self.next]
        self.next = (self.next + 1) % len(self.slots)
        if slot.buf is None or slot.buf.numel() < nbytes:
            if slot.free is not None:
                slot.free.synchronize()  # growing: the old buffer must be idle before it goes
            slot.buf = torch.empty(max(nbytes, self.config.staging_bytes), dtype=torch.uint8, device=self.device)
            slot.free, slot.ready = torch.cuda.Event(), torch.cuda.Event()
        return slot


class DMABackend(Backend):
    name = "dma"

    def __init__(self, config: DMAConfig = DMAConfig(), fallback: KernelBackend | None = None):
        self.config = config
        self.tables = PartTables()
        self.fallback = fallback or KernelBackend()
        self._rings: dict[tuple[int, bool], StagingRing] = {}
        self._rates: dict[tuple, float] = {}
        self._groups: dict[tuple, int] = {}
        self._rate_lock = threading.Lock()
        self.last_blocks = 0
        self.last_groups: list[int] = []  # layers per copy of the last load's parts (1 = per layer)

    def ring(self, device: torch.device, to_host: bool) -> StagingRing:
        key = (device.index, to_host)
        if key not in self._rings:
            # Loads feed the forward pass: their side stream runs at high priority.
            self._rings[key] = StagingRing(device, self.config, 0 if to_host else -1)
        return self._rings[key]

    def plan_part(self, part: TransferPart, host_np: np.ndarray, to_host: bool,
                  whole: bool = True) -> DMAPlan | GroupedPlan | None:
        """The plan for one part, or None where the host slots do not suit DMA.

        A backup moves every layer in one plan; a load of every layer
        (``whole``) moves groups of adjacent layers (:meth:`load_group`).
        """
        if not dma_capable(part.host, host_np):
            return None
        if to_host:
            return plan(part.host, host_np, part.layer_num, self.config.staging_bytes)
        group, built = self.load_group(part, host_np) if whole else (1, {})
        return grouped_plan(part.host, host_np, group, self.config.staging_bytes, built)

    def load_group(self, part: TransferPart, host_np: np.ndarray) -> tuple[int, dict]:
        """Layers per copy for loading ``host_np`` (and the plans built deciding it).

        Decided once per placement, size class and run-length class, then reused.
        """
        if self.config.load_group:
            return min(self.config.load_group, part.layer_num), {}
        key = (part.host, part.device_layers[0].device.index, int(host_np.size).bit_length(), run_class(host_np))
        if key in self._groups:
            return self._groups[key], {}
        group, built = choose_group(part.host, host_np, self.config.staging_bytes,
                                    lambda w, p, off: self.row_rate(part, w, p, off), self.config.group_target,
                                    self.config.min_copy_bytes)
        self._groups[key] = group
        return group, built

    @property
    def row_rates(self) -> dict[tuple, float]:
        """Measured pitched-row rates so far: ``{(device, width, pitch, offset): fraction of a contiguous copy}``."""
        return dict(self._rates)

    def row_rate(self, part: TransferPart, width: int, pitch: int, offset: int = 0) -> float:
        """Host -> device bandwidth of rows ``width`` bytes wide and ``pitch`` apart from byte
        ``offset`` of the part, over a contiguous copy's.

        Timed once per (device, width, pitch, offset) by copying rows of this part's
        host memory (read only) into a scratch buffer. Small copies flatter
        the copy engine, so this moves up to 64 MiB and blocks the host for
        a few milliseconds, once.
        """
        device = part.device_layers[0].device
        key = (device.index, width, pitch, offset)
        with self._rate_lock:
            if key not in self._rates:
                self._rates[key] = _measure_row_rate(part.host_raw[offset:], device, width, pitch)
            return self._rates[key]

    def backup(self, parts, host_idx, dev_idx, block_quota=None):
        self.run(parts, host_idx, dev_idx, None)

    def load(self, parts, host_idx, dev_idx, layer):
        self.run(parts, host_idx, dev_idx, layer)

    def run(self, parts, host_idx, dev_idx, layer) -> None:
        # One layer on its own: no group, whatever the layout.
        self.prepare(parts, host_idx, dev_idx, layer is None, whole=False)(layer)

    def prepare(self, parts, host_idx, dev_idx, to_host: bool, block_quota: int | None = None, whole: bool = True):
        """Plans made once; returns ``run(layer)`` (``layer=None`` for a backup).

        ``whole``: a load's ``run`` will be called for every layer, in order,
        so adjacent layers may be copied together. Parts whose host slots do
        not suit DMA (partial pages of a page-jumping layout) go through the
        kernel backend.
        """
        for part in parts:
            check_mapped(part)
        host_np = host_idx.to("cpu").numpy()
        plans = [self.plan_part(p, host_np, to_host, whole) for p in parts]
        return self.runner(parts, plans, host_idx, dev_idx, block_quota)

    def runner(self, parts, plans, host_idx, dev_idx, block_quota=None):
        device = parts[0].device_layers[0].device
        d = on_device(dev_idx, device)
        h = on_device(host_idx, device) if any(p is None for p in plans) else None
        blocks = self.fallback._blocks(block_quota)
        joined = [False]  # a load's copy stream joins the caller's stream once per transfer
        if any(isinstance(p, GroupedPlan) for p in plans):
            self.last_groups = [p.group if isinstance(p, GroupedPlan) else 1 for p in plans]

        def run(layer):
            used = 0
            for part, p in zip(parts, plans):
                if p is None:
                    used = max(used, self.fallback.copy_part(part, h, d, layer, blocks))
                    continue
                if layer is None:
                    self.run_part(part, p, d, None)
                elif n := p.issue_at(layer):  # 0: moved with its group's first layer
                    self.run_part(part, p.plans[n], d, layer, join=not joined[0], n_layers=n)
                    joined[0] = True
                used = max(used, self.config.gather_blocks)
            self.last_blocks = used
        return run

    def run_part(self, part: TransferPart, p: DMAPlan, d: torch.Tensor, layer: int | None, join: bool = True,
                 n_layers: int = 1) -> None:
        """Queue one part: all layers (``layer=None``) or layers ``layer .. layer+n_layers-1``.

        Backup: gather on the side stream, copy on the caller's. Load: copies
        on the side stream, scatters on the caller's, so the copy engine runs
        ahead into free staging buffers while earlier chunks (and layers) are
        scattered; the side stream joins the caller's stream only on the
        first layer of a transfer (``join``), which carries the transfer's
        ordering after compute and after conflicting transfers.
        """
        to_host = layer is None
        ring = self.ring(d.device, to_host)
        cur = torch.cuda.current_stream(d.device)
        ptrs = self.tables.get(part, d.device)
        host_base = part.host_raw.data_ptr() + (0 if to_host else layer * part.host.layer_stride)
        if to_host:
            n_layers = part.layer_num
        batch = self.config.batch_min
        with ring.lock:
            if to_host or join:
                ring.side.wait_stream(cur)
            if to_host:
                d.record_stream(ring.side)
            for i in range(p.n_chunks):
                j0, m, copies = p.chunk(i)
                slot = ring.take(p.staging_bytes)
                if to_host:
                    self._gather(ring, slot, p, part, ptrs, d, j0, m, n_layers)
                    cur.wait_event(slot.ready)
                    _issue(copies, host_base, slot.buf.data_ptr(), to_host, cur.cuda_stream, batch)
                    slot.free.record(cur)
                else:
                    ring.side.wait_event(slot.free)
                    _issue(copies, host_base, slot.buf.data_ptr(), to_host, ring.side.cuda_stream, batch)
                    slot.ready.record(ring.side)
                    cur.wait_event(slot.ready)
                    copy_items(p.staging, slot.buf, part.device_layers, ptrs, None, d, j0, m, layer, n_layers,
                               False, self.config.gather_blocks)
                    slot.free.record(cur)

    def _gather(self, ring, slot, p, part, ptrs, d, j0, m, n_layers) -> None:
        side = ring.side
        side.wait_event(slot.free)
        with torch.cuda.stream(side):
            copy_items(p.staging, slot.buf, part.device_layers, ptrs, None, d, j0, m, 0, n_layers,
                       True, self.config.gather_blocks)
        slot.ready.record(side)


# cudaMemcpy2D refuses pitches past the device's memPitch (2^31 - 1 on current GPUs).
_MAX_PITCH = (1 << 31) - 1


def _issue(copies: np.ndarray, host_base: int, stg_base: int, to_host: bool, stream: int,
           batch_min: int = 8) -> None:
    """Queue a chunk's copies between staging and host on ``stream``.

    Rows are ``(host_off, stg_off, width, height, host_pitch, stg_pitch)``.
    Pitched rows go one ``cudaMemcpy2DAsync`` each; 1-D copies (and rows
    whose pitch the 2-D call refuses, split into 1-D copies) go in one
    batched call when there are ``batch_min`` or more and the runtime has it.
    """
    tall, (h_off, s_off, width) = split_copies(copies, _MAX_PITCH)
    for h, st, w, height, hp, sp in tall.tolist():
        if to_host:
            memcpy2d(host_base + h, hp, stg_base + st, sp, w, height, stream)
        else:
            memcpy2d(stg_base + st, sp, host_base + h, hp, w, height, stream)
    if not len(width):
        return
    host, stg = h_off.astype(np.uint64) + np.uint64(host_base), s_off.astype(np.uint64) + np.uint64(stg_base)
    dst, src = (host, stg) if to_host else (stg, host)
    if len(width) >= batch_min and stream != 0 and has_batch():
        memcpy_batch(dst, src, width.astype(np.uint64), stream)
        return
    for a, b, w in zip(dst.tolist(), src.tolist(), width.tolist()):
        memcpy2d(a, w, b, w, w, 1, stream)


def _measure_row_rate(host_raw: torch.Tensor, device: torch.device, width: int, pitch: int,
                      payload: int = 64 * MiB) -> float:
    """Timed pitched host -> device copies over a contiguous copy of the same bytes (median of 3)."""
    rows = max(1, min(payload // width, host_raw.numel() // pitch))
    nbytes = rows * width
    scratch = torch.empty(nbytes, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device)
    src, dst = host_raw.data_ptr(), scratch.data_ptr()

    s = stream.cuda_stream
    with torch.cuda.stream(stream):
        pitched = event_seconds(lambda: memcpy2d(dst, width, src, pitch, width, rows, s))
        flat = event_seconds(lambda: memcpy2d(dst, nbytes, src, nbytes, nbytes, 1, s))
    return flat / pitched if pitched > 0 else 1.0
