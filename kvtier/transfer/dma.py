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
measured once per layout, size and run length by timing trial loads
(:meth:`DMABackend.load_group`), not guessed from the rows alone;
``DMAConfig.load_group`` overrides it (1 = strictly one layer at a time).

Small index tensors reach the device through a kernel, not the copy engine
(:func:`.kernel.on_device`): behind a load's queued host -> device copies,
an index copy would hold a backup up until the whole load had finished.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace

import numpy as np
import torch

from . import streams
from .base import Backend, TransferPart, between_chunks
from .cudart import has_batch, memcpy1d, memcpy2d, memcpy_batch
from .dma_plan import (MAX_PITCH, RAMP_MIN_BYTES, ChunkedPlan, DMAPlan, GroupedPlan, HostOrder, LayerChunkedPlan,
                       PoolPlan, Runs, choose_group, dma_capable, grouped_plan, layer_major, mean_copy_bound,
                       narrow_layer_rows, pool_placement, pool_row_bytes, run_class)
from .kernel import KernelBackend, PartTables, check_mapped, host_numpy, numpy_if_host, on_device
from .timing import event_seconds
from .triton_kernels import copy_items
from ..validate import require_positive_int

MiB = 1 << 20


@dataclass(frozen=True)
class DMAConfig:
    """How the DMA backend stages and queues copies.

    ``staging_bytes`` per buffer, ``buffers`` per direction (device memory:
    ``2 * buffers * staging_bytes`` at most). Fewer, larger chunks cost the
    host less to queue (H200, 4 GiB: 22 ms at 32 MiB, 10 ms at 128 MiB), which
    matters when a backup and a load are queued back to back; and a
    layer_first backup writes one run per layer per chunk, which the copy
    engine moved at 0.92x of its limit for MLA's 61 layers at 64 MiB (1.1 MB
    runs; bench run 11) and 0.96x at 128 MiB (``probe_host_issue_h200.json``).
    ``gather_blocks``: SMs per gather or scatter kernel; at 16 a scatter of
    1-2 KiB items ran at 66 GB/s, barely ahead of PCIe, at 48 at 160 GB/s
    (``bench/results/probe_host_issue_h200.json``); the kernels run in bursts
    between copies. ``load_group``: adjacent layers a load from a page-major
    layout copies at once; 0 measures the fewest whose load runs at
    ``group_target`` of the fastest trial (all layers at once, or a larger
    group that beat it), 1 keeps loads strictly layer by
    layer (finest overlap with the forward pass). ``batch_min``: a chunk with
    at least this many 1-D copies queues them in one batched call.
    ``kernel_below``: a part whose copies would average fewer bytes than
    this goes through the zero-copy kernel instead (a pitched copy counts
    once: its rows, when close, move at full speed; the average is bounded
    from the runs of consecutive host slots, so nothing is planned first). On an H200 batched 16
    KiB copies moved 8.8 GB/s host to device and 21 device to host, 2 KiB
    copies 2.6 and 5.4, 128 KiB copies 46-49; the kernel moved any row of
    256 B or more at 36-50 (``bench/results/probe_copy_paths_h200.json``).
    0 keeps every part on the copy engines. ``sort_slots``: move a transfer's
    slot pairs in host-slot order (:class:`~.dma_plan.HostOrder`; parts that go
    through the kernel sort a backup's pairs themselves, on the device,
    :attr:`.KernelConfig.host_order`, and keep a load's as given) where, as given, some part's
    copies would average fewer than ``sort_below`` bytes (the bound above).
    Small copies gain from it (scattered layer_first page-64 backups +0.05-0.10x,
    H200 run 25); copies of 1 MiB or more already run at the link's pace
    (``probe_copy_size_h200.json``), and MLA page_first page-64 scattered pages
    (4.5 MB copies) ran slower in that order: backups 0.87x against 0.925x as
    given, loads 0.90x against 0.95x (run 28, ``probe_slot_order_h200.json``).
    ``load_drain``: every this many layers a load's copies wait, on the device,
    for a one-element kernel queued on another stream after the copy before
    them, so the load's queue runs dry for a moment and host -> device copies
    other streams queued meanwhile go through (0: never). On an H200 a copy
    queued on another stream during a 32k DMA load, pinned or not, at any
    stream priority, waited for the whole load (80 ms); with drains every 4
    layers it landed 0.4-7.8 ms after it was issued (4 layers take 10 ms), and
    the load took 79.1-79.8 ms against 78.7-79.3 (a drain every layer:
    79.6-80.8). An engine that copies its step inputs that way got its 32k
    host hit in 86 ms, not 118 (``probe_copy_priority_h200*.json``,
    ``ttft_h200_*drain*``; runs 37-43).
    ``load_drain_bytes``: and no sooner than this many bytes of the load (all its parts that
    go by DMA) after the drain before. What bounds another stream's wait is the bytes queued
    between drains, not the layers; a drain costs the copy engine 0.02-0.05 ms (run 40), and
    a layer of an MLA pool (37.7 MB at 32k tokens) is a quarter of an MHA one's (128 MiB), so
    by layers alone a 61-layer MLA load drained 15 times to MHA's 7. 512 MiB keeps MHA's
    every 4 layers and drains a 32k MLA load every 15 (4 drains, not 15). 0: every
    ``load_drain`` layers, whatever their size.
    ``backup_drain``: the same for a backup's device -> host copies, every this
    many staging chunks (an engine reading its sampled tokens while a finished
    request's KV is written back). On an H200, without drains, a small read
    issued during a 32k DMA backup waited for the end of the part in flight:
    up to 37 ms for MHA (K then V, 40 ms each), 31 ms for MLA (one part, 43
    ms); with a drain every 4 chunks (128 MiB each), 0.3-8.2 ms at any point,
    and the backup took as long (79.3 and 43.3 ms). The DMA backup rows moved
    by a median of -0.003x; a drain every chunk got reads through in 2-2.5 ms
    but cost 0.01x one way and 0.04x with a load at once (runs 44-46,
    ``probe_output_*_h200*.json``, ``transfer_h200_dma_backupdrain*``).
    ``head_bytes``: a backup's first chunks, up to this many bytes (at least one
    chunk), are queued in the caller's thread before ``backup()`` returns; the
    engine's background thread queues the rest. With only the first (8 MiB,
    0.2 ms of copying) the copy engine then waited 0.9-1.1 ms for the thread's
    first chunk (H200 run 53). 96 MiB is the first four chunks of the ramp
    (about 2 ms of copying).
    ``kernel_aside``: a backup's parts that go through the zero-copy kernel (DSA's index-K
    pages at scattered page-64 slots) run on a stream of their own beside the other parts'
    copies, not on the copies' stream after them: a 32k DSA layer_first page-64 backup to
    scattered pages ran the index-K part 13.5 ms after its last copy (79.8 ms in all, H200 run
    83); beside them, 75.9 ms, and 0.775x against 0.757x in turn (run 84,
    ``probe_scattered_backup_h200_run84.json``). The kernel's 8 KiB rows then hold the copy
    engine to 11-13 GB/s while it runs.
    ``pool_rows``: a backup of a layer-major layout (layer_first) copies straight from the
    device pool to the host, with no staging and no gather kernel, so on no SMs at all
    (:class:`~.dma_plan.PoolPlan`), where its runs of slots consecutive on both sides average
    at least this many bytes a layer (page-64 pages: 72 KiB for MLA, 128 KiB for MHA's K or
    V); 0 (the default): always through staging. It needs the device slots on the host (the
    engine has them: it reads them for its checks). For an engine whose forward pass should
    keep every SM; not faster: each copy's rows are then as short as a page on both sides,
    and on an H200 32k page-64 backups ran, against staging in turn, at 0.842x against
    0.807x (MLA, scattered host pages), 0.885x against 0.882x (MHA), 0.734x against 0.768x
    (DSA), and on allocator slots, where staging makes the host rows a whole layer long,
    0.84-0.89x against 0.96-0.98x (run 89, ``probe_scattered_backup_h200_run89.json``).
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
        self.priority = priority
        self._tick = None  # (stream, flag, event) for drains on the copy (DMAConfig.load_drain)
        self.aside = None  # a backup's zero-copy parts, beside its copies (DMAConfig.kernel_aside)
        streams.register(self)
        self.side = streams.fresh(device, priority)
        self.slots = [_Slot() for _ in range(config.buffers)]
        self.next = 0
        self.pool_done = torch.cuda.Event()  # after the last chunk copied straight from the pool
        self.lock = threading.Lock()

    def kvtier_streams(self):
        return (getattr(self, "side", None), self._tick and self._tick[0], getattr(self, "aside", None))

    def aside_stream(self, *others: torch.cuda.Stream) -> torch.cuda.Stream:
        """The stream a backup's zero-copy parts run on, apart from the side stream and ``others``."""
        if self.aside is None:
            self.aside = streams.fresh(self.device, self.priority, (self.side,) + others)
        self.aside = streams.apart(self.aside, self.device, self.priority, self.side, *others)
        return self.aside

    def drain(self, after: str = "copy", copies=None, done: torch.cuda.Event | None = None) -> None:
        """Make the stream of this ring's copies wait before its next copy, so its queue runs
        dry for a moment and the copy engine takes copies other streams queued meanwhile.
        ``copies``: None for a load (copies on the side stream, each done at its slot's
        ``ready``), or a backup's stream (the caller's; each copy done at its slot's ``free``).
        ``after``: ``copy``, a one-element kernel on another stream queued after the last
        chunk's copy (0.02-0.05 ms a drain on an H200); ``scatter`` (loads), the last chunk's
        scatter (0.25-0.34 ms a drain, run 40); ``event``, the other stream only waits and
        records, with no kernel: no gap, the other copies still waited for the whole load
        (run 43). The last two are kept for ``bench/probes/copy_priority.py``.
        ``done``: an event recorded on ``copies`` after its last copy, for copies that use no
        staging slot (a backup straight from the device pool); default: the last slot's."""
        if done is None:
            last = self.slots[self.next - 1]  # the chunk queued last through this ring
            if last.free is None:  # nothing queued through it yet
                return
            if after == "scatter":
                self.side.wait_event(last.free)
                return
            copies = copies or self.side
            done = last.ready if copies is self.side else last.free
        if self._tick is None:
            self._tick = (None, torch.empty(1, device=self.device), torch.cuda.Event())
        if self._tick[0] is None or streams.clashes(self._tick[0], self.side, copies):
            self._tick = (streams.fresh(self.device, 0, (self.side, copies)),) + self._tick[1:]
        stream, flag, ev = self._tick
        stream.wait_event(done)  # its copy done
        if after == "copy":
            with torch.cuda.stream(stream):
                flag.fill_(0)
        ev.record(stream)
        copies.wait_event(ev)

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
    _drain_after = "copy"  # StagingRing.drain (the probe copy_priority times the others)

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
        # made a pitched call per run and chunk of 1-3 layers (thousands of runtime calls): an MLA
        # page-64 scattered backup ran at 0.57x (H200 run 26) where chunks of slots gave 0.79x.
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

        Four chunks keep the copy pipeline mostly in its steady state: with two
        (256 MiB at 128 MiB staging, H200 run 12) page_head trials ranked 8 layers
        per copy within 3% of 32, and the real load ran at 0.91x where 16 gave 0.96x.
        The best of three timed loads: with the median of two, one disturbed sample
        (6.9 GB/s beside 49.8 for the same geometry, H200 run 24) picked the group.

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
        (:class:`~.dma_plan.HostOrder`; ``order`` the permutation) where ``DMAConfig.sort_slots``
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
        if order is None or not any(_staged(p) for p in plans):  # pool plans carry their own slots
            return self.runner(parts, plans, host_idx, dev_idx, block_quota, lazy_dev=lazy_dev, kernel_np=kernel_np,
                               to_host=to_host)
        sel = torch.from_numpy(order)
        dev = dev_idx.to(torch.int64)
        dev = dev[on_device(sel, dev.device)] if dev.device.type == "cuda" else dev[sel]
        return self.runner(parts, plans, torch.from_numpy(s_np), dev, block_quota, kernel_idx=(host_idx, dev_idx),
                           lazy_dev=lazy_dev, kernel_np=kernel_np, to_host=to_host)

    def runner(self, parts, plans, host_idx, dev_idx, block_quota=None, kernel_idx=None, lazy_dev: bool = False,
               kernel_np: tuple | None = None, to_host: bool = False):
        """``run(layer)`` for these plans (None: that part goes through the kernel, with the
        slot pairs ``kernel_idx``, default ``host_idx, dev_idx``: the caller's order;
        ``kernel_np``: those pairs in numpy, if the caller has them, so whole pages move a
        page per row and a backup's (``to_host``) pairs in host-slot order,
        :meth:`.KernelBackend.moves`).

        ``lazy_dev`` (loads): the device slots reach the device when a DMA part first needs
        them, for its first scatter, after its first chunk's copies are queued; so the copy
        engine starts without waiting for the index copy (0.41 ms of host time in an H200
        transfer call, run 64; loads ran +0.29 GB/s faster with the slots already on the device,
        run 63). Only for loads, whose every layer is queued before ``load()`` returns: a
        backup's rest may be queued later, by the engine's thread, and must not read the
        caller's index tensor then.
        """
        device = parts[0].device_layers[0].device
        fetched: list[torch.Tensor] = []

        def d_of() -> torch.Tensor:
            if not fetched:
                fetched.append(on_device(dev_idx, device))
            return fetched[0]
        if not lazy_dev and any(_staged(p) for p in plans):
            d_of()
        k_h, k_d = kernel_idx or (host_idx, dev_idx)
        h = on_device(k_h, device) if any(p is None for p in plans) else None
        d_kernel = (on_device(k_d, device) if k_d is not dev_idx else d_of()) if h is not None else None
        kernel = {}  # part index: (part, host slots, device slots) as the kernel moves it
        if h is not None:
            ks = [k for k, p in enumerate(plans) if p is None]
            kernel = dict(zip(ks, self.fallback.moves([parts[k] for k in ks], h, d_kernel,
                                                      *(kernel_np or (None, None)), to_host=to_host)))
        blocks = self.fallback._blocks(block_quota)
        # A load's layers between drains, from the bytes one layer of it moves by DMA.
        every = drain_every(self.config.load_drain, self.config.load_drain_bytes,
                            host_idx.numel() * sum(part.item_bytes for part, p in zip(parts, plans) if p is not None))
        joined = [False]  # a load's copy stream joins the caller's stream once per transfer
        if any(isinstance(p, GroupedPlan) for p in plans):
            self.last_groups = [p.group if isinstance(p, GroupedPlan) else 1 for p in plans]
        # A backup's first chunks queued ahead by ``head``: (part index, chunks), so ``run``
        # skips them.
        ahead = [None]
        # A backup's zero-copy parts, where others go by DMA, run beside those parts' copies
        # (DMAConfig.kernel_aside): queued once, by head() or run(None), on a stream of their
        # own; the caller's stream waits for it once the DMA parts are queued (or queueing failed).
        aside = [] if self.config.kernel_aside and h is not None and any(p is not None for p in plans) else None

        def queue_aside() -> None:
            if aside is None or aside:
                return
            cur = torch.cuda.current_stream(device)
            ks = self.ring(device, True).aside_stream(cur)
            ks.wait_stream(cur)
            # The kernel reads these on ks: the given slots and any it made of them (page
            # numbers, host order) were allocated on the caller's stream.
            for t in {id(x): x for x in (h, d_kernel, *(t for m in kernel.values() for t in m[1:]))}.values():
                t.record_stream(ks)
            used = 0
            with torch.cuda.stream(ks):
                for move in kernel.values():
                    used = max(used, self.fallback.copy_part(*move, None, blocks))
            aside.extend((ks, used))

        def join_aside() -> None:
            if aside:
                torch.cuda.current_stream(device).wait_stream(aside[0])

        def run(layer):
            beside = aside is not None and layer is None
            try:
                if beside:
                    queue_aside()
                used = aside[1] if beside else 0
                for k, (part, p) in enumerate(zip(parts, plans)):
                    if p is None:
                        if not beside:
                            used = max(used, self.fallback.copy_part(*kernel[k], layer, blocks))
                        continue
                    if layer is None:
                        self.run_part(part, p, d_of, None, first=ahead[0][1] if ahead[0] and ahead[0][0] == k else 0)
                    elif n := p.issue_at(layer):  # 0: moved with its group's first layer
                        self.run_part(part, p.plans[n], d_of, layer, join=not joined[0], n_layers=n, drain=every)
                        joined[0] = True
                    if _staged(p):  # copies straight from the pool use no SMs
                        used = max(used, self.config.gather_blocks)
                self.last_blocks = used
            finally:
                if beside:
                    join_aside()

        def head() -> None:
            """Queue a backup's first chunks now, up to ``DMAConfig.head_bytes`` (at least one);
            ``run(None)`` then queues the rest. The engine calls it in the caller's thread, so
            the copy engine starts without waiting for the hand-off to its background thread,
            and has the ramp's chunks to copy while that thread starts: with the first chunk
            alone (8 MiB) it went idle 0.9-1.1 ms before the second (H200 run 53, 2.4% of a
            32k MLA backup, ``probe_backup_pace_h200_run53.json``). Zero-copy parts beside
            the copies start here too."""
            try:
                queue_aside()
                for k, (part, p) in enumerate(zip(parts, plans)):
                    if p is not None and not isinstance(p, GroupedPlan) and p.n_chunks and ahead[0] is None:
                        stop = head_chunks(p, part.layer_num, part.item_bytes, self.config.head_bytes)
                        self.run_part(part, p, d_of, None, stop=stop)
                        ahead[0] = (k, stop)
                        return
            except BaseException:
                join_aside()  # run(None), which would, is not called after a failed head
                raise
        run.head = head
        return run

    def run_part(self, part: TransferPart, p: DMAPlan | ChunkedPlan, d_of, layer: int | None, join: bool = True,
                 n_layers: int = 1, first: int = 0, stop: int | None = None, drain: int | None = None) -> None:
        """Queue one part: all layers (``layer=None``) or layers ``layer .. layer+n_layers-1``.
        A backup may be queued in pieces: chunks ``first`` up to ``stop`` (default: the last).
        ``d_of()``: the device slots, as an int64 tensor on the device (a load asks for them
        only once its first copies are queued). ``drain``: a load's layers between drains
        (:func:`drain_every`; default ``DMAConfig.load_drain``).

        Backup: gather on the side stream, copy on the caller's. Load: copies
        on the side stream, scatters on the caller's, so the copy engine runs
        ahead into free staging buffers while earlier chunks (and layers) are
        scattered; the side stream joins the caller's stream only on the
        first layer of a transfer (``join``), which carries the transfer's
        ordering after compute and after conflicting transfers.
        """
        to_host = layer is None
        device = part.device_layers[0].device
        ring = self.ring(device, to_host)
        cur = torch.cuda.current_stream(device)
        host_base = part.host_raw.data_ptr() + (0 if to_host else layer * part.host.layer_stride)
        if isinstance(p, PoolPlan):
            with ring.lock:
                self._pool_chunks(ring, cur, part, p, host_base, range(first, p.n_chunks if stop is None else stop))
            return
        d = d_of() if to_host else None
        ptrs = self.tables.get(part, device)
        with ring.lock:
            # The pool may hand out the caller's stream as the side stream: they would take turns.
            ring.side = streams.apart(ring.side, device, ring.priority, cur)
            # A backup's gathers join the caller's stream once, at its first chunk (that carries
            # the order after compute and after conflicting transfers). Chunks queued after a
            # head (``first`` > 0) do not join again: that waited for the head's copies, and the
            # first gather after them ran with the copy engine idle (0.28 ms, H200 run 54).
            if (to_host and first == 0) or (not to_host and join):
                ring.side.wait_stream(cur)
            try:
                if to_host:
                    d.record_stream(ring.side)
                    # Only the gathers use the current stream (every copy and event names its
                    # stream): entering the side stream once, not per chunk, saves the host
                    # ~25 us a chunk (H200 profile, bench/results/probe_host_profile_h200_run19*).
                    with torch.cuda.stream(ring.side):
                        self._backup_chunks(ring, cur, part, p, ptrs, d, host_base,
                                            range(first, p.n_chunks if stop is None else stop))
                else:
                    self._load_chunks(ring, cur, part, p, ptrs, d_of, host_base, layer, n_layers,
                                      self.config.load_drain if drain is None else drain)
            except BaseException:
                # A chunk failed part way: copies into (or out of) a staging buffer may be queued
                # with no event after them, and a later take() could free that buffer under them.
                ring.side.synchronize()
                cur.synchronize()
                raise

    def _backup_chunks(self, ring, cur, part, p, ptrs, d, host_base, chunks: range) -> None:
        """Gather each of ``chunks`` on the side stream (current here), then copy it to the host on
        ``cur``. The gather needs no copies: it runs while the host plans the chunk's."""
        wp = None  # the same for every staging buffer (all 256-byte aligned): worked out once
        k = self.config.backup_drain
        for i in chunks:
            j0, m = p.items(i)
            l0, nl = p.layer_range(i)
            if drains_at(i, 1, k):  # before take: the ring's last slot is the chunk before
                ring.drain("copy", cur)
            slot = ring.take(p.staging_bytes)
            wp = wp or self.tables.words(part, p.staging, slot.buf)
            ring.side.wait_event(slot.free)
            copy_items(p.staging, slot.buf, part.device_layers, ptrs, None, d, j0, m, l0, nl or part.layer_num,
                       True, self.config.gather_blocks, wp)
            slot.ready.record(ring.side)
            tall, flat = p.calls(i)
            cur.wait_event(slot.ready)
            _issue(tall, flat, host_base, slot.buf.data_ptr(), True, cur.cuda_stream, self.config.batch_min)
            slot.free.record(cur)
            between_chunks()

    def _pool_chunks(self, ring, cur, part, p: PoolPlan, host_base: int, chunks: range) -> None:
        """Copy each of ``chunks`` straight from the device pool to the host on ``cur``: no
        staging, no gather (``cur`` is ordered after the compute that wrote the pool)."""
        pool = part.device_layers[0].data_ptr()
        k = self.config.backup_drain
        for i in chunks:
            if drains_at(i, 1, k):
                ring.drain("copy", cur, done=ring.pool_done)
            tall, flat = p.calls(i)
            _issue(tall, flat, host_base, pool, True, cur.cuda_stream, self.config.batch_min)
            if k:
                ring.pool_done.record(cur)
            between_chunks()

    def _load_chunks(self, ring, cur, part, p, ptrs, d_of, host_base, layer, n_layers, drain: int) -> None:
        """Copy each chunk from the host on the side stream, then scatter it on ``cur``. The
        device slots (``d_of()``, on ``cur``) are asked for after the first chunk's copies are
        queued, and before ``cur`` waits for them, so their copy runs beside those copies."""
        wp = d = None
        if drains_at(layer, n_layers, drain):
            ring.drain(self._drain_after)
        for i in range(p.n_chunks):
            j0, m = p.items(i)
            slot = ring.take(p.staging_bytes)
            wp = wp or self.tables.words(part, p.staging, slot.buf)
            tall, flat = p.calls(i)
            ring.side.wait_event(slot.free)
            _issue(tall, flat, host_base, slot.buf.data_ptr(), False, ring.side.cuda_stream, self.config.batch_min)
            slot.ready.record(ring.side)
            if d is None:
                d = d_of()
            cur.wait_event(slot.ready)
            copy_items(p.staging, slot.buf, part.device_layers, ptrs, None, d, j0, m, layer, n_layers,
                       False, self.config.gather_blocks, wp)
            slot.free.record(cur)


