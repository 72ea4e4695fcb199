"""Queueing a planned DMA transfer (:class:`DMARun`): chunk by chunk, between staging and the host.

A backup gathers chunk ``k`` into a staging buffer on a side stream while the
copy engine drains chunk ``k-1`` to the host on the caller's stream; a load
runs the other way round. Many 1-D copies of a chunk go in one
``cudaMemcpyBatchAsync`` call (:func:`issue_copies`). Drains let other
streams' copies through a long transfer (:func:`drains_at`).
"""

from __future__ import annotations

import numpy as np
import torch

from .. import streams
from ..base import TransferPart, between_chunks
from ..cuda_common import on_device
from ..cudart import has_batch, memcpy1d, memcpy2d, memcpy_batch
from ..triton_kernels import copy_items
from .chunked import ChunkedPlan, GroupedPlan, PoolPlan, staged
from .plan import MAX_PITCH, DMAPlan


class ChunkIssue:
    """The copy-issuing half of :class:`~.backend.DMABackend`: it queues a planned part's
    chunks. Uses the backend's ``config``, ``tables`` (per-part pointer tables), ``ring()``
    (staging per device and direction) and ``_drain_after``."""

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
            # head (``first`` > 0) do not join again: that would wait for the head's copies and
            # leave the copy engine idle before the next gather.
            if (to_host and first == 0) or (not to_host and join):
                ring.side.wait_stream(cur)
            try:
                if to_host:
                    d.record_stream(ring.side)
                    # Only the gathers use the current stream (every copy and event names its
                    # stream): entering the side stream once, not per chunk, saves host time.
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
            issue_copies(tall, flat, host_base, slot.buf.data_ptr(), True, cur.cuda_stream, self.config.batch_min)
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
            issue_copies(tall, flat, host_base, pool, True, cur.cuda_stream, self.config.batch_min)
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
            issue_copies(tall, flat, host_base, slot.buf.data_ptr(), False, ring.side.cuda_stream, self.config.batch_min)
            slot.ready.record(ring.side)
            if d is None:
                d = d_of()
            cur.wait_event(slot.ready)
            copy_items(p.staging, slot.buf, part.device_layers, ptrs, None, d, j0, m, layer, n_layers,
                       False, self.config.gather_blocks, wp)
            slot.free.record(cur)


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


