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

    def host_layer_pages(self, layer: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """``(pages, page_size, n_chunks, chunk_bytes / w)`` view of one layer on the host, in
        elements of ``dtype`` (``w`` bytes; every stride, the offset and the size divisible by it)."""
        pl, w = self.host, dtype.itemsize
        pages = self.host_raw.numel() // (pl.layer_num * pl.page_size * pl.item_bytes)
        raw = self.host_raw.view(dtype)
        return raw.as_strided(
            (pages, pl.page_size, pl.n_chunks, pl.chunk_bytes // w),
            (pl.page // w, pl.token // w, pl.chunk // w, 1),
            raw.storage_offset() + layer * pl.layer_stride // w,
        )


class Backend:
    """A way of moving bytes between host and device pools.

    Preconditions (checked by the host pool, not here): indices are 1-D int64
    of equal length, in range, whole pages where the kind needs them, and no
    slot is named twice among the destinations. A backend may also offer
    ``prepare(parts, host_idx, dev_idx, to_host, block_quota, host_np=, dev_np=)``
    returning ``run(layer)`` (checks and planning once, then a call per layer);
    the transfer engine uses it where present. Backends are built per owner
    (:class:`~kvtier.transfer.factory.Backends`), never shared by the process.
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
