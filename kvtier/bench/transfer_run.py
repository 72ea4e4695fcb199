"""The sweep of ``kvtier bench transfer``: every case, kind of host slots, backend and direction,
timed in rounds, each row a ratio to the contiguous limit measured in the same sweep."""

from __future__ import annotations

import gc
import zlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from tqdm import tqdm

from ..layouts import SUPPORTED
from ..transfer import Backends, TransferEngine
from .transfer_cases import (DIRECTIONS, HOST_SLOTS, SLOT_KINDS, SPREAD_POOL, Case, Clock, Row, _gb, _with_limits,
                             contiguous_limit, load_groups, measure, pair_note, parse_backend, round_order,
                             sample_counts, sample_note)


@dataclass
class _Sweep:
    """What every step of one :func:`run_bench` shares: its settings, progress bar, rows so far,
    and the limits (measured with the first case, of ``nbytes`` a copy)."""

    clock: Clock
    reps: int
    rounds: int
    backends: tuple[str, ...]
    spread: int
    bar: tqdm
    on_row: Callable | None
    shared: Backends
    rows: list[Row] = field(default_factory=list)
    limits: dict | None = None
    nbytes: int = 0


@dataclass
class _Timings:
    """What one case measured on one kind of host slots, by ``(backend, direction)``: the GB/s
    of each round (``got``), what auto chose over every round (``picks``), and what the last
    round's row reports besides its GB/s (``last``: SMs, layers per copy, samples, pair note)."""

    got: dict = field(default_factory=dict)
    picks: dict = field(default_factory=dict)
    last: dict = field(default_factory=dict)


def run_bench(tokens: int, reps: int, backends: tuple[str, ...], kinds, page_sizes, layers, progress=True,
              on_row=None, rounds: int = 1, layouts=None, slots=HOST_SLOTS, spread: int = SPREAD_POOL,
              shared: Backends | None = None) -> list[Row]:
    """Time every kind x host layout x page size x kind of host slots x backend x direction,
    ``tokens`` a transfer; return the rows, the contiguous limit's three first.

    ``layers``: the shapes' layer count replaced (None: their own). ``layouts``: only these host
    layouts (None: every one each kind supports). ``slots``: ``allocator``, ``scattered`` and/or
    ``spread`` (scattered pages of a host pool ``spread`` times the transfer, made for those rows).
    Each case and kind of host slots draws its device slots (and scattered host pages) from its
    own seed, so a row is timed on the same slots whichever others run with it. ``rounds``: each
    case's backends and directions are timed that many times over, in turn (:func:`round_order`),
    and a row is the median of its rounds, so a drift while a case is timed weighs on every
    backend alike. Without CUDA only ``direct`` runs.

    ``on_row(rows, groups, picks, samples=...)`` is called after each row (partial results
    survive): ``groups`` is the layers per copy of a DMA load row (None otherwise), ``picks`` what
    auto chose during the row (``{(direction, backend): transfers}``, warm-up included),
    ``samples`` the timed samples auto holds for the shapes the row added to (:func:`sample_note`);
    also ``rounds=[GB/s, ...]`` where ``rounds`` > 1, ``pair`` (:func:`pair_note`) where there is
    one, and ``huge``, the share of the case's host pool in huge pages, where it asked for them.
    ``shared``: the backends every case's engines take theirs from (default: a new set), so what
    ``auto`` and ``dma`` measure in one case carries over to the next, as in a server.
    On CUDA the limits are measured again at the end and the higher of the two counts; it is
    applied to every row's ratio, and ``on_row`` is called once more with ``final=True`` and
    ``ends``: per limit, what the start and the end measured (a link that drifts shows there).
    """
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    backends = backends if cuda else ("direct",)
    combos = [(k, lay, ps) for k in kinds for lay in SUPPORTED[k] if layouts is None or lay in layouts
              for ps in page_sizes]
    total = len(combos) * len(slots) * len(DIRECTIONS) * len(backends) * rounds
    bar = tqdm(total=total, desc="bench transfer", disable=not progress)
    sweep = _Sweep(Clock(cuda), reps, rounds, backends, spread, bar, on_row, Backends() if shared is None else shared)
    for kind, layout, ps in combos:
        case = Case(kind, layout, ps, tokens, device, layers)
        if sweep.limits is None:
            _start_limits(sweep, case.nbytes)
        for which in [h for h in SLOT_KINDS if h in slots]:
            _time_slots(sweep, case, ps, which)
        case.host.close()
        del case
        # And whatever a reference cycle still holds: the up-front memory check counts one case's
        # pools at a time, so none may outlive its case until the collector runs.
        gc.collect()
    bar.close()
    if cuda and sweep.rows:
        _end_limits(sweep)
    return sweep.rows


