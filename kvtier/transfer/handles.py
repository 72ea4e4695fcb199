"""Completion handles of the transfer engine: :class:`TransferHandle` for a backup (all
layers at once), :class:`LayerLoad` for a load (one completion per layer). On the CPU every
transfer completes before it returns and the handles are already done."""

from __future__ import annotations

import time
from concurrent.futures import Future

import torch

from ..validate import require_index


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
