"""The transfer engine: asynchronous backups and layer-by-layer loads.

The engine owns the order of transfers; backends only copy bytes. Every
operation returns a handle that says when it is complete:

- :class:`TransferHandle` for a backup (device -> host, all layers);
- :class:`LayerLoad` for a load (host -> device), with one completion per
  layer, so attention for layer ``i`` waits for layer ``i`` only.

On the CPU every operation completes before it returns and the handles are
already done. On CUDA (see :mod:`kvtier.transfer.gpu`) backups and loads
run on their own streams, ordered after the compute that produced the data.
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
from dataclasses import dataclass, field

import numpy as np
import torch

from . import streams
from .backlog import Backlog
from .base import Backend, chunk_hook, get_backend
from ..validate import require_index, require_positive_int


# The longest the background thread waits, in all, for a load being prepared (from the
# load's start; it waits between a backup's chunks, and a 128 MiB chunk takes the copy engine
# ~2.4 ms on an H200). A load's first layer is queued in 2-3 ms alone (H200 run 22); a load
# whose first call queues every copy (DMA, single tokens on page_first: ~85 ms) shares the
# host after that: waiting the whole time held DMA pairs there to 1.07-1.21x of one way,
# against 1.42-1.48x not waiting (run 127, probe_pair_mix_h200_run127.json). Loads whose first
# call takes 10-18 ms (DMA, single tokens on allocator slots, page_first) lost by it: their
# pairs ran 0.02-0.08x lower than with the wait at every chunk in run 132, but in the A/B of
# run 133 (probe_pair_mix_h200_run133.json) 5 ms was within 0.01x of 20 ms there and the best
# of 5, 20 and 1000 ms, and of waiting only while the backup's earlier chunks were still on the
# device, on all four cases (allocator and scattered slots, MHA and MLA page_first).
GIVE_WAY_S = 0.005


class TransferHandle:
    """Completion of one backup (or any all-at-once transfer).

    Holds every tensor the transfer reads (index tensors, their device
    copies) until it is complete, so none is freed or reused under it.
    ``queued``: set when a background thread queues the transfer's copies;
    the event is recorded (after them) once it is done, and an error the
    thread hit is raised by ``done``, ``wait`` and ``synchronize``.
    ``pump(queued, if_stalled=False)``: queues, in the calling thread, whatever is still
    pending up to this transfer (:class:`~.backlog.Backlog`); ``wait`` and ``synchronize``
    call it, and ``done`` when the background thread has stalled, so the transfer never
    waits long for that thread to get the GIL.
    """

    def __init__(self, nbytes: int = 0, event=None, started: float | None = None, keep=(),
                 queued: Future | None = None, pump=None):
        self.nbytes = nbytes
        self._event = event
        self._keep = keep
        self._queued = queued
        self._pump = pump
        self.started = time.perf_counter() if started is None else started
        self.finished_at: float | None = None if event is not None else self.started

    def _await_queued(self, raise_error: bool = True) -> None:
        """Block the host until every copy is queued (not until they have run), queueing
        what is still pending in this thread."""
        if self._queued is not None:
            if self._pump is not None and not self._queued.done():
                self._pump(self._queued)
            err = self._queued.exception()
            if err is not None and raise_error:
                raise err

    def _finished(self) -> bool:
        """Queued and complete on the device (whether the queueing failed or not); never raises."""
        if self._queued is not None and not self._queued.done():
            return False
        return self._event is None or self._event.query()

    def done(self) -> bool:
        """Whether every copy has run. While some are still to be queued and the background
        thread has queued nothing for a while (:data:`~.backlog.STALL_S`: the caller's thread
        keeps the GIL), queues them first: a few ms of host work at most."""
        if self._queued is not None and not self._queued.done():
            if self._pump is not None:
                self._pump(self._queued, if_stalled=True)
            if not self._queued.done():
                return False
        self._await_queued()
        if self._event is None or self._event.query():
            if self.finished_at is None:
                self.finished_at = time.perf_counter()
            self._keep = ()
            return True
        return False

    def wait(self, stream=None, raise_error: bool = True) -> None:
        """Make ``stream`` (default: the current one) wait for the transfer. Blocks the host
        only while a background thread is still queueing its copies (a few ms at most)."""
        self._await_queued(raise_error)
        if self._event is not None:
            (torch.cuda.current_stream() if stream is None else stream).wait_event(self._event)

    def synchronize(self) -> None:
        self._await_queued()
        if self._event is not None:
            self._event.synchronize()
        self.done()

    def settle(self) -> BaseException | None:
        """Block until whatever the transfer queued has run, and return the error that
        stopped its queueing (None if there was none); never raises. After a failure, the
        transfer's destination slots are safe to reuse once this returns."""
        self._await_queued(raise_error=False)
        if self._event is not None:
            self._event.synchronize()
        return self._queued.exception() if self._queued is not None else None


