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
        if dev.device.type == "cpu" and len(h) < _MIN_RUN * _count_runs(h, d, pl):
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


# Below this many tokens per run on average, one vectorised gather/scatter beats a copy per
# run on the CPU (measured on a 2-core CI-class machine, 4 KiB items).
_MIN_RUN = 8


def _count_runs(h: torch.Tensor, d: torch.Tensor, pl) -> int:
    if len(h) < 2:
        return len(h)
    brk = (h[1:] - h[:-1] != 1) | (d[1:] - d[:-1] != 1)
    if not pl.tokens_linear:
        brk |= h[1:] % pl.page_size == 0
    return int(brk.sum()) + 1


def _gather_scatter(part: TransferPart, h: torch.Tensor, d: torch.Tensor, layer: int, to_host: bool) -> None:
    """Both sides on the CPU, short runs: one indexed copy for the whole layer."""
    pl = part.host
    dv = part.device_layers[layer]
    dv = dv.view(dv.shape[0], pl.n_chunks, pl.chunk_bytes)
    if pl.tokens_linear:
        slots = part.host_raw.numel() // (pl.layer_num * pl.item_bytes)
        hv = part.host_raw.as_strided(
            (slots, pl.n_chunks, pl.chunk_bytes), (pl.token, pl.chunk, 1),
            part.host_raw.storage_offset() + layer * pl.layer_stride,
        )
        if to_host:
            hv.index_copy_(0, h, dv.index_select(0, d))
        else:
            dv.index_copy_(0, d, hv.index_select(0, h))
        return
    pages = part.host_layer_pages(layer)
    if to_host:
        pages[h // pl.page_size, h % pl.page_size] = dv.index_select(0, d)
    else:
        dv.index_copy_(0, d, pages[h // pl.page_size, h % pl.page_size])


