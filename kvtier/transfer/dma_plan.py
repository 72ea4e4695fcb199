"""Planning DMA transfers: which 2-D copies move a transfer through staging.

The DMA backend never copies host bytes item by item. A GPU kernel gathers
(or scatters) the device items into a staging buffer laid out like a small
host pool in the same layout (:func:`compact`), so that every run of
consecutive host slots is a handful of large, possibly pitched, copies
between staging and the host. This module works on numbers only (no GPU), so
it is tested on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..layouts import Placement


def compact(pl: Placement, slots: int, layers: int) -> Placement:
    """``pl``'s order of dimensions, packed for ``slots`` slots and ``layers`` layers.

    A staging buffer with this placement keeps the host layout's byte order,
    so a run of host slots maps onto a run of staging slots with the same
    inner geometry and the copies between them are long.
    """
    dims = [("page", slots // pl.page_size, pl.page), ("token", pl.page_size, pl.token),
            ("layer", layers, pl.layer_stride), ("chunk", pl.n_chunks, pl.chunk)]
    stride = pl.chunk_bytes
    out = {name: 0 for name, _, _ in dims}
    for name, n, _ in sorted((d for d in dims if d[1] > 1), key=lambda d: d[2]):
        out[name] = stride
        stride *= n
    return Placement(pl.page_size, out["page"], out["token"], out["layer"], out["chunk"],
                     pl.chunk_bytes, pl.n_chunks, layers, stride)


def whole_pages(host_idx: np.ndarray, page_size: int) -> bool:
    """True when the indices are whole pages, each in order (what page-jumping layouts need)."""
    if page_size == 1:
        return True
    if host_idx.size % page_size:
        return False
    pages = host_idx.reshape(-1, page_size)
    return bool((pages[:, 0] % page_size == 0).all() and (np.diff(pages, axis=1) == 1).all())


def dma_capable(pl: Placement, host_idx: np.ndarray) -> bool:
    return pl.page_size == 1 or pl.tokens_linear or whole_pages(host_idx, pl.page_size)


def _run_dims(host: Placement, stg: Placement, k: int, layers: int) -> list[tuple[int, int, int]]:
    """(size, host stride, staging stride) of a run of ``k`` slots, outermost first, merged."""
    ps = host.page_size
    if ps == 1:
        slot = [(k, host.page, stg.page)]
    elif host.tokens_linear:
        slot = [(k, host.token, stg.token)]
    else:
        slot = [(k // ps, host.page, stg.page), (ps, host.token, stg.token)]
    dims = slot + [(layers, host.layer_stride, stg.layer_stride), (host.n_chunks, host.chunk, stg.chunk)]
    dims = sorted((d for d in dims if d[0] > 1), key=lambda d: -d[1])
    merged = [(host.chunk_bytes, 1, 1)]
    for n, hs, ss in reversed(dims):
        inner_n, inner_h, inner_s = merged[0]
        if hs == inner_n * inner_h and ss == inner_n * inner_s:
            merged[0] = (n * inner_n, inner_h, inner_s)
        else:
            merged.insert(0, (n, hs, ss))
    return merged


def _run_template(host: Placement, stg: Placement, k: int, layers: int) -> np.ndarray:
    """The 2-D copies of one run of ``k`` slots, relative to its first byte on each side.

    Rows: ``(host_off, stg_off, width, height, host_pitch, stg_pitch)``.
    """
    dims = _run_dims(host, stg, k, layers)
    width = dims[-1][0]
    if len(dims) == 1:
        return np.array([[0, 0, width, 1, width, width]], dtype=np.int64)
    height, hp, sp = dims[-2]
    h_off, s_off = np.zeros(1, np.int64), np.zeros(1, np.int64)
    for n, hs, ss in dims[:-2]:
        r = np.arange(n, dtype=np.int64)
        h_off = (h_off[:, None] + r[None, :] * hs).ravel()
        s_off = (s_off[:, None] + r[None, :] * ss).ravel()
    rows = np.empty((h_off.size, 6), dtype=np.int64)
    rows[:, 0], rows[:, 1] = h_off, s_off
    rows[:, 2:] = (width, height, hp, sp)
    return rows


@dataclass(frozen=True)
class DMAPlan:
    """A part's transfer cut into staging chunks of ``slots`` items each.

    ``copies[c_lo[i]:c_lo[i+1]]`` are chunk ``i``'s copies; host offsets are
    relative to the first byte of the (first) layer moved; staging offsets to
    the staging buffer. ``staging`` is the staging placement the gather or
    scatter kernel addresses.
    """

    staging: Placement
    slots: int
    n_items: int
    copies: np.ndarray
    c_lo: np.ndarray

    @property
    def n_chunks(self) -> int:
        return len(self.c_lo) - 1

    @property
    def staging_bytes(self) -> int:
        return self.staging.total_bytes

    @property
    def n_copies(self) -> int:
        return len(self.copies)

    @property
    def min_width(self) -> int:
        return int(self.copies[:, 2].min()) if len(self.copies) else 0

    def chunk(self, i: int) -> tuple[int, int, np.ndarray]:
        """(first item, item count, copies) of chunk ``i``."""
        j0 = i * self.slots
        return j0, min(self.slots, self.n_items - j0), self.copies[self.c_lo[i]:self.c_lo[i + 1]]


def plan(pl: Placement, host_idx: np.ndarray, layers: int, staging_bytes: int) -> DMAPlan:
    """Plan moving host slots ``host_idx`` (in transfer order) for ``layers`` layers.

    Preconditions: :func:`dma_capable`. The staging buffer holds at least one
    page of every layer moved, even if that exceeds ``staging_bytes``.
    """
    ps = pl.page_size
    per_slot = layers * pl.item_bytes
    slots = max(ps, (staging_bytes // per_slot) // ps * ps)
    n = int(host_idx.size)
    slots = min(slots, -(-max(n, 1) // ps) * ps)
    stg = compact(pl, slots, layers)
    pos = np.arange(n, dtype=np.int64)
    brk = np.ones(n, dtype=bool)
    if n:
        brk[1:] = (np.diff(host_idx) != 1) | (pos[1:] % slots == 0)
    starts = np.flatnonzero(brk)
    lengths = np.diff(np.append(starts, n))
    chunk_of = starts // slots
    out, owner = [], []
    for k in np.unique(lengths).tolist():
        sel = starts[lengths == k]
        tpl = _run_template(pl, stg, int(k), layers)
        h0 = _offsets(pl, host_idx[sel])
        s0 = _offsets(stg, sel % slots)
        rows = np.repeat(tpl[None, :, :], sel.size, axis=0)
        rows[:, :, 0] += h0[:, None]
        rows[:, :, 1] += s0[:, None]
        out.append(rows.reshape(-1, 6))
        owner.append(np.repeat(chunk_of[lengths == k], len(tpl)))
    copies = np.concatenate(out) if out else np.zeros((0, 6), np.int64)
    owner_all = np.concatenate(owner) if owner else np.zeros(0, np.int64)
    order = np.argsort(owner_all, kind="stable")
    n_chunks = -(-n // slots)
    c_lo = np.searchsorted(owner_all[order], np.arange(n_chunks + 1))
    return DMAPlan(stg, slots, n, copies[order], c_lo)


def _offsets(pl: Placement, slots: np.ndarray) -> np.ndarray:
    slots = slots.astype(np.int64)
    return (slots // pl.page_size) * pl.page + (slots % pl.page_size) * pl.token
