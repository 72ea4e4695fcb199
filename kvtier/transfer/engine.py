"""The transfer engine: asynchronous backups and layer-by-layer loads.

The engine owns the order of transfers; backends only copy bytes. Every
operation returns a handle that says when it is complete:

- :class:`TransferHandle` for a backup (device -> host, all layers);
- :class:`LayerLoad` for a load (host -> device), with one completion per
  layer, so attention for layer ``i`` waits for layer ``i`` only.

On the CPU every operation completes before it returns and the handles are
already done. On CUDA (see :mod:`kvtier.transfer.gpu`) backups and loads
run on their own streams, ordered after the compute that produced the data.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .base import get_backend


class TransferHandle:
    """Completion of one backup (or any all-at-once transfer)."""

    def __init__(self, nbytes: int = 0, event=None, started: float | None = None):
        self.nbytes = nbytes
        self._event = event
        self.started = time.perf_counter() if started is None else started
        self.finished_at: float | None = None if event is not None else self.started

    def done(self) -> bool:
        if self._event is None or self._event.query():
            if self.finished_at is None:
                self.finished_at = time.perf_counter()
            return True
        return False

    def synchronize(self) -> None:
        if self._event is not None:
            self._event.synchronize()
        self.done()


class LayerLoad:
    """Completion of a layer-by-layer load: one event per layer."""

    def __init__(self, layer_num: int, nbytes: int = 0, events=None):
        self.layer_num = layer_num
        self.nbytes = nbytes
        self._events = events  # None on the CPU: every layer is already there
        self.started = time.perf_counter()
        self.finished_at: float | None = None if events is not None else self.started

    def wait_layer(self, layer: int, stream=None) -> None:
        """Make ``stream`` (default: the current one) wait until ``layer`` is loaded.

        Does not block the host; work queued on ``stream`` afterwards sees the layer.
        """
        if self._events is None:
            return
        s = torch.cuda.current_stream() if stream is None else stream
        s.wait_event(self._events[layer])

    def layer_done(self, layer: int) -> bool:
        return self._events is None or self._events[layer].query()

    def done(self) -> bool:
        if self._events is None or self._events[-1].query():
            if self.finished_at is None:
                self.finished_at = time.perf_counter()
            return True
        return False

    def synchronize(self) -> None:
        if self._events is not None:
            self._events[-1].synchronize()
        self.done()


@dataclass
class TransferStats:
    backups: int = 0
    loads: int = 0
    backup_bytes: int = 0
    load_bytes: int = 0


class TransferEngine:
    """Moves pages between one host pool and its device pool.

    ``io_backend``: ``direct`` (default on CPU), ``kernel``, ``dma`` or ``auto``
    (default on CUDA). The engine never decides *what* to move; the cache
    controller does.
    """

    def __init__(self, host_pool, io_backend: str | None = None):
        self.host_pool = host_pool
        self.device_pool = host_pool.device_pool
        self.device = torch.device(getattr(self.device_pool, "device", "cpu"))
        if io_backend is None:
            io_backend = "auto" if self.device.type == "cuda" else "direct"
        self.backend = get_backend(io_backend, self.device)
        self.io_backend = io_backend
        self.stats = TransferStats()

    @property
    def layer_num(self) -> int:
        return self.host_pool.layer_num

    def _nbytes(self, n_tokens: int, layers: int | None = None) -> int:
        per_layer = self.host_pool.spec.bytes_per_token_per_layer
        return n_tokens * per_layer * (self.layer_num if layers is None else layers)

    def backup(self, host_indices: torch.Tensor, device_indices: torch.Tensor) -> TransferHandle:
        """Copy device slots to host slots for every layer; the handle says when done."""
        self.host_pool.backup_from_device_all_layer(self.device_pool, host_indices, device_indices, self.io_backend)
        n = self._nbytes(len(host_indices))
        self.stats.backups += 1
        self.stats.backup_bytes += n
        return TransferHandle(n)

    def load(self, host_indices: torch.Tensor, device_indices: torch.Tensor) -> LayerLoad:
        """Copy host slots into device slots, layer by layer; wait per layer on the handle."""
        for layer in range(self.layer_num):
            self.host_pool.load_to_device_per_layer(self.device_pool, host_indices, device_indices, layer, self.io_backend)
        n = self._nbytes(len(host_indices))
        self.stats.loads += 1
        self.stats.load_bytes += n
        return LayerLoad(self.layer_num, n)
