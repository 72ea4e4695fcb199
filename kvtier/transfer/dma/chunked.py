"""Plans worked out a chunk at a time, as the chunks are queued (numpy only).

:class:`ChunkedPlan` is :func:`.plan.plan`'s answer chunk by chunk;
:class:`LayerChunkedPlan` cuts a layer-major backup into chunks of whole layers;
:class:`PoolPlan` copies straight between the host and the device pool;
:class:`GroupedPlan` loads several adjacent layers at once where, in page-major
layouts, one layer of a token is a short row between the other layers' rows
(copying ``g`` adjacent layers widens the rows ``g``-fold).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...layouts import Placement
from ..slots import Runs, run_starts
from .plan import (MAX_PITCH, DMAPlan, _Chunks, _copies, _layout, _run_calls, _shifted, _staging_slots, chunk_bounds,
                   compact, plan, split_copies)


class ChunkedPlan(_Chunks):
    """:func:`plan`'s answer worked out one chunk at a time, when the chunk is asked for.

    A transfer cannot start until its first chunk's copies are known, and the
    copy engine sits idle while the host plans (milliseconds for 32k scattered
    host slots). The first (small, with ``ramp``) chunk's copies are queued after a
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

    Chunks of slots (:class:`ChunkedPlan`) cut every layer's run at each chunk edge into
    shorter copies; here an allocator's 32k MLA slots are one 37.7 MB copy per layer. The
    first chunks are small (one layer, or ``ramp`` bytes), doubling, as the copy engine
    waits for the first gather. The DMA backend uses it for one run of slots where one layer
    of every slot fits the staging buffer (:func:`layer_major` layouts). Scattered pages are
    correct here too (tested) but slow: a chunk of 1-3 layers makes one pitched call per run.
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
    page long on both sides (docs/performance.md). Planned a chunk at a time, as
    :class:`ChunkedPlan` (chunks of ``staging_bytes``, the first ones ramped);
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


def staged(p) -> bool:
    """Whether plan ``p`` moves its part through staging (gathers or scatters on the device)."""
    return p is not None and not isinstance(p, PoolPlan)


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
    (a backup still being queued shares the link with the trials) must not become
    the bar every smaller group clears, down to one layer at a time.
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
