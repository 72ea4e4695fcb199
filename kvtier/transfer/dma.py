"""The ``dma`` backend: copy engines move the bytes, SMs only gather and scatter.

A transfer is cut into staging chunks (:mod:`.dma_plan`). For a backup, a
gather kernel on a side stream packs chunk ``k`` into a staging buffer while
the copy engine drains chunk ``k-1`` to the host on the caller's stream; a
load runs the other way round. Staging is a small ring of device buffers per
direction, reused only after the event that last used a buffer has fired,
so memory stays bounded and no buffer is overwritten while a copy reads it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch

from .base import Backend, TransferPart
from .cudart import memcpy2d
from .dma_plan import DMAPlan, dma_capable, plan
from .kernel import KernelBackend, PartTables, check_mapped, on_device
from .triton_kernels import copy_items
from ..validate import require_positive_int

MiB = 1 << 20


@dataclass(frozen=True)
class DMAConfig:
    """``staging_bytes`` per buffer, ``buffers`` per direction, ``gather_blocks`` per gather."""

    staging_bytes: int = 32 * MiB
    buffers: int = 3
    gather_blocks: int = 16

    def __post_init__(self) -> None:
        for name in ("staging_bytes", "buffers", "gather_blocks"):
            require_positive_int(f"DMAConfig.{name}", getattr(self, name))
        if self.buffers < 2:
            raise ValueError(f"DMAConfig.buffers must be >= 2 so copies and kernels overlap, got {self.buffers}")


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
        self.last_blocks = 0

    def ring(self, device: torch.device, to_host: bool) -> StagingRing:
        key = (device.index, to_host)
        if key not in self._rings:
            # Loads feed the forward pass: their side stream runs at high priority.
            self._rings[key] = StagingRing(device, self.config, 0 if to_host else -1)
        return self._rings[key]

    def plan_part(self, part: TransferPart, host_np: np.ndarray, to_host: bool) -> DMAPlan | None:
        """The plan for one part, or None where the host slots do not suit DMA."""
        if not dma_capable(part.host, host_np):
            return None
        layers = part.layer_num if to_host else 1
        return plan(part.host, host_np, layers, self.config.staging_bytes)

    def backup(self, parts, host_idx, dev_idx, block_quota=None):
        self.run(parts, host_idx, dev_idx, None)

    def load(self, parts, host_idx, dev_idx, layer):
        self.run(parts, host_idx, dev_idx, layer)

    def run(self, parts, host_idx, dev_idx, layer) -> None:
        self.prepare(parts, host_idx, dev_idx, layer is None)(layer)

    def prepare(self, parts, host_idx, dev_idx, to_host: bool, block_quota: int | None = None):
        """Plans made once; returns ``run(layer)`` (``layer=None`` for a backup).

        Parts whose host slots do not suit DMA (partial pages of a page-jumping
        layout) go through the kernel backend.
        """
        for part in parts:
            check_mapped(part)
        host_np = host_idx.to("cpu").numpy()
        plans = [self.plan_part(p, host_np, to_host) for p in parts]
        return self.runner(parts, plans, host_idx, dev_idx, block_quota)

    def runner(self, parts, plans, host_idx, dev_idx, block_quota=None):
        device = parts[0].device_layers[0].device
        d = on_device(dev_idx, device)
        h = on_device(host_idx, device) if any(p is None for p in plans) else None
        blocks = self.fallback._blocks(block_quota)
        joined = [False]  # a load's copy stream joins the caller's stream once per transfer

        def run(layer):
            used = 0
            for part, p in zip(parts, plans):
                if p is None:
                    used = max(used, self.fallback.copy_part(part, h, d, layer, blocks))
                else:
                    self.run_part(part, p, d, layer, join=not joined[0])
                    joined[0] = layer is not None
                    used = max(used, self.config.gather_blocks)
            self.last_blocks = used
        return run

    def run_part(self, part: TransferPart, p: DMAPlan, d: torch.Tensor, layer: int | None, join: bool = True) -> None:
        """Queue one part. Backup: gather on the side stream, copy on the caller's.

        Load: copies on the side stream, scatters on the caller's, so the copy
        engine runs ahead into free staging buffers while earlier chunks (and
        layers) are scattered; the side stream joins the caller's stream only
        on the first layer of a transfer (``join``), which carries the
        transfer's ordering after compute and after conflicting transfers.
        """
        to_host = layer is None
        ring = self.ring(d.device, to_host)
        cur = torch.cuda.current_stream(d.device)
        ptrs = self.tables.get(part, d.device)
        host_base = part.host_raw.data_ptr() + (0 if to_host else layer * part.host.layer_stride)
        n_layers = part.layer_num if to_host else 1
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
                    _issue(copies, host_base, slot.buf.data_ptr(), to_host, cur.cuda_stream)
                    slot.free.record(cur)
                else:
                    ring.side.wait_event(slot.free)
                    _issue(copies, host_base, slot.buf.data_ptr(), to_host, ring.side.cuda_stream)
                    slot.ready.record(ring.side)
                    cur.wait_event(slot.ready)
                    copy_items(p.staging, slot.buf, part.device_layers, ptrs, None, d, j0, m, layer, 1,
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


def _issue(copies: np.ndarray, host_base: int, stg_base: int, to_host: bool, stream: int) -> None:
    """Queue a chunk's copies between staging and host on ``stream``."""
    for h_off, s_off, width, height, hp, sp in copies.tolist():
        if height > 1 and max(hp, sp) > _MAX_PITCH:
            for r in range(height):
                _issue(np.array([[h_off + r * hp, s_off + r * sp, width, 1, width, width]]),
                       host_base, stg_base, to_host, stream)
            continue
        if to_host:
            memcpy2d(host_base + h_off, hp, stg_base + s_off, sp, width, height, stream)
        else:
            memcpy2d(stg_base + s_off, sp, host_base + h_off, hp, width, height, stream)
