"""What every transfer backend is given, and the contract it keeps.

A :class:`TransferPart` is one component (K, V, latent KV or index-K) of a
host pool paired with the same component of a device pool: host bytes plus
their :class:`~kvtier.layouts.Placement`, and the device's per-layer
``(size, item_bytes)`` byte views. A backend copies token slots between the
two for all layers (backup, device -> host) or one layer (load, host ->
device). It runs on the caller's current CUDA stream and returns without
waiting; ordering and completion are the transfer engine's business.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ..layouts import Placement


@dataclass(frozen=True)
class TransferPart:
    name: str
    host_raw: torch.Tensor            # 1-D uint8, every byte of this component on the host
    host: Placement
    device_layers: tuple[torch.Tensor, ...]  # per layer, (device_size, item_bytes) uint8
    # Whether ``host_raw`` is still registered with CUDA, from its owner's own record (the host
    # pool's buffer): cheaper than asking the CUDA runtime every transfer. None: ask it.
    mapped: Callable[[], bool] | None = field(default=None, compare=False, repr=False)

    @property
    def item_bytes(self) -> int:
        return self.host.item_bytes

    @property
    def layer_num(self) -> int:
        return len(self.device_layers)

    def host_layer_pages(self, layer: int) -> torch.Tensor:
        """``(pages, page_size, n_chunks, chunk_bytes)`` view of one layer on the host."""
        pl = self.host
        pages = self.host_raw.numel() // (pl.layer_num * pl.page_size * pl.item_bytes)
        return self.host_raw.as_strided(
            (pages, pl.page_size, pl.n_chunks, pl.chunk_bytes),
            (pl.page, pl.token, pl.chunk, 1),
            self.host_raw.storage_offset() + layer * pl.layer_stride,
        )


class Backend:
    """A way of moving bytes between host and device pools.

    Preconditions (checked by the host pool, not here): indices are 1-D int64
    of equal length, in range, whole pages where the kind needs them, and no
    slot is named twice among the destinations.
    """

    name = ""

    def backup(self, parts: Sequence[TransferPart], host_idx: torch.Tensor, dev_idx: torch.Tensor,
               block_quota: int | None = None) -> None:
        """Copy slots ``dev_idx`` of every layer to host slots ``host_idx``."""
        raise NotImplementedError

    def load(self, parts: Sequence[TransferPart], host_idx: torch.Tensor, dev_idx: torch.Tensor,
             layer: int) -> None:
        """Copy host slots ``host_idx`` of one layer to device slots ``dev_idx``."""
        raise NotImplementedError


_hooks = threading.local()


def between_chunks() -> None:
    """A backend calls this between the chunks of a transfer it queues. In a thread that
    queues transfers for someone else (the engine's background thread for backups) it
    lets that thread give way to the caller (:func:`chunk_hook`); elsewhere it does nothing."""
    fn = getattr(_hooks, "between_chunks", None)
    if fn is not None:
        fn()


@contextmanager
def chunk_hook(fn: Callable[[], None]):
    """Run ``fn`` at every :func:`between_chunks` of this thread inside the block."""
    old = getattr(_hooks, "between_chunks", None)
    _hooks.between_chunks = fn
    try:
        yield
    finally:
        _hooks.between_chunks = old


_BACKENDS: dict[str, Backend] = {}
IO_BACKENDS = ("direct", "kernel", "dma", "auto")


def register_backend(backend: Backend) -> Backend:
    _BACKENDS[backend.name] = backend
    return backend


def get_backend(name: str | Backend, device: torch.device) -> Backend:
    """The backend for ``io_backend=name`` on a device pool living on ``device``.

    ``name`` may also be a configured backend, e.g. ``DMABackend(DMAConfig(load_drain=0))``
    from :mod:`kvtier.transfer.dma`: it is used as given (the named ones share one
    instance per process, with the default configuration).
    """
    if isinstance(name, Backend):
        if device.type != "cuda" and name.name != "direct":
            _needs_cuda(f"{type(name).__name__}(...) (a {name.name!r} backend)", device)
        return name
    if name not in IO_BACKENDS:
        raise ValueError(f"unknown io_backend {name!r}; use one of {list(IO_BACKENDS)}")
    if device.type != "cuda":
        if name in ("kernel", "dma"):
            _needs_cuda(repr(name), device)
        return _BACKENDS["direct"]
    if name not in _BACKENDS:
        _load_gpu_backends()
    if name not in _BACKENDS:
        raise ValueError(
            f"io_backend={name!r} is not available in this installation; use 'direct'"
        )
    return _BACKENDS[name]


def _needs_cuda(label: str, device: torch.device) -> None:
    raise ValueError(f"io_backend={label} needs a CUDA device pool (this one is on {device}); "
                     "use io_backend='direct', which works everywhere")


def _load_gpu_backends() -> None:
    """Import the CUDA backends on first use (they pull in Triton)."""
    try:
        from . import gpu  # noqa: F401  (registers kernel, dma, auto)
    except ImportError:
        pass
