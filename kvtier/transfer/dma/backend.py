"""The ``dma`` backend: copy engines move the bytes, SMs only gather and scatter.

A transfer is cut into staging chunks (:mod:`.plan`, :mod:`.chunked`). For a
backup, a gather kernel on a side stream packs chunk ``k`` into a staging
buffer while the copy engine drains chunk ``k-1`` to the host on the caller's
stream; a load runs the other way round (:mod:`.issue`). Staging is a small
ring of device buffers per direction (:mod:`.staging`).

A load from a page-major layout, where one layer of a token is a short row
between the other layers' rows, copies several adjacent layers at once: how
many is measured once per layout, size and run length by timing trial loads
(:meth:`DMABackend.load_group`), not guessed; ``DMAConfig.load_group``
overrides it. Parts whose copies would be too small go through the zero-copy
kernel backend it is given (``fallback``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace

import numpy as np
import torch

from ...validate import require_positive_int
from .. import streams
from ..base import Backend, TransferPart
from ..cuda_common import PartTables, check_mapped, event_seconds, host_numpy, numpy_if_host, on_device
from ..kernel import KernelBackend
from ..slots import HostOrder, Runs, run_class
from .chunked import (ChunkedPlan, GroupedPlan, LayerChunkedPlan, PoolPlan, choose_group, grouped_plan, layer_major,
                      narrow_layer_rows, pool_placement, pool_row_bytes, staged)
from .issue import ChunkIssue, DMARun
from .plan import RAMP_MIN_BYTES, dma_capable, mean_copy_bound
from .staging import StagingRing


MiB = 1 << 20


@dataclass(frozen=True)
class DMAConfig:
    """How the DMA backend stages and queues copies; checked once, never mutated.

    Staging and kernels:

    - ``staging_bytes`` per buffer and ``buffers`` per direction (>= 2, so copies and kernels
      overlap): device memory ``2 * buffers * staging_bytes`` at most. Fewer, larger chunks
      cost the host less to queue.
    - ``gather_blocks``: SMs per gather or scatter kernel; they run in bursts between copies.
    - ``batch_min``: a chunk with at least this many 1-D copies queues them in one
      ``cudaMemcpyBatchAsync`` call.

    Which parts and slots go by DMA:

    - ``kernel_below``: a part whose copies would average fewer bytes than this goes through
      the zero-copy kernel instead (a pitched copy of close rows counts once; the average is
      bounded from the runs of consecutive host slots, so nothing is planned first). 0 keeps
      every part on the copy engines.
    - ``sort_slots`` / ``sort_below``: move a transfer's slot pairs in host-slot order
      (:class:`~kvtier.transfer.slots.HostOrder`) where, as given, some part's copies would
      average fewer than ``sort_below`` bytes. Parts that go through the kernel keep the
      caller's order (and sort a backup's pairs on the device themselves).
    - ``pool_rows``: a backup of a layer-major layout copies straight from the device pool to
      the host (no staging, no SMs: :class:`~.chunked.PoolPlan`) where its runs average at
      least this many bytes a layer; 0 (default): always through staging, which is faster.
    - ``kernel_aside``: a backup's zero-copy parts run on a stream of their own beside the
      other parts' copies, not after them.

    Loads:

    - ``load_group``: adjacent layers a load from a page-major layout copies at once; 0
      measures it (the fewest whose trial load reaches ``group_target`` of the fastest trial),
      1 keeps loads strictly layer by layer (finest overlap with the forward pass).

    Sharing the copy engine with other streams (an engine's own small copies):

    - ``load_drain``: every this many layers a load's copies wait, on the device, for a
      one-element kernel queued after the copy before them, so the queue runs dry for a
      moment and host -> device copies of other streams go through (0: never);
      ``load_drain_bytes``: and no sooner than this many bytes of the load after the last
      drain (0: every ``load_drain`` layers whatever their size).
    - ``backup_drain``: the same for a backup's device -> host copies, every this many chunks.
    - ``head_bytes``: a backup's first chunks, up to this many bytes (at least one chunk), are
      queued in the caller's thread before ``backup()`` returns; the engine's background
      thread queues the rest.

    Every default was measured on an H200 (docs/configuration.md, "Where each default comes from").
    """

    staging_bytes: int = 128 * MiB
    buffers: int = 3
    gather_blocks: int = 48
    load_group: int = 0
    group_target: float = 0.97
    batch_min: int = 8
    kernel_below: int = 32 * 1024
    sort_slots: bool = True
    sort_below: int = 1 * MiB
    load_drain: int = 4
    load_drain_bytes: int = 512 * MiB
    backup_drain: int = 4
    head_bytes: int = 96 * MiB
    kernel_aside: bool = True
    pool_rows: int = 0

    def __post_init__(self) -> None:
        for name in ("staging_bytes", "buffers", "gather_blocks", "batch_min"):
            require_positive_int(f"DMAConfig.{name}", getattr(self, name))
        for name in ("sort_slots", "kernel_aside"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"DMAConfig.{name} must be True or False, got {getattr(self, name)!r}")
        if self.buffers < 2:
            raise ValueError(f"DMAConfig.buffers must be >= 2 so copies and kernels overlap, got {self.buffers}")
        if isinstance(self.load_group, bool) or not isinstance(self.load_group, int) or self.load_group < 0:
            raise ValueError(f"DMAConfig.load_group must be 0 (measure) or a positive layer count, got {self.load_group!r}")
        for name, unit in (("load_drain", "layer"), ("backup_drain", "chunk")):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"DMAConfig.{name} must be 0 (never drain) or a {unit} count > 0, got {v!r}")
        for name in ("kernel_below", "sort_below", "head_bytes", "load_drain_bytes", "pool_rows"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"DMAConfig.{name} must be a byte count >= 0, got {v!r}")
        if not 0 < self.group_target <= 1:
            raise ValueError(f"DMAConfig.group_target must be in (0, 1], got {self.group_target!r}")


class DMABackend(ChunkIssue, Backend):
    """Moves parts through staging by the copy engines (:mod:`kvtier.transfer.dma`); parts that
    do not suit DMA go through ``fallback``, the zero-copy kernel backend it is given (default:
    a new one). Owns its staging rings, pointer tables and measured load groups."""

    name = "dma"
    _drain_after = "copy"  # how StagingRing.drain makes a gap (the other modes are for probes)

    def __init__(self, config: DMAConfig = DMAConfig(), fallback: KernelBackend | None = None):
        self.config = config
        self.tables = PartTables()
        self.fallback = fallback or KernelBackend()
        self._rings: dict[tuple[int, bool], StagingRing] = {}
        self._ring_lock = threading.Lock()
        self._rates: dict[tuple, float] = {}
        self._groups: dict[tuple, int] = {}
        self._rate_lock = threading.RLock()
        self.last_blocks = 0
        self.last_groups: list[int] = []  # layers per copy of the last load's parts (1 = per layer)

    def ring(self, device: torch.device, to_host: bool) -> StagingRing:
        key = (device.index, to_host)
        ring = self._rings.get(key)
        if ring is None:
            # Made once under a lock: two threads' first transfers each making one would leave
            # one ring's staging, still read by its copies, to a side stream handed back.
            with self._ring_lock:
                ring = self._rings.get(key)
                if ring is None:
                    # Loads feed the forward pass: their side stream runs at high priority.
                    ring = self._rings[key] = StagingRing(device, self.config, 0 if to_host else -1)
        return ring

    def plan_part(self, part: TransferPart, host_np: np.ndarray, to_host: bool,
                  whole: bool = True, runs: Runs | None = None,
                  dev_np: np.ndarray | None = None) -> ChunkedPlan | GroupedPlan | None:
        """The plan for one part, or None where the host slots do not suit DMA
        (the part then goes through the zero-copy kernel).

        A backup moves every layer in one plan; a load of every layer
        (``whole``) moves groups of adjacent layers (:meth:`load_group`).
        Host slots that do not suit DMA: partial pages of a page-jumping
        layout, and runs so short that the copies would average under
        ``DMAConfig.kernel_below`` bytes. ``runs``: :meth:`Runs.of` ``host_np``, if the
        caller has it (the parts of a transfer share their host slots). ``dev_np``: the device
        slots, paired with ``host_np``, if the caller has them on the host: a backup may then
        copy straight from the device pool (``DMAConfig.pool_rows``).
        """
        if not dma_capable(part.host, host_np):
            return None
        if to_host and dev_np is not None and self.config.pool_rows and layer_major(part.host):
            pitch = pool_pitch(part)
            if pitch is not None and pool_row_bytes(part.host, host_np, dev_np) >= self.config.pool_rows:
                pool = pool_placement(part.host, pitch, part.device_layers[0].shape[0])
                return PoolPlan(part.host, pool, host_np, dev_np, part.layer_num, self.config.staging_bytes,
                                ramp=RAMP_MIN_BYTES)
        runs = runs or Runs.of(host_np)
        layers = part.layer_num if to_host else (self.load_group(part, host_np, runs) if whole else 1)
        # The bound (run lengths only) decides, so nothing is planned yet: the plan is
        # worked out a chunk at a time as the chunks are queued (ChunkedPlan). The bound
        # leaves out the runs chunk edges split, a few per transfer.
        if mean_copy_bound(part.host, host_np, layers, self.config.staging_bytes, runs=runs) < self.config.kernel_below:
            return None
        # Chunks of whole layers for one run of slots (allocator slots). With scattered pages they
        # make a pitched call per run and chunk of 1-3 layers (thousands of runtime calls), far
        # slower than chunks of slots.
        if (to_host and runs.single and layer_major(part.host)
                and host_np.size * part.item_bytes <= self.config.staging_bytes):
            return LayerChunkedPlan(part.host, host_np, self.config.staging_bytes, ramp=RAMP_MIN_BYTES, runs=runs)
        if to_host:
            return ChunkedPlan(part.host, host_np, layers, self.config.staging_bytes, ramp=RAMP_MIN_BYTES, runs=runs)
        return grouped_plan(part.host, host_np, layers, self.config.staging_bytes, chunked=True, runs=runs)

    def load_group(self, part: TransferPart, host_np: np.ndarray, runs: Runs | None = None) -> int:
        """Layers per copy for loading ``host_np``.

        Decided once per placement, device, size class and run-length class
        by timing trial loads (:meth:`trial_rate`), then reused.
        """
        if self.config.load_group:
            return min(self.config.load_group, part.layer_num)
        key = (part.host, part.device_layers[0].device.index, int(host_np.size).bit_length(), run_class(host_np, runs))
        with self._rate_lock:
            if key not in self._groups:
                if narrow_layer_rows(part.host):
                    # Trials share the copy engines with whatever is queued: let that finish.
                    torch.cuda.synchronize(part.device_layers[0].device)
                self._groups[key] = choose_group(part.host, lambda g: self.trial_rate(key, part, host_np, g),
                                                 self.config.group_target)
            return self._groups[key]

    @property
    def group_rates(self) -> dict[tuple, float]:
        """Trial load speeds measured so far: ``{(layout key..., layers per copy): GB/s}``."""
        return dict(self._rates)

    def trial_rate(self, key: tuple, part: TransferPart, host_np: np.ndarray, group: int,
                   payload: int | None = None) -> float:
        """GB/s of a per-layer load of the first slots of ``host_np`` (up to ``payload`` bytes,
        default four staging chunks), ``group`` layers per copy, into scratch device memory.

        Four chunks keep the copy pipeline mostly in its steady state (two ranked groups
        wrongly); the best of three timed loads, so one disturbed sample does not pick the
        group.

        Runs on its own stream and staging (a throwaway backend: ``buffers``
        staging buffers while it runs), so it neither touches the device pool
        nor waits behind queued transfers (:meth:`load_group` first waits
        for the device's queued work, as the trials share its copy engines).
        Blocks the host for the trials: tens of milliseconds, once per layout key.
        """
        pl, layers = part.host, part.layer_num
        payload = payload or 4 * self.config.staging_bytes
        per_slot = layers * pl.item_bytes
        n = min(host_np.size, max(pl.page_size, payload // per_slot // pl.page_size * pl.page_size))
        device = part.device_layers[0].device
        # Every layer scatters into the same scratch rows: the bytes are thrown away, and
        # the trial needs 1/layers of the payload in device memory, not all of it.
        stream = streams.fresh(device, 0, (torch.cuda.current_stream(device),))
        with torch.cuda.stream(stream):  # made on the stream that reads them: no order to miss
            scratch = torch.empty((n, pl.item_bytes), dtype=torch.uint8, device=device)
            d = torch.arange(n, dtype=torch.int64, device=device)
        trial_part = TransferPart(part.name, part.host_raw, pl, (scratch,) * layers)
        trial = DMABackend(replace(self.config, load_group=group, kernel_below=0), self.fallback)
        h = torch.from_numpy(np.ascontiguousarray(host_np[:n]))

        def load():
            run = trial.prepare([trial_part], h, d, False)
            for layer in range(layers):
                run(layer)
        with torch.cuda.stream(stream):
            rate = n * per_slot / event_seconds(load, reps=3, best=True) / 1e9
        self._rates[key + (group,)] = rate
        return rate

    def backup(self, parts, host_idx, dev_idx, block_quota=None):
        self.run(parts, host_idx, dev_idx, None)

    def load(self, parts, host_idx, dev_idx, layer):
        self.run(parts, host_idx, dev_idx, layer)

    def run(self, parts, host_idx, dev_idx, layer) -> None:
        # One layer on its own: no group, whatever the layout.
        self.prepare(parts, host_idx, dev_idx, layer is None, whole=False)(layer)

    def prepare(self, parts, host_idx, dev_idx, to_host: bool, block_quota: int | None = None, whole: bool = True,
                host_np: np.ndarray | None = None, dev_np: np.ndarray | None = None):
        """Plans made once; returns ``run(layer)`` (``layer=None`` for a backup).

        ``whole``: a load's ``run`` will be called for every layer, in order,
        so adjacent layers may be copied together. Parts whose host slots do
        not suit DMA (:meth:`plan_part`) go through the kernel backend.
        ``host_np``: ``host_idx`` already read to the host, if the caller has it; ``dev_np``
        the same for ``dev_idx`` (a backup may then copy straight from the pool).
        """
        for part in parts:
            check_mapped(part)
        host_np = host_numpy(host_idx) if host_np is None else host_np
        s_np, runs, order = self.in_host_order(parts, host_np, Runs.of(host_np))
        plans = self.plan_parts(parts, s_np, runs, order, to_host, whole, dev_np)
        return self.runner_for(parts, plans, order, s_np, host_idx, dev_idx, block_quota, lazy_dev=not to_host,
                               kernel_np=(host_np, numpy_if_host(dev_idx, dev_np)), to_host=to_host)

    def plan_parts(self, parts, s_np: np.ndarray, runs: Runs, order: np.ndarray | None, to_host: bool,
                   whole: bool = True, dev_np: np.ndarray | None = None) -> list:
        """:meth:`plan_part` of every part, for ``(s_np, runs, order) = in_host_order(...)``;
        ``dev_np``, the device slots in the caller's order, are permuted as the host slots."""
        if dev_np is not None and order is not None and to_host:
            dev_np = dev_np[order]
        return [self.plan_part(p, s_np, to_host, whole, runs, dev_np if to_host else None) for p in parts]

    def in_host_order(self, parts, host_np: np.ndarray, runs: Runs) -> tuple[np.ndarray, Runs, np.ndarray | None]:
        """``(slots, their runs, order)`` to plan with: ``host_np`` in host-slot order
        (:class:`~kvtier.transfer.slots.HostOrder`; ``order`` the permutation) where ``DMAConfig.sort_slots``
        and, as given, some part's copies would average under ``DMAConfig.sort_below`` bytes;
        else ``host_np``, ``runs`` (:meth:`Runs.of` ``host_np``) and None."""
        if not self.config.sort_slots or runs.single:
            return host_np, runs, None
        small = any(mean_copy_bound(p.host, host_np, p.layer_num, self.config.staging_bytes, runs=runs)
                    < self.config.sort_below for p in parts)
        o = HostOrder.of(host_np, parts[0].host.page_size) if small else None
        return (host_np, runs, None) if o is None else (o.slots, Runs.of(o.slots), o.order)

    def runner_for(self, parts, plans, order: np.ndarray | None, s_np: np.ndarray, host_idx: torch.Tensor,
                   dev_idx: torch.Tensor, block_quota: int | None = None, lazy_dev: bool = False,
                   kernel_np: tuple | None = None, to_host: bool = False):
        """:meth:`runner` for ``plans`` made with ``(s_np, _, order) = in_host_order(...)``: DMA
        parts move the slot pairs in that order, kernel parts get the caller's (and sort a
        backup's themselves, :attr:`.KernelConfig.host_order`). The device slots are permuted
        only here, and only when some part goes by DMA."""
        if order is None or not any(staged(p) for p in plans):  # pool plans carry their own slots
            return self.runner(parts, plans, host_idx, dev_idx, block_quota, lazy_dev=lazy_dev, kernel_np=kernel_np,
                               to_host=to_host)
        sel = torch.from_numpy(order)
        dev = dev_idx.to(torch.int64)
        dev = dev[on_device(sel, dev.device)] if dev.device.type == "cuda" else dev[sel]
        return self.runner(parts, plans, torch.from_numpy(s_np), dev, block_quota, kernel_idx=(host_idx, dev_idx),
                           lazy_dev=lazy_dev, kernel_np=kernel_np, to_host=to_host)

    def runner(self, parts, plans, host_idx, dev_idx, block_quota=None, kernel_idx=None, lazy_dev: bool = False,
               kernel_np: tuple | None = None, to_host: bool = False) -> DMARun:
        """``run(layer)`` for these plans (None: that part goes through the kernel): a
        :class:`~.issue.DMARun`, whose docstring says what the arguments mean."""
        return DMARun(self, parts, plans, host_idx, dev_idx, block_quota, kernel_idx, lazy_dev, kernel_np, to_host)


def pool_pitch(part: TransferPart) -> int | None:
    """Bytes from one of ``part``'s device layers to the next where they are one stack: each
    contiguous, equally spaced, none overlapping the next (as :class:`~kvtier.device_pool.KVPool`
    makes them); else None (a backup then goes through staging)."""
    layers = part.device_layers
    if not all(t.is_contiguous() for t in layers):
        return None
    nbytes = layers[0].numel() * layers[0].element_size()
    if len(layers) == 1:
        return nbytes
    ptrs = [t.data_ptr() for t in layers]
    pitch = ptrs[1] - ptrs[0]
    if pitch < nbytes or any(b - a != pitch for a, b in zip(ptrs, ptrs[1:])):
        return None
    return pitch