def issue_copies(tall: np.ndarray, flat: np.ndarray, host_base: int, stg_base: int, to_host: bool, stream: int,
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


class DMARun:
    """A transfer whose parts are planned (a plan each, or None: that part goes through the
    backend's zero-copy ``fallback``). Call it as ``run(layer)``: ``layer=None`` queues a
    whole backup, a layer number queues that layer of a load (every layer, in order, for a
    load planned ``whole``). :meth:`head` queues a backup's first chunks ahead of ``run(None)``.

    Kernel parts move the slot pairs ``kernel_idx`` (default ``host_idx, dev_idx``: the
    caller's order); ``kernel_np``: those pairs in numpy where the caller has them, so whole
    pages move a page per row and a backup's pairs go in host-slot order
    (:meth:`.KernelBackend.moves`).

    ``lazy_dev`` (loads): the device slots reach the device when a DMA part first needs them,
    after its first chunk's copies are queued, so the copy engine starts without waiting for
    the index copy. Only for loads, whose every layer is queued before ``load()`` returns: a
    backup's rest may be queued later, by the engine's thread, and must not read the
    caller's index tensor then.

    Holds every tensor it reads until it is dropped (the engine keeps it in the handle).
    """

    def __init__(self, backend, parts, plans, host_idx, dev_idx, block_quota=None, kernel_idx=None,
                 lazy_dev: bool = False, kernel_np: tuple | None = None, to_host: bool = False):
        self.backend, self.parts, self.plans = backend, parts, plans
        self.device = parts[0].device_layers[0].device
        self._dev_idx = dev_idx
        self._dev: torch.Tensor | None = None
        if not lazy_dev and any(staged(p) for p in plans):
            self.d_of()
        self._kernel_moves(kernel_idx or (host_idx, dev_idx), kernel_np, to_host)
        self.blocks = backend.fallback._blocks(block_quota)
        config = backend.config
        # A load's layers between drains, from the bytes one layer of it moves by DMA.
        self.every = drain_every(config.load_drain, config.load_drain_bytes,
                                 host_idx.numel() * sum(part.item_bytes for part, p in zip(parts, plans) if p is not None))
        self.joined = False  # a load's copy stream joins the caller's stream once per transfer
        if any(isinstance(p, GroupedPlan) for p in plans):
            backend.last_groups = [p.group if isinstance(p, GroupedPlan) else 1 for p in plans]
        # A backup's first chunks queued ahead by head(): (part index, chunks), so run() skips them.
        self.ahead: tuple[int, int] | None = None
        # A backup's zero-copy parts, where others go by DMA, run beside those parts' copies
        # (DMAConfig.kernel_aside): queued once, by head() or run(None), on a stream of their
        # own; the caller's stream waits for it once the DMA parts are queued (or queueing failed).
        self.aside = [] if config.kernel_aside and self.h is not None and any(p is not None for p in plans) else None

    def d_of(self) -> torch.Tensor:
        """The device slots as int64 on the device, copied there on first use."""
        if self._dev is None:
            self._dev = on_device(self._dev_idx, self.device)
        return self._dev

    def _kernel_moves(self, kernel_idx, kernel_np, to_host: bool) -> None:
        """``self.kernel``: part index -> (part, host slots, device slots) as the kernel moves it."""
        k_h, k_d = kernel_idx
        plans = self.plans
        self.h = on_device(k_h, self.device) if any(p is None for p in plans) else None
        self.d_kernel = None
        self.kernel = {}
        if self.h is None:
            return
        self.d_kernel = on_device(k_d, self.device) if k_d is not self._dev_idx else self.d_of()
        ks = [k for k, p in enumerate(plans) if p is None]
        moves = self.backend.fallback.moves([self.parts[k] for k in ks], self.h, self.d_kernel,
                                            *(kernel_np or (None, None)), to_host=to_host)
        self.kernel = dict(zip(ks, moves))

    def _queue_aside(self) -> None:
        """Queue the zero-copy parts of a backup on a stream of their own (once)."""
        if self.aside is None or self.aside:
            return
        cur = torch.cuda.current_stream(self.device)
        ks = self.backend.ring(self.device, True).aside_stream(cur)
        ks.wait_stream(cur)
        # The kernel reads these on ks: the given slots and any it made of them (page
        # numbers, host order) were allocated on the caller's stream.
        held = (self.h, self.d_kernel, *(t for m in self.kernel.values() for t in m[1:]))
        for t in {id(x): x for x in held}.values():
            t.record_stream(ks)
        used = 0
        with torch.cuda.stream(ks):
            for move in self.kernel.values():
                used = max(used, self.backend.fallback.copy_part(*move, None, self.blocks))
        self.aside.extend((ks, used))

    def _join_aside(self) -> None:
        if self.aside:
            torch.cuda.current_stream(self.device).wait_stream(self.aside[0])

    def __call__(self, layer: int | None) -> None:
        beside = self.aside is not None and layer is None
        try:
            if beside:
                self._queue_aside()
            used = self.aside[1] if beside else 0
            for k, (part, p) in enumerate(zip(self.parts, self.plans)):
                if p is None:
                    if not beside:
                        used = max(used, self.backend.fallback.copy_part(*self.kernel[k], layer, self.blocks))
                    continue
                self._queue_part(k, part, p, layer)
                if staged(p):  # copies straight from the pool use no SMs
                    used = max(used, self.backend.config.gather_blocks)
            self.backend.last_blocks = used
        finally:
            if beside:
                self._join_aside()

    def _queue_part(self, k: int, part, p, layer: int | None) -> None:
        """Queue DMA part ``k``: a whole backup (less the chunks :meth:`head` queued), or the
        group of a load's layers that starts at ``layer`` (nothing where ``layer`` is inside
        a group: it moved with the group's first layer)."""
        if layer is None:
            first = self.ahead[1] if self.ahead and self.ahead[0] == k else 0
            self.backend.run_part(part, p, self.d_of, None, first=first)
        elif n := p.issue_at(layer):
            self.backend.run_part(part, p.plans[n], self.d_of, layer, join=not self.joined, n_layers=n,
                                  drain=self.every)
            self.joined = True

    def head(self) -> None:
        """Queue a backup's first chunks now, up to ``DMAConfig.head_bytes`` (at least one);
        ``run(None)`` then queues the rest. The engine calls it in the caller's thread, so the
        copy engine starts without waiting for the hand-off to its background thread and has
        the ramp's chunks to copy while that thread starts. Zero-copy parts beside the copies
        start here too."""
        try:
            self._queue_aside()
            for k, (part, p) in enumerate(zip(self.parts, self.plans)):
                if p is not None and not isinstance(p, GroupedPlan) and p.n_chunks and self.ahead is None:
                    stop = head_chunks(p, part.layer_num, part.item_bytes, self.backend.config.head_bytes)
                    self.backend.run_part(part, p, self.d_of, None, stop=stop)
                    self.ahead = (k, stop)
                    return
        except BaseException:
            self._join_aside()  # run(None), which would, is not called after a failed head
            raise