def _count(indices, name: str) -> int:
    """How many slots ``indices`` names (a 1-D tensor, array or sequence), for the byte count
    taken before the pool checks them in full."""
    shape = getattr(indices, "shape", None)
    if shape is not None and len(shape) == 1:
        return int(shape[0])
    if shape is None and isinstance(indices, (list, tuple, range)):
        return len(indices)
    raise ValueError(f"{name} must be a one-dimensional sequence of slots, got "
                     f"{type(indices).__name__}{'' if shape is None else f' of shape {tuple(shape)}'}")


class LayerLoad:
    """Completion of a layer-by-layer load: one event per layer."""

    def __init__(self, layer_num: int, nbytes: int = 0, events=None, keep=()):
        self.layer_num = layer_num
        self.nbytes = nbytes
        self._events = events  # None on the CPU: every layer is already there
        self._keep = keep      # tensors the load reads, held until it is done
        self.started = time.perf_counter()
        self.finished_at: float | None = None if events is not None else self.started

    def wait_layer(self, layer: int, stream=None) -> None:
        """Make ``stream`` (default: the current one) wait until ``layer`` is loaded.

        Does not block the host; work queued on ``stream`` afterwards sees the layer.
        """
        self._check_layer(layer)
        if self._events is None:
            return
        s = torch.cuda.current_stream() if stream is None else stream
        s.wait_event(self._events[layer])

    def layer_done(self, layer: int) -> bool:
        self._check_layer(layer)
        return self._events is None or self._events[layer].query()

    def _check_layer(self, layer) -> None:
        # A negative layer would index from the end on the GPU, a large one raise a bare
        # IndexError there, and on the CPU either answered "loaded".
        require_index("layer", layer, self.layer_num)

    def wait(self, stream=None, raise_error: bool = True) -> None:
        """Make ``stream`` wait for every layer (``raise_error``: as :meth:`TransferHandle.wait`).
        Through :meth:`wait_layer` and :meth:`layer_done`, so a subclass that overrides those
        (several loads seen as one) waits and finishes as they say."""
        self.wait_layer(self.layer_num - 1, stream)

    def _finished(self) -> bool:
        return self.layer_done(self.layer_num - 1)

    def done(self) -> bool:
        if self._finished():
            if self.finished_at is None:
                self.finished_at = time.perf_counter()
            self._keep = ()
            return True
        return False

    def synchronize(self) -> None:
        if self._events is not None:
            self._events[-1].synchronize()
        self.done()

    def settle(self) -> BaseException | None:
        """As :meth:`TransferHandle.settle`: a load's copies are all queued before
        ``load()`` returns (an error raises there), so this only waits."""
        self.synchronize()
        return None


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
        # Disjoint ranges first: np.isin over 32k slots costs the host ~1 ms (H200 timeline
        # probe), and transfers of different pages usually lie in different ranges.
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
    ``DMABackend(DMAConfig(load_drain=0))``. The engine never decides *what*
    to move; the cache controller does.

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
    background thread (in order, one backup after another). Queueing a 4 GiB backup
    takes the host 8-10 ms per part (H200, ``probe_host_timeline_h200_run21.json``):
    inline, a load issued right after it started only once that was done.
    That thread needs the GIL between its calls into CUDA; a caller's thread busy in
    Python lends it only every ``sys.getswitchinterval()``, so whatever is still pending
    is queued by the caller's thread when it waits for a backup (``wait``,
    ``synchronize``, a transfer ordered after it) or asks ``done()`` while that thread
    has queued nothing for 1 ms: poll ``done()`` from a busy loop (:mod:`.backlog`).
    ``False`` queues everything in the caller's thread before returning.
    """

    def __init__(self, host_pool, io_backend: str | Backend | None = None, *, block_quota: int | None = None,
                 background_backups: bool = True):
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
        self.backend = get_backend(io_backend, self.device)
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
        # Until the first layer's copies are queued, the background thread pauses
        # between its chunks: it held the GIL often enough to slow a load's
        # preparation from 2-3 ms to 7.5 ms (H200 run 22, probe_host_timeline).
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
            # thread ends with it: a strong one (engine -> backlog -> engine) kept a dropped engine,
            # and the host pool it moves, until the cyclic collector ran (H200 run 116: 34 GB
            # pools of earlier cases still held, and the next one refused).
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
