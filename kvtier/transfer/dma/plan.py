"""Planning a DMA transfer: which 2-D copies move it through staging (numpy only).

The DMA backend never copies host bytes item by item. A GPU kernel gathers
(or scatters) the device items into a staging buffer laid out like a small
host pool in the same layout (:func:`compact`), so that every run of
consecutive host slots is a handful of large, possibly pitched, copies
between staging and the host. Plans are numbers only, so they are tested on
the CPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ...layouts import Placement
from ..slots import Runs, _lengths_by_value, run_starts, whole_pages

# cudaMemcpy2D refuses pitches past the device's memPitch (2^31 - 1 on current GPUs).
MAX_PITCH = (1 << 31) - 1


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


TALL_MIN = 8
CLOSE_PITCH = 8


@functools.lru_cache(maxsize=4096)
def _run_template(host: Placement, stg: Placement, k: int, layers: int) -> np.ndarray:
    """The 2-D copies of one run of ``k`` slots, relative to its first byte on each side.

    Rows: ``(host_off, stg_off, width, height, host_pitch, stg_pitch)``. One
    outer dimension becomes the rows of each 2-D copy, the others are
    enumerated: the one with the shortest host pitch among those of at least
    ``TALL_MIN`` rows (the copy engine moves narrow rows at full speed only
    when they are close together), else the longest (fewest copies).
    """
    dims = _run_dims(host, stg, k, layers)
    width = dims[-1][0]
    if len(dims) == 1:
        return np.array([[0, 0, width, 1, width, width]], dtype=np.int64)
    outer = dims[:-1]
    enough = [i for i in range(len(outer)) if outer[i][0] >= TALL_MIN]
    tall = (min(enough, key=lambda i: outer[i][1]) if enough
            else max(range(len(outer)), key=lambda i: outer[i][0]))
    height, hp, sp = outer[tall]
    h_off, s_off = np.zeros(1, np.int64), np.zeros(1, np.int64)
    for n, hs, ss in outer[:tall] + outer[tall + 1:]:
        r = np.arange(n, dtype=np.int64)
        h_off = (h_off[:, None] + r[None, :] * hs).ravel()
        s_off = (s_off[:, None] + r[None, :] * ss).ravel()
    rows = np.empty((h_off.size, 6), dtype=np.int64)
    rows[:, 0], rows[:, 1] = h_off, s_off
    rows[:, 2:] = (width, height, hp, sp)
    rows.setflags(write=False)  # cached: shared by every run of this length
    return rows


@functools.lru_cache(maxsize=4096)
def _run_calls(host: Placement, stg: Placement, k: int, layers: int, max_pitch: int):
    """(copies, pitched rows, 1-D copies) of one run of ``k`` slots that starts at byte 0 on both sides."""
    tpl = _run_template(host, stg, k, layers)
    tall, flat = split_copies(tpl, max_pitch)
    tall.setflags(write=False)
    flat.setflags(write=False)
    return tpl, tall, flat


def _shifted(rows: np.ndarray, host_off: int) -> np.ndarray:
    out = rows.copy()
    out[:, 0] += host_off
    return out


class _Chunks:
    """What a plan's chunks share: ``bounds`` (item offsets) and the ``staging`` placement."""

    @property
    def n_chunks(self) -> int:
        return len(self.bounds) - 1

    @property
    def staging_bytes(self) -> int:
        return self.staging.total_bytes

    def items(self, i: int) -> tuple[int, int]:
        """(first item, item count) of chunk ``i``: no planning needed."""
        j0 = int(self.bounds[i])
        return j0, int(self.bounds[i + 1]) - j0

    def layer_range(self, i: int) -> tuple[int, int | None]:
        """(first layer, layer count) chunk ``i`` moves; None: every layer of the transfer."""
        return 0, None


