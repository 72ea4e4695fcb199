"""Planning DMA transfers: which 2-D copies move a transfer through staging.

The DMA backend never copies host bytes item by item. A GPU kernel gathers
(or scatters) the device items into a staging buffer laid out like a small
host pool in the same layout (:func:`compact`), so that every run of
consecutive host slots is a handful of large, possibly pitched, copies
between staging and the host. This module works on numbers only (no GPU), so
it is tested on the CPU.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from ..allocator import whole_page_rows
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
    return bool(whole_page_rows(host_idx, page_size).all())


def run_starts(host_idx: np.ndarray, cuts: np.ndarray | None = None, paired: np.ndarray | None = None) -> np.ndarray:
    """Where each run of consecutive slots starts (positions in ``host_idx``); a position in
    ``cuts`` (chunk edges) starts a new run too, and with ``paired`` (the slots on the other
    side, as many), so does a position where those are not consecutive."""
    brk = np.ones(host_idx.size, dtype=bool)
    if host_idx.size:
        brk[1:] = np.diff(host_idx) != 1
        if paired is not None:
            brk[1:] |= np.diff(paired) != 1
        if cuts is not None:
            brk[cuts] = True
    return np.flatnonzero(brk)


@dataclass(frozen=True)
class Runs:
    """The runs of consecutive slots in a host index: each distinct run length and how
    many runs have it. Worked out once per transfer (:meth:`of`) and handed to every
    step that needs it: the planning bound, the shape keys and the plans."""

    n: int
    lengths: tuple[int, ...]
    counts: tuple[int, ...]

    @staticmethod
    def of(host_idx: np.ndarray) -> "Runs":
        n = int(host_idx.size)
        if not n:
            return Runs(0, (), ())
        if _one_run(host_idx):
            return Runs(n, (n,), (1,))
        starts = run_starts(host_idx)  # more than one run: the shortcut above takes one
        lengths = np.diff(np.append(starts, n))
        counts = _counted(lengths)
        if counts is None:
            lengths, counts = np.unique(lengths, return_counts=True)
        else:
            lengths = np.flatnonzero(counts)
            counts = counts[lengths]
        return Runs(n, tuple(lengths.tolist()), tuple(counts.tolist()))

    @property
    def single(self) -> bool:
        """One run: the slots are ``first, first + 1, ...`` (as an allocator hands them out)."""
        return self.counts == (1,)

    @property
    def mean_class(self) -> int:
        """log2 of the mean run length."""
        return _mean_class(self.n, sum(self.counts))


def _one_run(host_idx: np.ndarray) -> bool:
    """One run, as an allocator hands slots out (``host_idx`` not empty): strictly increasing
    over a span of n - 1 slots is first, first + 1, ... One comparison pass, no index arrays:
    10 us against 27 for 32k slots on a CI core; in an H200 transfer call the general path
    took 0.19 ms (run 64, ``probe_host_steps_h200_run64.json``), on the way to the first copy."""
    return (int(host_idx[-1]) - int(host_idx[0]) == host_idx.size - 1
            and bool((host_idx[1:] > host_idx[:-1]).all()))


def _mean_class(n: int, runs: int) -> int:
    return int(math.log2(max(n / max(1, runs), 1)))


def run_count(host_idx: np.ndarray) -> int:
    """How many runs of consecutive slots ``host_idx`` holds (``sum(Runs.of(host_idx).counts)``)
    in one comparison pass, without their lengths: 16-23 us against Runs.of's ~215 us for 32k
    scattered slots on a CI core (its ``np.unique`` of the lengths), ~9 us for one run."""
    if host_idx.size == 0:
        return 0
    return 1 if _one_run(host_idx) else 1 + int(np.count_nonzero(np.diff(host_idx) != 1))


def run_class(host_idx: np.ndarray, runs: Runs | None = None) -> int:
    """log2 of the mean length of the runs of consecutive slots: what decides how copies split
    (:attr:`Runs.mean_class`; without ``runs``, from :func:`run_count` alone)."""
    return runs.mean_class if runs is not None else _mean_class(int(host_idx.size), run_count(host_idx))


@dataclass(frozen=True)
class HostOrder:
    """A transfer's slot pairs in host-slot order: ``order`` the permutation, ``slots`` the
    host slots in that order (``host[order]``). Whole pages are kept together."""

    order: np.ndarray
    slots: np.ndarray

    @staticmethod
    def of(host: np.ndarray, page_size: int) -> "HostOrder | None":
        """The order that puts ``host`` slots in ascending order, whole pages kept together;
        None when they already are (as an allocator hands them out).

        The DMA backend moves a transfer's slot pairs in this order where copies are small
        (``DMAConfig.sort_below``): host pages scattered at random then become ascending
        addresses, and pages that happen to be neighbours join into one run (longer, fewer
        copies). H200 run 25 (``probe_slot_order_h200_run25.json``, half the pool's pages at
        random): DMA backups of scattered pages 0.67-0.81x -> 0.73-0.88x. (The zero-copy kernel
        lost 0.01-0.05x on single tokens in that order on 4 KiB host pages, runs 25 and 28;
        on huge pages it gains in large pools and sorts a backup's pairs on the device itself,
        :attr:`.KernelConfig.host_order`.)
        One sort gives both: each slot (or page's first slot) shifted up with its position in
        the low bits (0.49 ms for 32k slots on the CPU here, where an argsort took 1.16 ms and a
        plain sort 0.44). Slots repeated in a load keep their order among themselves.
        """
        if ascending(host):
            return None
        ps = page_size if page_size > 1 and whole_pages(host, page_size) else 1
        keys = host[::ps].astype(np.int64)
        bits = max(1, (keys.size - 1).bit_length())
        if int(keys.min()) < 0 or int(keys.max()) >= 1 << (62 - bits):
            first = np.argsort(keys, kind="stable")   # slots too large to share a word with positions
            firsts = keys[first]
        else:
            packed = (keys << bits) | np.arange(keys.size, dtype=np.int64)
            packed.sort()
            first, firsts = packed & ((1 << bits) - 1), packed >> bits
        if ps == 1:
            return HostOrder(first, firsts)
        step = np.arange(ps)
        return HostOrder((first[:, None] * ps + step).reshape(-1), (firsts[:, None] + step).reshape(-1))


def ascending(host: np.ndarray) -> bool:
    """True when ``host`` slots strictly ascend, as an allocator hands them out."""
    return host.size < 2 or bool((host[1:] > host[:-1]).all())


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
        pitch at most ``CLOSE_PITCH`` widths) counts once: an H200 moved 1 KiB rows 8 KiB
        apart at the contiguous rate; rows farther apart count one each (2 KiB rows 64 KiB
        apart moved at 0.6x, ``bench/results/probe_copy_paths_h200.json``)."""
        copies = int(_engine_copies(self.tall).sum()) + len(self.flat)
        nbytes = int((self.tall[:, 2] * self.tall[:, 3]).sum()) + int(self.flat[:, 2].sum())
        return nbytes / copies if copies else 0.0

    def chunk(self, i: int) -> tuple[int, int, np.ndarray]:
        """(first item, item count, copies) of chunk ``i``."""
        return *self.items(i), self.copies[self.c_lo[i]:self.c_lo[i + 1]]

    def calls(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Chunk ``i``'s pitched rows and 1-D copies."""
        return self.tall[self.t_lo[i]:self.t_lo[i + 1]], self.flat[self.f_lo[i]:self.f_lo[i + 1]]


# A backup's first chunk: staging / RAMP_DIV, but not under RAMP_MIN_BYTES.
RAMP_DIV = 16
RAMP_MIN_BYTES = 4 << 20


def chunk_bounds(n: int, slots: int, page_size: int, per_slot: int, ramp: int = 0) -> np.ndarray:
    """Item offsets where chunks start (and ``n`` at the end): chunks of ``slots`` items, or
    with ``ramp`` (bytes, > 0) first chunks of ``slots / RAMP_DIV`` items but at least ``ramp``
    bytes, doubling up to ``slots``.

    A backup cannot copy anything until its first chunk is gathered, so that
    gather is time the copy engine sits idle (a full 128 MiB chunk takes ~0.8
    ms on an H200, about 2% of a 2 GiB backup). Doubling sizes keep every
    later gather shorter than the copy it overlaps (gathers run ~3x faster
    than PCIe). Every bound but the last is a multiple of ``page_size``.
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


def _counted(lengths: np.ndarray) -> np.ndarray | None:
    """How many of ``lengths`` (run lengths, not empty) have each value, ``np.bincount``, when
    they are small beside their number (runs of scattered slots: counting them is 2.5-3x faster
    than ``np.unique``'s sort); None when a sort is cheaper (few long runs)."""
    top = int(lengths.max())
    return None if top > 4 * lengths.size + 64 else np.bincount(lengths, minlength=top + 1)


def _lengths_by_value(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(lengths, return_inverse=True)``, by :func:`_counted` where it counts."""
    counts = _counted(lengths)
    if counts is None:
        return np.unique(lengths, return_inverse=True)
    distinct = np.flatnonzero(counts)
    rank = np.zeros(counts.size, np.int64)
    rank[distinct] = np.arange(distinct.size, dtype=np.int64)
    return distinct, rank[lengths]


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
    # distinct lengths stacked, each run's picked out by its length and moved to its start.
    # (One pass per distinct length cost ~20 small numpy calls each: 15 lengths in 32k scattered
    # single tokens, 40 chunks: 45 ms of a 100 ms load call on the H200's host, run 129.)
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


class ChunkedPlan(_Chunks):
    """:func:`plan`'s answer worked out one chunk at a time, when the chunk is asked for.

    A transfer cannot start until its first chunk's copies are known, and the
    copy engine sits idle while the host plans: planning 32k scattered host
    slots takes 5-15 ms. Planned a chunk at a time (H200 run 20, against run
    17), DMA moved page-major scattered page-1 slots at 0.74-0.92x instead of
    0.59-0.71x; on allocator slots (about 1 ms of planning) the A/B in one run
    gave backups -0.4 to +1.3 ms (``bench/results/probe_host_plan_h200.json``).
    The first (small, with ``ramp``) chunk's copies are queued after a
    fraction of the planning, and each later chunk is planned
    while the engine copies the ones before it. Chunk ``i``'s calls are
    exactly :meth:`DMAPlan.calls` of the whole plan (property-tested); the
    whole-plan figures (``n_calls``, ``mean_copy``, ...) plan every chunk.
    """

    def __init__(self, pl: Placement, host_idx: np.ndarray, layers: int, staging_bytes: int,
                 max_pitch: int | None = None, ramp: int = 0, runs: Runs | None = None):
        self._hold(pl, host_idx, layers, max_pitch, runs)
        self.staging, self.slots, self.bounds = _layout(pl, host_idx, layers, staging_bytes, ramp)

    def _hold(self, pl: Placement, host_idx: np.ndarray, layers: int, max_pitch: int | None, runs: Runs | None,
              keep_slots: bool = False):
        """Keep what planning a chunk later needs. One run (allocator slots): a chunk's copies
        are its length's template moved to where it starts, from the first slot alone. Else,
        or with ``keep_slots`` (a plan that reads every slot per chunk), a copy of the slots:
        chunks are planned later, and the caller's index array may change by then."""
        single = not keep_slots and (runs or Runs.of(host_idx)).single
        self._pl, self._layers, self.n_items = pl, layers, int(host_idx.size)
        self._first = int(host_idx[0]) if single else None
        self._idx = None if single else np.array(host_idx, dtype=np.int64)
        self._max_pitch = max_pitch or MAX_PITCH
        self._calls: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._kept: dict[int, dict[int, np.ndarray]] = {}  # run templates by layers, then length
        self._whole: DMAPlan | None = None

    def _chunk_calls(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(copies, pitched rows, 1-D copies) of chunk ``i``: its items and layers, with host
        offsets counted from layer 0."""
        if i not in self._calls:
            j0, m = self.items(i)
            l0, nl = self.layer_range(i)
            skip = l0 * self._pl.layer_stride
            if self._first is not None:
                calls = _run_calls(self._pl, self.staging, m, nl or self._layers, self._max_pitch)
                self._calls[i] = tuple(_shifted(a, self._pl.offset(self._first + j0, 0) + skip) for a in calls)
            else:
                copies, _ = _copies(self._pl, self.staging, self._idx[j0:j0 + m], np.array([0, m]),
                                    nl or self._layers, kept=self._kept.setdefault(nl or self._layers, {}))
                copies[:, 0] += skip
                self._calls[i] = (copies, *split_copies(copies, self._max_pitch))
        return self._calls[i]

    def chunk(self, i: int) -> tuple[int, int, np.ndarray]:
        """(first item, item count, copies) of chunk ``i``."""
        return *self.items(i), self._chunk_calls(i)[0]

    def calls(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Chunk ``i``'s pitched rows and 1-D copies, planned on first use."""
        return self._chunk_calls(i)[1:]

    def whole(self) -> DMAPlan:
        """Every chunk planned, as one :class:`DMAPlan` (for the figures over the whole transfer)."""
        if self._whole is None:
            parts = [self._chunk_calls(i) for i in range(self.n_chunks)]

            def joined(k, width):
                arrays = [p[k] for p in parts]
                lo = np.concatenate(([0], np.cumsum([len(a) for a in arrays]))).astype(np.int64)
                return (np.concatenate(arrays) if arrays else np.zeros((0, width), np.int64)), lo
            (copies, c_lo), (tall, t_lo), (flat, f_lo) = joined(0, 6), joined(1, 6), joined(2, 3)
            self._whole = DMAPlan(self.staging, self.slots, self.n_items, self.bounds, copies, c_lo,
                                  tall, t_lo, flat, f_lo)
        return self._whole

    # The figures over the whole transfer (auto's cost model reads them) plan every chunk.
    n_calls = property(lambda self: self.whole().n_calls)
    n_flat = property(lambda self: self.whole().n_flat)
    min_width = property(lambda self: self.whole().min_width)
    mean_copy = property(lambda self: self.whole().mean_copy)


def layer_major(pl: Placement) -> bool:
    """True when each layer holds its slots apart from every other layer's (layer_first):
    a run of host slots is then one piece per layer, however many slots it spans."""
    return pl.layer_num > 1 and pl.tokens_linear and pl.n_chunks == 1 and pl.layer_stride >= pl.token


def layer_bounds(layer_num: int, most: int, first: int) -> np.ndarray:
    """Layer offsets where chunks of whole layers start (and ``layer_num``): ``first`` layers,
    doubling up to ``most`` per chunk."""
    out, pos, size = [0], 0, max(1, min(first, most))
    while pos < layer_num:
        pos = min(pos + size, layer_num)
        out.append(pos)
        size = min(2 * size, most)
    return np.array(out, dtype=np.int64)


class LayerChunkedPlan(ChunkedPlan):
    """A backup of a layer-major host layout cut into chunks of whole layers, every slot in
    each: a run of host slots is one copy per layer, as long as the whole run.

    Chunks of slots (:class:`ChunkedPlan`) cut every layer's run at each chunk edge: MLA's 61
    layers of 1152-byte rows in 128 MiB chunks made copies of 2.2 MB (and 137-550 KB in the
    small first chunks), about 0.8 us each beyond their bytes on an H200, so the copy phase
    ran at 0.96-0.97x of the limit (run 25, ``probe_host_timeline_h200_run25.json``). Here
    an allocator's 32k MLA slots are one 37.7 MB copy per layer. The first chunks are small
    (one layer, or ``ramp`` bytes), doubling, as the copy engine waits for the first gather.
    The DMA backend uses it for one run of slots where one layer of every slot fits the
    staging buffer (:func:`layer_major` layouts): MLA allocator backups 0.92-0.93x -> 0.95x
    (H200 run 26). Scattered pages are correct here too (tested) but slow: a chunk of 1-3
    layers makes one pitched call per run, thousands per transfer.
    :meth:`whole` is for the figures over the whole transfer only: its item bounds do not
    describe these chunks, which each move every item.
    """

    def __init__(self, pl: Placement, host_idx: np.ndarray, staging_bytes: int, max_pitch: int | None = None,
                 ramp: int = 0, runs: Runs | None = None):
        self._hold(pl, host_idx, pl.layer_num, max_pitch, runs)
        self.slots = -(-max(self.n_items, 1) // pl.page_size) * pl.page_size
        per_layer = self.slots * pl.item_bytes
        most = max(1, min(pl.layer_num, staging_bytes // per_layer))
        self._lb = layer_bounds(pl.layer_num, most, -(-ramp // per_layer) if ramp else most)
        self.staging = compact(pl, self.slots, most)
        self.bounds = np.array([0, self.n_items], dtype=np.int64)

    @property
    def n_chunks(self) -> int:
        return len(self._lb) - 1

    def items(self, i: int) -> tuple[int, int]:
        return 0, self.n_items

    def layer_range(self, i: int) -> tuple[int, int]:
        return int(self._lb[i]), int(self._lb[i + 1] - self._lb[i])


def pool_placement(pl: Placement, pitch: int, size: int) -> Placement:
    """The device pool's bytes of a component in ``pl``'s terms (page size, item chunks): a
    stack of ``pl.layer_num`` layers ``pitch`` bytes apart, each ``size`` slots of contiguous
    items; slot ``s`` of layer ``l`` at ``l * pitch + s * item_bytes``."""
    item = pl.item_bytes
    return Placement(pl.page_size, pl.page_size * item, item, pitch, pl.chunk_bytes, pl.chunk_bytes, pl.n_chunks,
                     pl.layer_num, (pl.layer_num - 1) * pitch + size * item)


def pool_row_bytes(pl: Placement, host_idx: np.ndarray, dev_idx: np.ndarray) -> float:
    """Mean bytes a layer of a :class:`PoolPlan` of a :func:`layer_major` layout copies per
    call: the slots over the runs consecutive on both sides, times the item size."""
    if not host_idx.size:
        return 0.0
    return host_idx.size * pl.item_bytes / run_starts(host_idx, None, dev_idx).size


class PoolPlan(ChunkedPlan):
    """A transfer's copies straight between the host and the device pool: no staging buffer,
    no gather or scatter kernel. One pitched copy per run of slots consecutive on both sides
    (:func:`layer_major` layouts: ``layers`` rows of the run's bytes, the host's layer
    stride apart on one side and the pool's on the other).

    Uses no SMs (``DMAConfig.pool_rows``, off by default), but is not faster: the rows are a
    page long on both sides. On an H200 (run 89), 32k page-64 backups: on allocator slots
    0.84-0.89x of the link where staging (whole-layer host rows) gave 0.96-0.98x; on scattered
    host pages 0.73-0.89x where staging gave 0.77-0.88x. Planned a chunk at a time, as :class:`ChunkedPlan` (chunks of ``staging_bytes``, the
    first ones ramped), so the first copies go out after a fraction of the planning;
    ``staging`` is the pool's placement
    (:func:`pool_placement`), and the calls' staging offsets are byte offsets in the pool from
    layer 0's first byte. Needs the device slots on the host: the caller's order, permuted as
    the host slots are.
    """

    def __init__(self, pl: Placement, pool: Placement, host_idx: np.ndarray, dev_idx: np.ndarray, layers: int,
                 staging_bytes: int, max_pitch: int | None = None, ramp: int = 0):
        if dev_idx.shape != host_idx.shape:
            raise ValueError(f"{dev_idx.size} device slots for {host_idx.size} host slots; they must pair up")
        self._hold(pl, host_idx, layers, max_pitch, None, keep_slots=True)
        self._dev = np.array(dev_idx, dtype=np.int64)
        self.staging = pool
        self.slots = _staging_slots(pl, self.n_items, layers, staging_bytes)
        self.bounds = chunk_bounds(self.n_items, self.slots, pl.page_size, layers * pl.item_bytes, ramp)

    def _chunk_calls(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if i not in self._calls:
            j0, m = self.items(i)
            copies, _ = _copies(self._pl, self.staging, self._idx[j0:j0 + m], np.array([0, m]), self._layers,
                                self._dev[j0:j0 + m], kept=self._kept.setdefault(self._layers, {}))
            self._calls[i] = (copies, *split_copies(copies, self._max_pitch))
        return self._calls[i]


def _offsets(pl: Placement, slots: np.ndarray) -> np.ndarray:
    slots = slots.astype(np.int64)
    if pl.page_size == 1:
        return slots * pl.page
    return (slots // pl.page_size) * pl.page + (slots % pl.page_size) * pl.token


def narrow_layer_rows(pl: Placement) -> bool:
    """True when one layer's bytes of a token sit between other layers' (page-major layouts).

    Then a one-layer load copies rows of ``chunk_bytes`` spaced ``token``
    apart, and moving ``g`` adjacent layers at once widens the rows ``g``-fold.
    """
    return pl.layer_num > 1 and pl.layer_stride == pl.chunk_bytes


def group_sizes(layer_num: int) -> list[int]:
    """Candidate layers-per-copy: powers of two below ``layer_num``, then all of them."""
    out, g = [], 1
    while g < layer_num:
        out.append(g)
        g *= 2
    return out + [layer_num]


def choose_group(pl: Placement, load_rate, target: float) -> int:
    """The fewest adjacent layers a load must copy at once to run near its best speed.

    ``load_rate(g)`` is the measured speed of a load copying ``g`` layers at a
    time (what decides it is the copy engine's speed on the rows, the pitch
    and start of the rows, the host's cost per copy and the scatter kernels
    running beside the copies, so it is timed whole, not modelled). Groups
    are tried from all layers down, halving, and the smallest whose speed is
    at least ``target`` of the fastest trial so far wins: one trial per power
    of two, and none of the slowest (smallest) groups once a larger one has
    failed. The fastest so far, not the first: a trial that other traffic slowed
    (one 32-layer trial gave 14.8 GB/s beside 47-52 for the others, H200 run 65;
    the trials wait only for work already queued, so a backup that the engine's
    thread is still queueing shares the link with them) must not become the bar
    every smaller group clears, down to one layer at a time.
    Layouts whose layer rows are already long get 1 (strictly one layer at a
    time) without a trial.
    """
    if not narrow_layer_rows(pl):
        return 1
    sizes = group_sizes(pl.layer_num)
    best = load_rate(sizes[-1])
    chosen = sizes[-1]
    for g in reversed(sizes[:-1]):
        rate = load_rate(g)
        best = max(best, rate)
        if rate < target * best:
            break
        chosen = g
    return chosen


@dataclass(frozen=True)
class GroupedPlan:
    """A load copied ``group`` adjacent layers at a time; ``plans[n]`` moves ``n`` layers.

    The layers of a group arrive together: the copy (and the scatter) of a
    group is issued when its first layer is asked for.
    """

    group: int
    layer_num: int
    plans: dict

    def issue_at(self, layer: int) -> int:
        """Layers to move when ``layer`` is asked for: a group's size at its first layer, else 0."""
        if layer % self.group:
            return 0
        return min(self.group, self.layer_num - layer)

    @property
    def n_calls(self) -> float:
        """Pitched copies per layer."""
        return self.plans[self.group].n_calls / self.group

    @property
    def n_flat(self) -> float:
        """1-D copies per layer."""
        return self.plans[self.group].n_flat / self.group

    @property
    def min_width(self) -> int:
        return min(p.min_width for p in self.plans.values())

    @property
    def mean_copy(self) -> float:
        return self.plans[self.group].mean_copy


def grouped_plan(pl: Placement, host_idx: np.ndarray, group: int, staging_bytes: int,
                 max_pitch: int | None = None, chunked: bool = False, runs: Runs | None = None) -> GroupedPlan:
    """Plans for a load in groups of ``group`` layers (and the shorter last group);
    ``chunked``: each planned a chunk at a time (:class:`ChunkedPlan`; ``runs`` as there)."""
    sizes = sorted({group, pl.layer_num % group or group})
    if chunked:
        plans = {n: ChunkedPlan(pl, host_idx, n, staging_bytes, max_pitch, runs=runs) for n in sizes}
    else:
        plans = {n: plan(pl, host_idx, n, staging_bytes, max_pitch) for n in sizes}
    return GroupedPlan(group, pl.layer_num, plans)


# cudaMemcpy2D refuses pitches past the device's memPitch (2^31 - 1 on current GPUs).
MAX_PITCH = (1 << 31) - 1


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
