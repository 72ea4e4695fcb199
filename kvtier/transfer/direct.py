"""The ``direct`` backend: plain torch copies, correct everywhere.

Both sides on the CPU: one vectorised gather/scatter per layer and component.
Device on CUDA: one copy per run of slots that are consecutive on both sides
(and, for layouts that jump between pages, inside one host page). This is
the reference every faster backend is tested against.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from .base import Backend, TransferPart


def runs(host_idx: np.ndarray, dev_idx: np.ndarray, page_size: int, split_pages: bool) -> Iterator[tuple[int, int, int]]:
    """Maximal ``(host_start, dev_start, length)`` runs, consecutive on both sides."""
    if host_idx.size == 0:
        return
    brk = (np.diff(host_idx) != 1) | (np.diff(dev_idx) != 1)
    if split_pages:
        brk |= host_idx[1:] % page_size == 0
    cuts = np.flatnonzero(brk) + 1
    starts = np.concatenate(([0], cuts))
    ends = np.concatenate((cuts, [host_idx.size]))
    for s, e in zip(starts.tolist(), ends.tolist()):
        yield int(host_idx[s]), int(dev_idx[s]), e - s


def _host_run(part: TransferPart, start: int, n: int, layer: int) -> torch.Tensor:
    pl = part.host
    return part.host_raw.as_strided(
        (n, pl.n_chunks, pl.chunk_bytes), (pl.token, pl.chunk, 1),
        part.host_raw.storage_offset() + pl.offset(start, layer),
    )


class DirectBackend(Backend):
    """Plain torch copies between any host and device pool; holds no state."""

    name = "direct"

    def backup(self, parts, host_idx, dev_idx, block_quota=None):
        for part in parts:
            for layer in range(part.layer_num):
                self._copy(part, host_idx, dev_idx, layer, to_host=True)

    def load(self, parts, host_idx, dev_idx, layer):
        for part in parts:
            self._copy(part, host_idx, dev_idx, layer, to_host=False)

    def _copy(self, part: TransferPart, host_idx: torch.Tensor, dev_idx: torch.Tensor, layer: int, to_host: bool) -> None:
        dev = part.device_layers[layer]
        pl = part.host
        h = host_idx.to("cpu")
        d = dev_idx.to("cpu")
        if dev.device.type == "cpu" and len(h) * pl.item_bytes < _MIN_RUN_BYTES * _count_runs(h, d, pl):
            _gather_scatter(part, h, d, layer, to_host)
            return
        pinned = part.host_raw.is_pinned()
        for hs, ds, n in runs(h.numpy(), d.numpy(), pl.page_size, not pl.tokens_linear):
            host_view = _host_run(part, hs, n, layer)
            dev_view = dev[ds : ds + n].view(n, pl.n_chunks, pl.chunk_bytes)
            if to_host:
                host_view.copy_(dev_view, non_blocking=pinned and host_view.is_contiguous())
            else:
                dev_view.copy_(host_view, non_blocking=pinned and host_view.is_contiguous())


# Below this many bytes per run on average, one indexed copy (in wide elements) beats a copy per
# run on the CPU (2 cores, both timed in turn: 3.2-5.9 GB/s against 2.5-4.8 for 64 KiB a run,
# 2.5-4.1 against 3.9-5.5 for 128 KiB).
_MIN_RUN_BYTES = 128 << 10


def _count_runs(h: torch.Tensor, d: torch.Tensor, pl) -> int:
    if len(h) < 2:
        return len(h)
    brk = (h[1:] - h[:-1] != 1) | (d[1:] - d[:-1] != 1)
    if not pl.tokens_linear:
        brk |= h[1:] % pl.page_size == 0
    return int(brk.sum()) + 1


def _widest(*sizes: int) -> torch.dtype:
    """The widest integer type whose size divides every one of ``sizes`` (bytes): an indexed copy
    of rows moves one element at a time, so wider elements move the same bytes in fewer steps."""
    for dt in (torch.int64, torch.int32, torch.int16):
        if all(s % dt.itemsize == 0 for s in sizes):
            return dt
    return torch.uint8


def _gather_scatter(part: TransferPart, h: torch.Tensor, d: torch.Tensor, layer: int, to_host: bool) -> None:
    """Both sides on the CPU, short runs: one indexed copy for the whole layer, in elements as
    wide as the layouts allow (8-byte ones move 4-5x the bytes a second of 1-byte ones)."""
    pl, raw, dv = part.host, part.host_raw, part.device_layers[layer]
    dt = _widest(pl.chunk_bytes, pl.token, pl.chunk, pl.page, pl.layer_stride, raw.storage_offset(), raw.numel(),
                 dv.storage_offset())
    dv = dv.view(dv.shape[0], pl.n_chunks, pl.chunk_bytes).view(dt)
    pages = part.host_layer_pages(layer, dt)
    if pl.tokens_linear:  # slot s sits at s * token: one index over the slots (view() never copies)
        hv = pages.view(-1, *pages.shape[2:])
        if to_host:
            hv.index_copy_(0, h, dv.index_select(0, d))
        else:
            dv.index_copy_(0, d, hv.index_select(0, h))
        return
    if to_host:
        pages[h // pl.page_size, h % pl.page_size] = dv.index_select(0, d)
    else:
        dv.index_copy_(0, d, pages[h // pl.page_size, h % pl.page_size])