def _staged(p) -> bool:
    """Whether plan ``p`` moves its part through staging (gathers or scatters on the device)."""
    return p is not None and not isinstance(p, PoolPlan)


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


def head_chunks(p, layer_num: int, item_bytes: int, budget: int) -> int:
    """How many of backup plan ``p``'s first chunks it takes to hold ``budget`` bytes: at
    least one, at most all. A chunk moves its items over its layers (all ``layer_num`` where
    :meth:`layer_range` says None), ``item_bytes`` per item and layer."""
    n = total = 0
    while n < p.n_chunks and (n == 0 or total < budget):
        m = p.items(n)[1]
        nl = p.layer_range(n)[1]
        total += m * (layer_num if nl is None else nl) * item_bytes
        n += 1
    return n


def drain_every(layers: int, min_bytes: int, layer_bytes: int) -> int:
    """A load's layers between drains: ``layers`` (``DMAConfig.load_drain``; 0: never), or as
    many more as bring them to ``min_bytes`` (``load_drain_bytes``) at ``layer_bytes`` a layer."""
    if layers <= 0:
        return 0
    return max(layers, -(-min_bytes // max(layer_bytes, 1)))


def drains_at(first: int, count: int, every: int) -> bool:
    """Whether the copies of items ``first .. first + count - 1`` of a transfer (a load's layers,
    a group of them at once) wait for a drain first: they hold a multiple of ``every`` (0:
    never), and are not the transfer's first (nothing of it is queued before them)."""
    return every > 0 and first > 0 and (first + count - 1) // every * every >= first


def _issue(tall: np.ndarray, flat: np.ndarray, host_base: int, stg_base: int, to_host: bool, stream: int,
           batch_min: int = 8) -> None:
    """Queue a chunk's copies between staging and host on ``stream`` (:meth:`DMAPlan.calls`).

    Pitched rows ``(host_off, stg_off, width, height, host_pitch, stg_pitch)`` go
    one ``cudaMemcpy2DAsync`` each; 1-D copies ``(host_off, stg_off, width)`` go
    in one batched call when there are ``batch_min`` or more and the runtime has it,
    else one call each: ``cudaMemcpy2DAsync`` of one row, or ``cudaMemcpyAsync``
    past the largest pitch a 2-D call takes.
    """
    for h, st, w, height, hp, sp in tall.tolist():
        if to_host:
            memcpy2d(host_base + h, hp, stg_base + st, sp, w, height, stream)
        else:
            memcpy2d(stg_base + st, sp, host_base + h, hp, w, height, stream)
    if not len(flat):
        return
    host = flat[:, 0].astype(np.uint64) + np.uint64(host_base)
    stg = flat[:, 1].astype(np.uint64) + np.uint64(stg_base)
    dst, src = (host, stg) if to_host else (stg, host)
    if len(flat) >= batch_min and stream != 0 and has_batch():
        memcpy_batch(dst, src, flat[:, 2].astype(np.uint64), stream)
        return
    for a, b, w in zip(dst.tolist(), src.tolist(), flat[:, 2].tolist()):
        if w > MAX_PITCH:  # a 2-D call refuses a pitch past the device's (staging chunks of 2 GiB+)
            memcpy1d(a, b, w, stream)
        else:
            memcpy2d(a, w, b, w, w, 1, stream)