@dataclass(frozen=True)
class DMAPlan(_Chunks):
    """A part's transfer cut into staging chunks of at most ``slots`` items.

    Chunk ``i`` moves items ``bounds[i] .. bounds[i+1]`` (a backup's first
    chunks are smaller: :func:`chunk_bounds`).
    ``copies[c_lo[i]:c_lo[i+1]]`` are chunk ``i``'s copies; host offsets are
    relative to the first byte of the (first) layer moved; staging offsets to
    the staging buffer. ``staging`` is the staging placement the gather or
    scatter kernel addresses. The copies are also kept as the runtime calls
    that queue them (:func:`split_copies`, done once for the whole plan):
    ``tall[t_lo[i]:t_lo[i+1]]`` pitched rows and ``flat[f_lo[i]:f_lo[i+1]]``
    1-D copies ``(host_off, stg_off, width)``.
    """

    staging: Placement
    slots: int
    n_items: int
    bounds: np.ndarray
    copies: np.ndarray
    c_lo: np.ndarray
    tall: np.ndarray
    t_lo: np.ndarray
    flat: np.ndarray
    f_lo: np.ndarray

    @property
    def n_calls(self) -> int:
        """Pitched copies (one runtime call each)."""
        return len(self.tall)

    @property
    def n_flat(self) -> int:
        """1-D copies (queued in batches)."""
        return len(self.flat)

    @property
    def min_width(self) -> int:
        return int(self.copies[:, 2].min()) if len(self.copies) else 0

    @property
    def mean_copy(self) -> float:
        """Bytes per copy the engine pays for. A pitched copy whose rows are close (host
        pitch at most ``CLOSE_PITCH`` widths) counts once, as the copy engine moves such rows
        at the contiguous rate; rows farther apart count one each."""
        copies = int(_engine_copies(self.tall).sum()) + len(self.flat)
        nbytes = int((self.tall[:, 2] * self.tall[:, 3]).sum()) + int(self.flat[:, 2].sum())
        return nbytes / copies if copies else 0.0

    def chunk(self, i: int) -> tuple[int, int, np.ndarray]:
        """(first item, item count, copies) of chunk ``i``."""
        return *self.items(i), self.copies[self.c_lo[i]:self.c_lo[i + 1]]

    def calls(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Chunk ``i``'s pitched rows and 1-D copies."""
        return self.tall[self.t_lo[i]:self.t_lo[i + 1]], self.flat[self.f_lo[i]:self.f_lo[i + 1]]


# A backup's first chunk: staging / RAMP_DIV, but not under RAMP_MIN_BYTES (docs/performance.md).
RAMP_DIV = 16
RAMP_MIN_BYTES = 4 << 20


def chunk_bounds(n: int, slots: int, page_size: int, per_slot: int, ramp: int = 0) -> np.ndarray:
    """Item offsets where chunks start (and ``n`` at the end): chunks of ``slots`` items, or
    with ``ramp`` (bytes, > 0) first chunks of ``slots / RAMP_DIV`` items but at least ``ramp``
    bytes, doubling up to ``slots``.

    A backup cannot copy anything until its first chunk is gathered, so that
    gather is time the copy engine sits idle. Doubling sizes keep every later
    gather shorter than the copy it overlaps (gathers run faster than PCIe).
    Every bound but the last is a multiple of ``page_size``.
    """
    sizes = []
    if ramp:
        first = max(slots // RAMP_DIV, -(-ramp // max(per_slot, 1)))
        size = -(-first // page_size) * page_size
        while size < slots:
            sizes.append(size)
            size *= 2
    out, pos = [0], 0
    for size in sizes:
        if pos >= n:
            break
        pos += size
        out.append(min(pos, n))
    while pos < n:
        pos += slots
        out.append(min(pos, n))
    return np.array(out, dtype=np.int64)


def _engine_copies(tall: np.ndarray) -> np.ndarray:
    """Copies the engine pays for, per pitched row of ``tall``: one when its rows are close
    (:attr:`DMAPlan.mean_copy`), else one per row."""
    return np.where(tall[:, 4] <= CLOSE_PITCH * tall[:, 2], 1, tall[:, 3])


def _staging_slots(pl: Placement, n: int, layers: int, staging_bytes: int) -> int:
    ps = pl.page_size
    slots = max(ps, (staging_bytes // (layers * pl.item_bytes)) // ps * ps)
    return min(slots, -(-max(n, 1) // ps) * ps)


def mean_copy_bound(pl: Placement, host_idx: np.ndarray, layers: int, staging_bytes: int,
                    max_pitch: int | None = None, runs: Runs | None = None) -> float:
    """An upper bound on :attr:`DMAPlan.mean_copy` of :func:`plan` for these arguments, from
    the run lengths alone (chunk edges, which only split runs further, are left out):
    well under a millisecond where planning 32k scattered slots takes several.
    ``runs``: :meth:`Runs.of` ``host_idx``, if the caller has it. Remembered per run
    lengths, so a transfer shaped like an earlier one costs no planning at all."""
    return _bound(pl, runs or Runs.of(host_idx), layers, staging_bytes, max_pitch or MAX_PITCH)


@functools.lru_cache(maxsize=1024)
def _bound(pl: Placement, runs: Runs, layers: int, staging_bytes: int, max_pitch: int) -> float:
    if not runs.n:
        return 0.0
    stg = compact(pl, _staging_slots(pl, runs.n, layers, staging_bytes), layers)
    copies = 0
    for k, c in zip(runs.lengths, runs.counts):
        tpl = _run_template(pl, stg, k, layers)
        tall = tall_rows(tpl, max_pitch)
        copies += c * (int(_engine_copies(tpl[tall]).sum()) + int(tpl[~tall, 3].sum()))
    return runs.n * layers * pl.item_bytes / copies


def plan(pl: Placement, host_idx: np.ndarray, layers: int, staging_bytes: int,
         max_pitch: int | None = None, ramp: int = 0) -> DMAPlan:
    """Plan moving host slots ``host_idx`` (in transfer order) for ``layers`` layers.

    Preconditions: :func:`dma_capable`. The staging buffer holds at least one
    page of every layer moved, even if that exceeds ``staging_bytes``.
    ``max_pitch``: the widest pitch a 2-D call takes (default: the runtime's).
    ``ramp``: start with small chunks, at least ``ramp`` bytes
    (:func:`chunk_bounds`; backups pass ``RAMP_MIN_BYTES``: they gather
    before their first copy). 0: every chunk fills the staging buffer.
    """
    max_pitch = max_pitch or MAX_PITCH
    stg, slots, bounds = _layout(pl, host_idx, layers, staging_bytes, ramp)
    copies, owner_all = _copies(pl, stg, host_idx, bounds, layers)
    n_chunks = len(bounds) - 1
    chunks = np.arange(n_chunks + 1)
    is_tall = tall_rows(copies, max_pitch)
    tall, flat = split_copies(copies, max_pitch, is_tall)
    flat_owner = np.repeat(owner_all[~is_tall], copies[~is_tall, 3])
    return DMAPlan(stg, slots, int(host_idx.size), bounds, copies, np.searchsorted(owner_all, chunks), tall,
                   np.searchsorted(owner_all[is_tall], chunks), flat, np.searchsorted(flat_owner, chunks))


def _layout(pl: Placement, host_idx: np.ndarray, layers: int, staging_bytes: int, ramp: int):
    """(staging placement, slots per staging buffer, chunk bounds) of a plan: no copies yet."""
    n = int(host_idx.size)
    slots = _staging_slots(pl, n, layers, staging_bytes)
    return compact(pl, slots, layers), slots, chunk_bounds(n, slots, pl.page_size, layers * pl.item_bytes, ramp)


def _templates(pl: Placement, stg: Placement, ks, layers: int, kept: dict | None) -> list[np.ndarray]:
    """:func:`_run_template` of each length in ``ks``; ``kept``: a plan's own dict of them by
    length (its placements and layers fixed), which spares the cache's hashing of placements."""
    if kept is None:
        return [_run_template(pl, stg, k, layers) for k in ks]
    out = []
    for k in ks:
        t = kept.get(k)
        if t is None:
            t = kept[k] = _run_template(pl, stg, k, layers)
        out.append(t)
    return out


def _copies(pl: Placement, stg: Placement, host_idx: np.ndarray, bounds: np.ndarray, layers: int,
            stg_idx: np.ndarray | None = None, kept: dict | None = None):
    """Every copy of the transfer, grouped by chunk, and the chunk each belongs to.

    Runs of consecutive host slots are cut at chunk edges; each run's copies
    are its length's template (:func:`_run_template`) moved to where the run
    starts on the host and in its chunk's staging buffer. ``stg_idx``: the other side's
    slot of each host slot (:class:`PoolPlan`: the device pool's), not the position in
    the chunk; runs are then cut where those are not consecutive too. ``kept``: as
    :func:`_templates`.
    """
    n = int(host_idx.size)
    starts = run_starts(host_idx, bounds[1:-1], stg_idx)
    if not starts.size:
        return np.zeros((0, 6), np.int64), np.zeros(0, np.int64)
    lengths = np.diff(np.append(starts, n))
    chunk_of = np.searchsorted(bounds, starts, side="right") - 1
    # Every run's rows at once, in run order (so grouped by chunk): the templates of the
    # distinct lengths stacked, each run's picked out by its length and moved to its start
    # (a pass per distinct length costs ~20 small numpy calls each, on the transfer's path).
    distinct, inverse = _lengths_by_value(lengths)
    tpls = _templates(pl, stg, distinct.tolist(), layers, kept)
    s0 = _offsets(stg, starts - bounds[chunk_of] if stg_idx is None else stg_idx[starts])
    if all(len(t) == 1 for t in tpls):  # a copy per run (single scattered tokens): no unrolling
        copies = np.concatenate(tpls)[inverse]
        copies[:, 0] += _offsets(pl, host_idx[starts])
        copies[:, 1] += s0
        return copies, chunk_of
    tpl_len = np.array([len(t) for t in tpls], dtype=np.int64)
    tpl_at = np.cumsum(tpl_len) - tpl_len
    per_run = tpl_len[inverse]
    first = np.cumsum(per_run) - per_run
    total = int(per_run.sum())
    pick = np.repeat(tpl_at[inverse] - first, per_run) + np.arange(total, dtype=np.int64)
    copies = np.concatenate(tpls)[pick]
    copies[:, 0] += np.repeat(_offsets(pl, host_idx[starts]), per_run)
    copies[:, 1] += np.repeat(s0, per_run)
    return copies, np.repeat(chunk_of, per_run)


def _offsets(pl: Placement, slots: np.ndarray) -> np.ndarray:
    slots = slots.astype(np.int64)
    if pl.page_size == 1:
        return slots * pl.page
    return (slots // pl.page_size) * pl.page + (slots % pl.page_size) * pl.token


def tall_rows(copies: np.ndarray, max_pitch: int) -> np.ndarray:
    """Which rows go as one 2-D call: height > 1 and pitches the call accepts."""
    return (copies[:, 3] > 1) & (np.maximum(copies[:, 4], copies[:, 5]) <= max_pitch)


def split_copies(copies: np.ndarray, max_pitch: int, tall: np.ndarray | None = None):
    """Split a chunk's copies into pitched rows for one 2-D call each and a flat list of 1-D copies.

    Returns ``(tall, flat)``: ``tall`` holds the rows of height > 1 whose
    pitches a 2-D call accepts (``<= max_pitch``); every other row becomes
    ``height`` 1-D copies, the rows ``(host_off, stg_off, width)`` of ``flat``,
    so they can go in one batch.
    ``tall``: :func:`tall_rows` of these copies, when the caller has it.
    """
    if (copies[:, 3] == 1).all():  # rows of one copy each: none is pitched (a given ``tall`` is all False)
        return copies[:0], np.ascontiguousarray(copies[:, :3])
    tall = tall_rows(copies, max_pitch) if tall is None else tall
    flat = copies[~tall]
    heights = flat[:, 3]
    if (heights == 1).all():  # rows of one copy each (single scattered tokens): nothing to unroll
        return copies[tall], np.ascontiguousarray(flat[:, :3])
    row = np.arange(int(heights.sum()), dtype=np.int64) - np.repeat(np.cumsum(heights) - heights, heights)
    h_off = np.repeat(flat[:, 0], heights) + row * np.repeat(flat[:, 4], heights)
    s_off = np.repeat(flat[:, 1], heights) + row * np.repeat(flat[:, 5], heights)
    return copies[tall], np.stack([h_off, s_off, np.repeat(flat[:, 2], heights)], axis=1)