def _start_limits(sweep: _Sweep, nbytes: int) -> None:
    """Measure the limits (while the first case's pools exist) and add their three rows."""
    sweep.nbytes = nbytes
    limits = sweep.limits = contiguous_limit(nbytes, sweep.clock, sweep.reps)
    limits["both"] = (limits["backup"] + limits["load"]) / 2
    for direction, key in (("backup", "backup"), ("load", "load"), ("both", "duplex")):
        sweep.rows.append(Row("all", "contiguous", 0, direction, "contiguous", "contiguous",
                              _gb(limits[key]), _gb(limits[direction]),
                              round(limits[key] / limits[direction], 3), 0))


def _time_slots(sweep: _Sweep, case: Case, ps: int, which: str) -> None:
    """Time every backend and direction of ``case`` (page size ``ps``) on host slots ``which``
    and add their rows; a ``spread`` pool is made for them and closed after."""
    host = case.spread_host(sweep.spread) if which == "spread" else case.host
    # Whether the host pool got the huge pages it asked for: the kernel's rows depend
    # on it, and a process that has made and dropped many pools might get fewer.
    huge = host.huge_page_share() if host.huge_pages else None
    rng = np.random.default_rng(zlib.crc32(f"{case.kind}/{case.layout}/{ps}/{which}".encode()))
    idx = case.indices(which != "allocator", rng, host)
    # one copy per slot and layer: minutes, and says nothing new
    timed = [b for b in sweep.backends if not (sweep.clock.cuda and b == "direct" and ps == 1)]
    sweep.bar.update(len(DIRECTIONS) * sweep.rounds * (len(sweep.backends) - len(timed)))
    engines = {}
    for b in timed:
        name, quota = parse_backend(b)
        engines[b] = TransferEngine(host, name, block_quota=quota, backends=sweep.shared)
    timings = _Timings()
    for rnd in range(sweep.rounds):
        for backend in round_order(list(engines), rnd):
            for direction in DIRECTIONS:
                sweep.bar.set_postfix_str(f"{case.kind} {case.layout} p{ps} {direction} {backend}")
                _time_one(sweep, case, engines[backend], (backend, direction), idx, rnd == sweep.rounds - 1,
                          timings)
                sweep.bar.update()
    _add_rows(sweep, case, ps, which, list(engines), timings, huge)
    if host is not case.host:
        host.close()


def _time_one(sweep: _Sweep, case: Case, engine: TransferEngine, key: tuple[str, str], idx, final: bool,
              timings: _Timings) -> None:
    """One timing of ``key`` (``(backend, direction)``) on ``engine`` into ``timings``; in the
    ``final`` round also what the row reports besides its GB/s."""
    direction = key[1]
    before = Counter(getattr(engine.backend, "picks", {}))
    seen = sample_counts(engine.backend)
    pair_log = [] if (sweep.clock.cuda and direction == "both" and final) else None
    timings.got.setdefault(key, []).append(measure(case, engine, direction, idx, sweep.clock, sweep.reps,
                                                   pair_log))
    timings.picks[key] = (timings.picks.get(key, Counter())
                          + (Counter(getattr(engine.backend, "picks", {})) - before))
    if final:
        timings.last[key] = (
            getattr(engine.backend, "last_blocks", 0),
            load_groups(engine.backend) if direction == "load" else None,
            sample_note(engine.backend, seen), pair_note(pair_log or []))


def _add_rows(sweep: _Sweep, case: Case, ps: int, which: str, backends: list[str], timings: _Timings,
              huge: float | None) -> None:
    """A row per backend and direction, in the backends' given order (whatever order the last
    round ran in), each the median of its rounds and reported to ``on_row`` as it is added."""
    for backend in backends:
        for direction in DIRECTIONS:
            key = (backend, direction)
            g = timings.got[key]
            sms, groups, samples, pair = timings.last[key]
            gbps, lim = float(np.median(g)), sweep.limits[direction]
            sweep.rows.append(Row(case.kind, case.layout, ps, direction, backend, which,
                                  _gb(gbps), _gb(lim), round(gbps / lim, 3), sms))
            if sweep.on_row:
                extra = {"rounds": [round(x, 2) for x in g]} if sweep.rounds > 1 else {}
                if pair:
                    extra["pair"] = pair
                if huge is not None:
                    extra["huge"] = huge
                sweep.on_row(sweep.rows, groups, timings.picks[key], samples=samples, **extra)


def _end_limits(sweep: _Sweep) -> None:
    """Measure the limits again; each becomes the higher of the start's and the end's, every
    row's ratio is taken against them, and ``on_row`` is called with ``final=True``."""
    limits = sweep.limits
    again = contiguous_limit(sweep.nbytes, sweep.clock, sweep.reps)
    again["both"] = (again["backup"] + again["load"]) / 2
    ends = {key: (round(limits[key], 2), round(again[key], 2)) for key in limits}
    for key in ("backup", "load", "duplex"):
        limits[key] = max(limits[key], again[key])
    # A pair's limit is the mean of the two directions' (each the higher of start and end);
    # the higher of the start's and the end's means is lower than that where they crossed.
    limits["both"] = (limits["backup"] + limits["load"]) / 2
    sweep.rows[:] = [_with_limits(r, limits) for r in sweep.rows]
    if sweep.on_row:
        sweep.on_row(sweep.rows, None, None, final=True, ends=ends)
