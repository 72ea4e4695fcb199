"""The transfer engine: asynchronous backups and layer-by-layer loads.

The engine owns the order of transfers; backends only copy bytes. Every
operation returns a handle that says when it is complete:

- :class:`TransferHandle` for a backup (device -> host, all layers);
- :class:`LayerLoad` for a load (host -> device), with one completion per
  layer, so attention for layer ``i`` waits for layer ``i`` only.

On the CPU every operation completes before it returns and the handles are
already done. On CUDA backups and loads run on their own streams, ordered after the compute that produced the data.
A backup's copies are queued by a background thread (``background_backups``),
so the caller, and a load it issues next, does not wait while the host queues
gigabytes of copies.
"""

from __future__ import annotations

import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from . import streams
from .backlog import Backlog
from .base import Backend, chunk_hook
from .factory import Backends
from .handles import LayerLoad, TransferHandle, _count
from ..validate import require_positive_int


# The longest the background thread waits, in all, for a load being prepared (from the load's
# start; a load's first layer is queued in a few ms): the best of 5, 20 and 1000 ms for
# backup + load pairs on an H200 (docs/performance.md).
GIVE_WAY_S = 0.005


@dataclass
class TransferStats:
    backups: int = 0
    loads: int = 0
    backup_bytes: int = 0
    load_bytes: int = 0



class _InFlight:
    """Slots an unfinished transfer touches, and the event that ends it.

    Its own copies of the slots: ``host``/``dev`` are often views of the caller's index
    tensors, which the caller may reuse as soon as the call returns, and a later transfer's
    order after this one must go by the slots this one moves, not by what they became."""

    def __init__(self, handle, host: np.ndarray, dev: np.ndarray, to_host: bool):
        host, dev = np.array(host, dtype=np.int64), np.array(dev, dtype=np.int64)
        self.handle, self.host, self.dev, self.to_host = handle, host, dev, to_host
        self.host_span, self.dev_span = _span(host), _span(dev)

    def overlaps(self, host: np.ndarray, dev: np.ndarray) -> bool:
        # Disjoint ranges first: np.isin over 32k slots costs the host about a millisecond,
        # and transfers of different pages usually lie in different ranges.
        return bool((_meet(self.host_span, _span(host)) and np.isin(host, self.host, kind="table").any())
                    or (_meet(self.dev_span, _span(dev)) and np.isin(dev, self.dev, kind="table").any()))


def _span(x: np.ndarray) -> tuple[int, int] | None:
    return (int(x.min()), int(x.max())) if x.size else None


def _meet(a, b) -> bool:
    return a is not None and b is not None and a[0] <= b[1] and b[0] <= a[1]


class TransferEngine:
    """Moves pages between one host pool and its device pool.

    ``io_backend``: ``direct`` (default on CPU), ``kernel``, ``dma`` or ``auto``
    (default on CUDA), or a backend built with its own configuration, e.g.
    ``DMABackend(DMAConfig(load_drain=0))``. ``backends``: the
    :class:`~kvtier.transfer.factory.Backends` a name is taken from (default: a
    set of the engine's own; pass one set to several engines to share what the
    backends measured). The engine never decides *what* to move; the cache
    controller does.

    On CUDA, backups run on one stream and loads on another (high priority),
    each ordered after the work queued so far on the caller's current stream.
    A transfer that touches a host or device slot of an unfinished transfer
    on the other stream waits for it. The caller must not reuse a slot a
    transfer touches before its handle is ``done()`` (or, on the GPU, before
    it made its stream wait on the handle: ``wait_layer`` / ``wait``).
    ``block_quota`` bounds the SMs a zero-copy transfer may occupy.

    ``background_backups`` (CUDA): a backup is checked, ordered and planned
    in the caller's thread (which also queues its first chunk when no earlier
    backup is still being queued), and its other copies are then queued by one
    background thread (in order, one backup after another): queueing a 4 GiB backup
    takes the host milliseconds per part, and a load issued right after it must not
    wait for that.
    That thread needs the GIL between its calls into CUDA; a caller's thread busy in
    Python lends it only every ``sys.getswitchinterval()``, so whatever is still pending
    is queued by the caller's thread when it waits for a backup (``wait``,
    ``synchronize``, a transfer ordered after it) or asks ``done()`` while that thread
    has queued nothing for 1 ms: poll ``done()`` from a busy loop (:mod:`.backlog`).
    ``False`` queues everything in the caller's thread before returning.
    """

    def __init__(self, host_pool, io_backend: str | Backend | None = None, *, block_quota: int | None = None,
                 background_backups: bool = True, backends: Backends | None = None):
        if not hasattr(host_pool, "transfer_parts") or not hasattr(host_pool, "device_pool"):
            raise TypeError(f"TransferEngine moves KV for a host pool (MHATokenToKVPoolHost, ...: it knows its "
                            f"device pool), got {type(host_pool).__name__}")
        self.host_pool = host_pool
        self.device_pool = host_pool.device_pool
        self.device = torch.device(getattr(self.device_pool, "device", "cpu"))
        if io_backend is None:
            io_backend = "auto" if self.device.type == "cuda" else "direct"
        if block_quota is not None:
            require_positive_int("block_quota", block_quota)
        if not isinstance(background_backups, bool):
            raise ValueError(f"background_backups must be True or False, got {background_backups!r}")
        if backends is not None and not isinstance(backends, Backends):
            raise TypeError(f"backends must be a kvtier.transfer.Backends, got {type(backends).__name__}")
        self.backends = Backends() if backends is None else backends
        self.backend = self.backends.get(io_backend, self.device)
        self.io_backend = io_backend
        self.block_quota = block_quota
        self.stats = TransferStats()
        self._inflight: list[_InFlight] = []
        self.background_backups = background_backups
        self._issuer: ThreadPoolExecutor | None = None
        self._backlog: Backlog | None = None  # backups still to be queued (background_backups)
        self._last_queued: Future | None = None  # the latest backup handed to the backlog
        self._loading = 0  # loads being prepared now: the background thread gives way to them
        self._give_way = threading.Condition()
        # How long the background thread waits, at most and in all, for a load being prepared
        # (0: it does not wait; the probe pair_mix times both), and until when it now does.
        self.give_way_s = GIVE_WAY_S
        self._give_way_until = 0.0
        if self.device.type == "cuda":
            lo, hi = torch.cuda.Stream.priority_range()
            self._priority = {True: lo, False: hi}
            streams.register(self)
            self.backup_stream = streams.fresh(self.device, lo)
            self.load_stream = streams.fresh(self.device, hi)

    @property
    def layer_num(self) -> int:
        return self.host_pool.layer_num

    def _nbytes(self, n_tokens: int, layers: int | None = None) -> int:
        per_layer = self.host_pool.spec.bytes_per_token_per_layer
        return n_tokens * per_layer * (self.layer_num if layers is None else layers)

    def backup(self, host_indices: torch.Tensor, device_indices: torch.Tensor) -> TransferHandle:
        """Copy device slots to host slots for every layer; the handle says when done."""
        n = self._nbytes(_count(host_indices, "host_indices"))
        if self.device.type != "cuda":
            self.host_pool.backup_from_device_all_layer(self.device_pool, host_indices, device_indices, self.io_backend)
            handle = TransferHandle(n)
        else:
            handle = self._cuda(host_indices, device_indices, True, n)
        self.stats.backups += 1
        self.stats.backup_bytes += n
        return handle

    def load(self, host_indices: torch.Tensor, device_indices: torch.Tensor) -> LayerLoad:
        """Copy host slots into device slots, layer by layer; wait per layer on the handle."""
        n = self._nbytes(_count(host_indices, "host_indices"))
        if self.device.type != "cuda":
            for layer in range(self.layer_num):
                self.host_pool.load_to_device_per_layer(self.device_pool, host_indices, device_indices, layer, self.io_backend)
            handle = LayerLoad(self.layer_num, n)
        else:
            handle = self._cuda(host_indices, device_indices, False, n)
        self.stats.loads += 1
        self.stats.load_bytes += n
        return handle

    def _cuda(self, host_indices, device_indices, to_host: bool, nbytes: int):
        parts = self.host_pool.transfer_parts()
        h, d, h_np, d_np = self.host_pool._check_indices(host_indices, device_indices, self.device_pool,
                                                         want_numpy=True, parts=parts)
        producer = torch.cuda.current_stream(self.device)
        stream = self._stream(to_host, producer)
        stream.wait_stream(producer)
        self._order_after_conflicts(stream, h_np, d_np, to_host)
        for t in (h, d):
            if t.device.type == "cuda":
                t.record_stream(stream)
        with torch.cuda.stream(stream):
            try:
                if to_host:
                    handle = self._queue_backup_call(stream, parts, h, d, h_np, d_np, nbytes)
                else:
                    handle = self._queue_load_call(stream, parts, h, d, h_np, d_np, nbytes)
            except BaseException:
                # Part of the transfer may be queued: once that has run, the caller may free or
                # reuse the slots (a cache gives the device pages back at once).
                stream.synchronize()
                raise
        self._inflight.append(_InFlight(handle, h_np, d_np, to_host))
        return handle

    def _queue_backup_call(self, stream, parts, h, d, h_np, d_np, nbytes: int) -> TransferHandle:
        """Queue a backup on ``stream`` (current): in this thread, or its first chunk here and
        the rest by the background thread. Errors from the thread reach the handle."""
        run = self._runner(parts, h, d, True, h_np, d_np)
        event = torch.cuda.Event()
        queued = None
        if self.background_backups:
            # The first chunk now, unless an earlier backup is still being queued (the
            # thread queues backups in order: a later one's chunk must not pass it).
            head = getattr(run, "head", None)
            if head is not None and (self._last_queued is None or self._last_queued.done()):
                queued = _queue_head(stream, head, event)
            if queued is None:
                queued = self._last_queued = self._started_backlog().add(
                    lambda: _queue_backup(stream, run, event))
        else:
            _queue_backup(stream, run, event)
        return TransferHandle(nbytes, event, keep=(h, d, run), queued=queued,
                              pump=self._backlog.pump if self._backlog is not None else None)

    def _queue_load_call(self, stream, parts, h, d, h_np, d_np, nbytes: int) -> LayerLoad:
        """Queue a load on ``stream`` (current), layer by layer, an event after each."""
        # Until the first layer's copies are queued, the background thread pauses between
        # its chunks: it holds the GIL often enough to slow a load's preparation severalfold.
        events = []
        with self._load_first():
            run = self._runner(parts, h, d, False, h_np, d_np)
            run(0)
        for layer in range(self.layer_num):
            if layer:
                run(layer)
            events.append(torch.cuda.Event())
            events[-1].record(stream)
        return LayerLoad(self.layer_num, nbytes, events, keep=(h, d, run))

    def kvtier_streams(self):
        return (getattr(self, "backup_stream", None), getattr(self, "load_stream", None))

    def _stream(self, to_host: bool, producer: torch.cuda.Stream) -> torch.cuda.Stream:
        """The backup or load stream, drawn again if it is the caller's (PyTorch pools its
        streams: :mod:`kvtier.transfer.streams`); a transfer on the caller's stream would
        run in turn with its compute."""
        streams.note_caller(producer)
        name = "backup_stream" if to_host else "load_stream"
        stream = streams.apart(getattr(self, name), self.device, self._priority[to_host], producer)
        setattr(self, name, stream)
        return stream

    @contextmanager
    def _load_first(self):
        """While a load is prepared and its first layer queued, the background thread waits
        between its chunks, for at most ``give_way_s`` from the load's start in all (so a
        backup never stalls, nor queues only in the gaps of a load that takes long)."""
        with self._give_way:
            self._loading += 1
            self._give_way_until = max(self._give_way_until, time.perf_counter() + self.give_way_s)
        try:
            yield
        finally:
            with self._give_way:
                self._loading -= 1
                self._give_way.notify_all()

    def _pause_for_loads(self) -> None:
        """Between two chunks of a backup, wait while a load is prepared (:meth:`_load_first`),
        until ``give_way_s`` after the load's start at most."""
        with self._give_way:
            while self._loading and (left := self._give_way_until - time.perf_counter()) > 0:
                self._give_way.wait(left)

    def _pump_in_thread(self, pump) -> None:
        """In the background thread: queue pending backups, giving way to loads being prepared
        (a pause that is not a stall: :meth:`Backlog.progress` after it too)."""
        def between():
            self._backlog.progress()
            self._pause_for_loads()
            self._backlog.progress()
        with chunk_hook(between):
            pump()

    def _started_backlog(self) -> Backlog:
        """The backlog of backups still to be queued, and its thread, made on first use."""
        if self._issuer is None:
            index = torch.cuda.current_device() if self.device.index is None else self.device.index
            self._issuer = ThreadPoolExecutor(1, thread_name_prefix="kvtier-backup",
                                              initializer=torch.cuda.set_device, initargs=(index,))
            # The backlog and the thread reach this engine through a weak reference, and the
            # thread ends with it: a strong one (engine -> backlog -> engine) would keep a dropped
            # engine, and the host pool it moves, until the cyclic collector ran.
            me, issuer = weakref.ref(self), self._issuer
            self._backlog = Backlog(lambda pump: issuer.submit(_pump_for, me, pump))
            weakref.finalize(self, issuer.shutdown, wait=False)
        return self._backlog

    def _runner(self, parts, h, d, to_host: bool, h_np: np.ndarray, d_np: np.ndarray):
        prepare = getattr(self.backend, "prepare", None)
        if prepare is not None:
            return prepare(parts, h, d, to_host, self.block_quota, host_np=h_np, dev_np=d_np)
        if to_host:
            return lambda layer: self.backend.backup(parts, h, d, self.block_quota)
        return lambda layer: self.backend.load(parts, h, d, layer)

    def _order_after_conflicts(self, stream, h_np, d_np, to_host: bool) -> None:
        """Make ``stream`` wait for unfinished transfers on the other stream that share a slot."""
        self._inflight = [f for f in self._inflight if not f.handle._finished()]
        for f in self._inflight:
            if f.to_host != to_host and f.overlaps(h_np, d_np):
                # A failed backup's event still follows whatever it queued: wait, do not raise.
                f.handle.wait(stream, raise_error=False)


def _pump_for(engine_ref, pump) -> None:
    """In the background thread: ``pump`` for the engine, if it is still there (else as is)."""
    engine = engine_ref()
    if engine is None:
        pump()
    else:
        engine._pump_in_thread(pump)


def _queue_head(stream, head, event) -> Future | None:
    """Queue a backup's first chunk in the caller's thread. None if that went well; else a
    failed future, with ``event`` recorded after whatever was queued, so the error reaches
    the handle as it would from the background thread."""
    try:
        head()
        return None
    except Exception as err:  # noqa: BLE001 - handed to the handle, raised by done/wait/synchronize
        event.record(stream)
        failed: Future = Future()
        failed.set_exception(err)
        return failed


def _queue_backup(stream, run, event) -> None:
    """Queue a backup's copies on ``stream``, then ``event`` after them (even if queueing fails,
    so a transfer ordered after this one waits for whatever was queued)."""
    with torch.cuda.stream(stream):
        try:
            run(None)
        finally:
            event.record(stream)
