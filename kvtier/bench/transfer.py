"""``kvtier bench transfer``: every backend against the contiguous-copy limit of the same run.

For MHA (llama-3-8b), MLA (deepseek-v3) and DSA (glm-dsa), page sizes 1, 16
and 64, every host layout, host slots as the allocator hands them out and
scattered, it times an all-layer backup, a per-layer load and both at once
through :class:`~kvtier.transfer.TransferEngine`, and reports GB/s, the ratio
to one large contiguous copy in the same direction, and the SMs used.
Without CUDA the limit is a CPU memcpy and only ``direct`` runs.
"""

from __future__ import annotations

import gc
import json
import math
import time
import zlib
from collections import Counter
from dataclasses import asdict, dataclass

import click
import numpy as np
import torch
from tqdm import tqdm

from ..commands import FIGURE_PATH, OUTPUT_PATH, distinct_outputs
from ..device_pool import pool_from_spec
from ..host_pool import host_pool_for
from ..layouts import SUPPORTED
from ..memory import LIMIT_ENV, RESERVE_ENV, check_host_memory, huge_pages_default, huge_pages_note
from ..spec import preset
from ..transfer import TransferEngine
from ..transfer.base import IO_BACKENDS
from .targets import ratio_text
from ..transfer.online import DUPLEX, score

SHAPES = {"mha": "llama-3-8b", "mla": "deepseek-v3", "dsa": "glm-dsa"}
PAGE_SIZES = (1, 64, 16)  # the acceptance rows (1, 64) first
DIRECTIONS = ("backup", "load", "both")
HOST_SLOTS = ("allocator", "scattered")
# ``spread``: scattered pages of a host pool many times the transfer (``--spread-pool``), as a
# long-running cache's free pages are; not in the default table (H200 runs 106-107: the GPU
# writes such pages slower, single tokens by the kernel 0.914x -> 0.548x from a pool 2x to 8x).
SLOT_KINDS = HOST_SLOTS + ("spread",)
SPREAD_POOL = 8
# A row whose first timed run takes longer than this is reported from that run alone.
SLOW_S = 0.5


@dataclass(frozen=True)
class Row:
    kind: str
    layout: str
    page_size: int
    direction: str
    backend: str
    host_slots: str
    gbps: float
    limit_gbps: float
    ratio: float
    sms: int


class Clock:
    """Times ``fn`` (which queues work) by device events on CUDA, wall clock on the CPU."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def once(self, fn) -> float:
        if not self.cuda:
            t = time.perf_counter()
            fn()
            return time.perf_counter() - t
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1e3

    def best(self, fn, reps: int, warmup: int) -> float:
        """The shortest of ``reps`` timings after ``warmup`` untimed runs: for a ceiling."""
        for _ in range(warmup):
            self.once(fn)
        return min(self.once(fn) for _ in range(reps))

    def median(self, fn, reps: int, warmup: int) -> float:
        for _ in range(warmup):
            self.once(fn)
        first = self.once(fn)
        if first > SLOW_S:
            return first
        return float(np.median([first] + [self.once(fn) for _ in range(reps - 1)]))


def contiguous_limit(nbytes: int, clock: Clock, reps: int) -> dict[str, float]:
    """GB/s of one large contiguous copy each way (pinned host <-> device, or CPU memcpy).

    On CUDA the best of at least five copies after two untimed ones: a physical
    ceiling, so one slow copy (clocks still rising) must not lower it and
    flatter every ratio (H200 run 14: a median of three gave 53.5 GB/s host to
    device where a probe on the same machine gave 55.2).
    """
    reps = max(reps, 5)
    if not clock.cuda:
        # The best as on CUDA: one timing of a few MB (--quick, one rep) read anywhere from 0.4
        # to 1.3 GB/s on a CI core where the copy runs at 25-85, and every ratio swung with it.
        a, b = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        a.fill_(7)
        t = clock.best(lambda: b.copy_(a), reps, 2)
        return {"backup": nbytes / t / 1e9, "load": nbytes / t / 1e9, "duplex": nbytes / t / 1e9}
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    d2h = clock.best(lambda: host.copy_(dev, non_blocking=True), reps, 2)
    h2d = clock.best(lambda: dev.copy_(host, non_blocking=True), reps, 2)
    # Both directions at once on two streams: what the link gives full-duplex.
    host2 = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev2 = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    streams = (torch.cuda.Stream(), torch.cuda.Stream())

    def both():
        cur = torch.cuda.current_stream()
        for s in streams:
            s.wait_stream(cur)
        with torch.cuda.stream(streams[0]):
            host.copy_(dev, non_blocking=True)
        with torch.cuda.stream(streams[1]):
            dev2.copy_(host2, non_blocking=True)
        for s in streams:
            cur.wait_stream(s)
    duplex = clock.best(both, reps, 2)
    return {"backup": nbytes / d2h / 1e9, "load": nbytes / h2d / 1e9, "duplex": 2 * nbytes / duplex / 1e9}


def parse_backend(spec: str) -> tuple[str, int | None]:
    """``kernel@64`` -> ("kernel", 64): a backend with its own block quota."""
    name, at, quota = spec.partition("@")
    if at and not (quota.isdigit() and int(quota) > 0):
        raise click.BadParameter(f"backend {spec!r}: the part after @ must be a block count of 1 or more "
                                 f"(e.g. {name}@32), or leave out the @", param_hint="--backend")
    return name, int(quota) if quota else None


def slots(pages: int, page_size: int, n_pages: int, rng, scattered: bool, host_pool=None) -> torch.Tensor:
    if host_pool is not None and not scattered:
        return host_pool.alloc(n_pages * page_size)
    chosen = rng.permutation(pages)[:n_pages]
    return torch.from_numpy((chosen[:, None] * page_size + np.arange(page_size)).reshape(-1).astype(np.int64))


class Case:
    """One pool pair (kind, layout, page size) and its transfers."""

    def __init__(self, kind: str, layout: str, page_size: int, tokens: int, device: str, layers: int | None):
        self.kind, self.layout = kind, layout
        spec = preset(SHAPES[kind])
        if layers:
            spec = type(spec)(**{**asdict_spec(spec), "layer_num": layers})
        self.tokens = tokens - tokens % page_size
        self.dev = pool_from_spec(spec, 2 * self.tokens, page_size, device)
        for stack in self.dev.stacks.values():
            stack.view(torch.uint8).random_(0, 256)
        self.host = self.spread_host(2)
        self.nbytes = self.tokens * spec.bytes_per_token

    def indices(self, scattered: bool, rng, host=None):
        """``(h1, d1, h2, d2)``: two transfers' slot pairs (a pair of transfers is timed as
        ``both``), host slots in ``host`` (default the case's pool) as its allocator hands them
        out or scattered pages drawn from all of it, device slots scattered."""
        host = self.host if host is None else host
        ps, n_pages = self.dev.page_size, self.tokens // self.dev.page_size
        host.clear()
        h1 = slots(host.page_num, ps, n_pages, rng, scattered, host)
        if scattered:
            rest = np.setdiff1d(np.arange(host.page_num), (h1[::ps] // ps).numpy())
            h2 = torch.from_numpy((rng.permutation(rest)[:n_pages, None] * ps + np.arange(ps)).reshape(-1))
        else:  # the second transfer of "both" gets the allocator's next run, as a cache would
            h2 = host.alloc(n_pages * ps)
        d = slots(self.dev.size // ps, ps, 2 * n_pages, rng, True)
        return h1, d[: self.tokens], h2, d[self.tokens:]

    def spread_host(self, span: int):
        """A host pool ``span`` times the transfer, unchecked indices (the case's own: 2; for
        ``spread`` slots, more, and the caller closes it)."""
        return host_pool_for(self.dev, self.layout, host_size_tokens=span * self.tokens, validate_indices=False)


def asdict_spec(spec) -> dict:
    return {f: getattr(spec, f) for f in spec.__dataclass_fields__}


def measure(case: Case, engine: TransferEngine, direction: str, idx, clock: Clock, reps: int,
            pair_log: list | None = None) -> float:
    """GB/s of ``direction`` (``both``: the two transfers' bytes over the pair's time).
    ``pair_log`` (CUDA, ``both``): gets each pair's timeline (:func:`pair`)."""
    h1, d1, h2, d2 = idx
    cuda = clock.cuda

    def backup():
        hd = engine.backup(h1, d1)
        hd.wait() if cuda else None

    def load():
        ld = engine.load(h1, d1)
        ld.wait_layer(ld.layer_num - 1) if cuda else None

    def both():
        pair(engine, h1, d1, h2, d2, cuda, pair_log)
    fn = {"backup": backup, "load": load, "both": both}[direction]
    # auto is timed once its choice for the shape is made: the exploring transfers
    # are a one-off cost per shape, not its steady speed.
    # A backup and a load at once vary more from run to run (H200 runs 15-16: up to 0.24x
    # of the limit with the code unchanged): their median takes at least five.
    n = max(reps, 5) if direction == "both" else reps
    warmup = max(1, getattr(engine.backend, "settling_transfers", 1))
    logged = len(pair_log) if pair_log is not None else 0
    t = clock.median(fn, n, warmup)
    if pair_log is not None:  # the timeline of the timed pairs only, not the untimed ones before
        del pair_log[logged:logged + warmup]
    return (2 if direction == "both" else 1) * case.nbytes / t / 1e9


def host_bytes_needed(kinds, tokens: int, slots, spread: int, layers: int | None, cuda: bool) -> tuple[int, str]:
    """The most host memory one case of the bench holds at once, and which kind that is: its
    host pool (twice the transfer), a ``spread`` pool while those rows run, and without CUDA
    its device pool (twice the transfer) too; the first case also the contiguous limit's two
    host buffers of one transfer each, timed while its pools exist. Cases run one after
    another, each freed after."""
    spans = 2 + (spread if "spread" in slots else 0) + (0 if cuda else 2)
    specs = {k: preset(SHAPES[k]) for k in kinds}
    need = {k: s.bytes_per_token_per_layer * (layers or s.layer_num) * tokens * (spans + 2 * (k == kinds[0]))
            for k, s in specs.items()}
    kind = max(need, key=need.get)
    return need[kind], kind


BENCH_FIX = ("Time fewer tokens (--tokens), a smaller --spread-pool or no --slots spread, or lower the reserve "
             f"({RESERVE_ENV}); where the OS reports less memory than the machine can take (a VM whose memory "
             f"grows as it is used), set {LIMIT_ENV} to what this process may use.")


def run_bench(tokens: int, reps: int, backends: tuple[str, ...], kinds, page_sizes, layers, progress=True,
              on_row=None, rounds: int = 1, layouts=None, slots=HOST_SLOTS, spread: int = SPREAD_POOL) -> list[Row]:
    """Time every combination; ``on_row(rows, groups, picks)`` is called after each row (partial
    results survive), and once more with ``final=True`` when the limits, measured again at
    the end (the higher of the two counts), have been applied to every row's ratio, with
    ``ends``: per limit, what the start and the end measured (a link that drifts shows there).

    ``groups`` is the layers-per-copy of a DMA load row (None otherwise), ``picks`` what auto
    chose during the row (``{(direction, backend): transfers}``, warm-up included), for the log;
    ``samples`` the timed samples auto holds for the shapes the row added to (:func:`sample_note`).
    ``rounds``: each case's backends and directions are timed that many times over, in turn
    (:func:`round_order`), and a row is the median of its rounds (``on_row`` also gets them,
    ``rounds=[GB/s, ...]``; and ``huge``, the share of the case's host pool in huge pages, where
    it asked for them). The same backend timed twice in one H200 run moved by up to 0.085x
    one way and 0.13x for a backup and a load at once, and pairs drifted down as a case was
    timed (run 30: the second timing 0.05x lower, median): rounds spread that over every
    backend alike.
    ``layouts``: only these host layouts (None: every one each kind supports); ``slots``: which
    host slots, ``allocator``, ``scattered`` and/or ``spread`` (scattered pages of a host pool
    ``spread`` times the transfer, made for those rows). Each case and kind of host slots draws its
    device slots (and scattered host pages) from its own seed, so a row is timed on the same
    slots whichever others run with it.
    """
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    backends = backends if cuda else ("direct",)
    clock = Clock(cuda)
    combos = [(k, lay, ps) for k in kinds for lay in SUPPORTED[k] if layouts is None or lay in layouts
              for ps in page_sizes]
    total = len(combos) * len(slots) * len(DIRECTIONS) * len(backends) * rounds
    rows: list[Row] = []
    bar = tqdm(total=total, desc="bench transfer", disable=not progress)
    limits = None
    for kind, layout, ps in combos:
        case = Case(kind, layout, ps, tokens, device, layers)
        if limits is None:
            nbytes = case.nbytes
            limits = contiguous_limit(nbytes, clock, reps)
            limits["both"] = (limits["backup"] + limits["load"]) / 2
            for direction, key in (("backup", "backup"), ("load", "load"), ("both", "duplex")):
                rows.append(Row("all", "contiguous", 0, direction, "contiguous", "contiguous",
                                _gb(limits[key]), _gb(limits[direction]),
                                round(limits[key] / limits[direction], 3), 0))
        for which in [h for h in SLOT_KINDS if h in slots]:
            host = case.spread_host(spread) if which == "spread" else case.host
            # Whether the host pool got the huge pages it asked for: the kernel's rows depend
            # on it, and a process that has made and dropped many pools might get fewer.
            huge = host.huge_page_share() if host.huge_pages else None
            idx = case.indices(which != "allocator", np.random.default_rng(zlib.crc32(f"{kind}/{layout}/{ps}/{which}".encode())),
                               host)
            # one copy per slot and layer: minutes, and says nothing new
            timed = [b for b in backends if not (cuda and b == "direct" and ps == 1)]
            bar.update(len(DIRECTIONS) * rounds * (len(backends) - len(timed)))
            engines = {}
            for b in timed:
                name, quota = parse_backend(b)
                engines[b] = TransferEngine(host, name, block_quota=quota)
            got: dict[tuple[str, str], list[float]] = {}
            picks: dict[tuple[str, str], Counter] = {}
            last: dict[tuple[str, str], tuple] = {}
            for rnd in range(rounds):
                for backend in round_order(list(engines), rnd):
                    engine = engines[backend]
                    for direction in DIRECTIONS:
                        bar.set_postfix_str(f"{kind} {layout} p{ps} {direction} {backend}")
                        before = Counter(getattr(engine.backend, "picks", {}))
                        seen = sample_counts(engine.backend)
                        pair_log = [] if (cuda and direction == "both" and rnd == rounds - 1) else None
                        got.setdefault((backend, direction), []).append(measure(case, engine, direction, idx,
                                                                                clock, reps, pair_log))
                        picks[(backend, direction)] = (picks.get((backend, direction), Counter())
                                                       + (Counter(getattr(engine.backend, "picks", {})) - before))
                        bar.update()
                        if rnd == rounds - 1:  # what the row reports, besides its GB/s
                            last[(backend, direction)] = (
                                getattr(engine.backend, "last_blocks", 0),
                                load_groups(engine.backend) if direction == "load" else None,
                                sample_note(engine.backend, seen), pair_note(pair_log or []))
            # Rows in the backends' given order, whatever order the last round ran in.
            for backend in engines:
                for direction in DIRECTIONS:
                    g = got[(backend, direction)]
                    sms, groups, samples, pair = last[(backend, direction)]
                    gbps, lim = float(np.median(g)), limits[direction]
                    rows.append(Row(kind, layout, ps, direction, backend, which,
                                    _gb(gbps), _gb(lim), round(gbps / lim, 3), sms))
                    if on_row:
                        extra = {"rounds": [round(x, 2) for x in g]} if rounds > 1 else {}
                        if pair:
                            extra["pair"] = pair
                        if huge is not None:
                            extra["huge"] = huge
                        on_row(rows, groups, picks[(backend, direction)], samples=samples, **extra)
            if host is not case.host:
                host.close()
            # Dropped now, not when the names are next bound: the up-front memory check counts
            # one case's pools at a time.
            host = engines = engine = None
        case.host.close()
        del case
        # And whatever a cycle still holds. Until f5f2f9c a TransferEngine's backlog held it in
        # one, so each case's pools lived on until the collector ran (H200 runs 113 and 116:
        # MHA's 34 GB spread pool refused, ~78 GB of earlier cases still resident).
        gc.collect()
    bar.close()
    if cuda and rows:
        # Measured again at the end; the higher of the two is the run's limit.
        again = contiguous_limit(nbytes, clock, reps)
        again["both"] = (again["backup"] + again["load"]) / 2
        ends = {key: (round(limits[key], 2), round(again[key], 2)) for key in limits}
        for key in ("backup", "load", "duplex"):
            limits[key] = max(limits[key], again[key])
        # A pair's limit is the mean of the two directions' (each the higher of start and end);
        # the higher of the start's and the end's means is lower than that where they crossed.
        limits["both"] = (limits["backup"] + limits["load"]) / 2
        rows[:] = [_with_limits(r, limits) for r in rows]
        if on_row:
            on_row(rows, None, None, final=True, ends=ends)
    return rows


def pair(engine: TransferEngine, h1, d1, h2, d2, cuda: bool, log: list | None = None) -> None:
    """A backup and a load at once, as the bench's ``both`` times them. ``log`` (CUDA): gets
    the pair's timeline, for :func:`pair_note`: the host's milliseconds after the backup call
    when ``backup()`` and ``load()`` returned and when the backup was wholly queued, and timing
    events recorded on the engine's streams once each transfer is queued, so they fire at its
    end. What a pair's GB/s cannot say: whether the two ran side by side."""
    timed = cuda and log is not None
    if timed:
        start = torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    hd = engine.backup(h1, d1)
    t1 = time.perf_counter()
    ld = engine.load(h2, d2)
    t2 = time.perf_counter()
    if not cuda:
        return
    hd.wait()
    t3 = time.perf_counter()
    ld.wait_layer(ld.layer_num - 1)
    if timed:
        ends = {}
        for name, stream in (("backup_done", engine.backup_stream), ("load_done", engine.load_stream)):
            ends[name] = torch.cuda.Event(enable_timing=True)
            ends[name].record(stream)
        ms = lambda t: round(1e3 * (t - t0), 3)  # noqa: E731
        log.append({"backup_returned": ms(t1), "load_returned": ms(t2), "backup_queued": ms(t3),
                    "_start": start, **ends})


def pair_note(log: list[dict]) -> str:
    """Medians over the pairs of :func:`pair` (their events must have fired): host
    milliseconds, then each transfer's end on the device, after the backup call."""
    if not log:
        return ""
    # The bench waited for both transfers, but an end event recorded after one may still be
    # a few microseconds from firing.
    rows = [{k: (round(_synced(x["_start"]).elapsed_time(_synced(v)), 3) if k.endswith("_done") else v)
             for k, v in x.items() if k != "_start"} for x in log]
    return " ".join(f"{k} {float(np.median([r[k] for r in rows])):.2f}" for k in rows[0])


def _synced(event):
    event.synchronize()
    return event


def round_order(backends: list[str], rnd: int) -> list[str]:
    """The order backends are timed in round ``rnd``: as given, then reversed, alternately, so
    a drift through a case's timings weighs on each backend alike over two rounds."""
    return backends if rnd % 2 == 0 else backends[::-1]


def _with_limits(r: Row, limits: dict) -> Row:
    """``r`` against ``limits``; the contiguous rows (kind "all") take the limits themselves."""
    gbps = _gb(limits[{"both": "duplex"}.get(r.direction, r.direction)]) if r.kind == "all" else r.gbps
    lim = _gb(limits[r.direction])
    return Row(r.kind, r.layout, r.page_size, r.direction, r.backend, r.host_slots, gbps, lim, round(gbps / lim, 3), r.sms)


def _gb(x: float) -> float:
    """GB/s as a row reports it: two decimals, or four significant digits where that is more
    (a CPU's quick run measures ~0.15 GB/s, and two decimals put its ratios off by 3%)."""
    return round(x, max(2, 3 - math.floor(math.log10(x)))) if x > 0 else x


def sample_counts(backend) -> dict:
    """How many timed samples auto's chooser holds per shape and candidate (empty for others)."""
    chooser = getattr(backend, "chooser", None)
    if chooser is None:
        return {}
    return {key: {c: len(v) for c, v in by.items()} for key, by in list(chooser.samples.items())}


def sample_note(backend, before: dict) -> str:
    """The samples of every shape that gained some since ``before`` (:func:`sample_counts`):
    ``backup/duplex dma:4@41.2 kernel:3@49.8`` is direction, whether the link was shared,
    and per candidate the count and score in GB/s (:func:`~kvtier.transfer.online.score`:
    the second best of three or more): what auto's picks were made from."""
    chooser = getattr(backend, "chooser", None)
    if chooser is None:
        return ""
    now = sample_counts(backend)
    out = []
    for key, by in list(chooser.samples.items()):
        if now.get(key) == before.get(key):
            continue
        head = ("backup" if key[0] else "load") + ("/duplex" if key[-1] == DUPLEX else "")
        out.append(head + " " + " ".join(f"{c}:{len(v)}@{score(v):.1f}" for c, v in sorted(by.items()) if v))
    return "; ".join(out)


def load_groups(backend) -> list[int] | None:
    """Layers per copy of the last DMA load (auto: when it chose DMA), for the log."""
    if getattr(backend, "name", "") == "auto":
        if "dma" not in getattr(backend, "last_choice", []):
            return None
        backend = backend.dma
    return getattr(backend, "last_groups", None)


def table(rows: list[Row]) -> str:
    """Every row, a column per backend (a blank where a row has none); the contiguous limit's
    rows first, under the first column."""
    names = list(dict.fromkeys(r.backend for r in rows if r.kind != "all"))
    head = f"{'kind':4} {'layout':11} {'page':>4} {'direction':9} {'slots':9} " + " ".join(f"{b:>15}" for b in names)
    lines = [head]
    keyed: dict[tuple, dict[str, Row]] = {}
    for r in rows:
        keyed.setdefault((r.kind, r.layout, r.page_size, r.direction, r.host_slots), {})[r.backend] = r
    cell = lambda r: f"{r.gbps:7.1f} {ratio_text(r.gbps / r.limit_gbps):>6}x"  # noqa: E731
    for (k, lay, ps, d, s), by in keyed.items():
        cols = [cell(r) for r in by.values()] if k == "all" else [cell(by[b]) if b in by else f"{'-':>15}"
                                                                   for b in names]
        lines.append(f"{k:4} {lay:11} {ps:>4} {d:9} {s:9} " + " ".join(cols))
    return "\n".join(lines)


@click.command("transfer")
@click.option("--tokens", type=int, default=8192, show_default=True, help="tokens per transfer")
@click.option("--reps", type=int, default=3, show_default=True, help="timed runs per row (median; at least 5 for backup and load at once)")
@click.option("--rounds", type=int, default=1, show_default=True,
              help="time each case's backends and directions this many times over, in turn (every other round in reverse); a row is the median (of two rounds: their mean)")
@click.option("--backend", "backends", multiple=True, default=("direct", "kernel", "dma", "auto"),
              show_default=True, help="backends to time (CUDA); only direct runs on the CPU")
@click.option("--kind", "kinds", multiple=True, default=tuple(SHAPES), show_default=True)
@click.option("--page-size", "page_sizes", multiple=True, type=click.IntRange(min=1), default=PAGE_SIZES,
              show_default=True)
@click.option("--layout", "layouts", multiple=True,
              help="host layouts to time (default: every one each kind supports)")
@click.option("--slots", multiple=True, type=click.Choice(SLOT_KINDS), default=HOST_SLOTS, show_default=True,
              help="host slots as the allocator hands them out, scattered pages (of a pool twice the transfer), "
                   "and/or spread: scattered pages of a pool --spread-pool times the transfer")
@click.option("--spread-pool", "spread", type=int, default=SPREAD_POOL, show_default=True,
              help="host pool size, in transfers, for --slots spread")
@click.option("--quick", is_flag=True, help="tiny shapes (4 layers, 256 tokens): a smoke test for CI")
@click.option("--verbose", is_flag=True, help="print every row as it is measured")
@click.option("--json", "json_path", type=OUTPUT_PATH, help="write the rows as JSON here")
@click.option("--plot", "plot_path", type=FIGURE_PATH,
              help="draw every row's ratio against the targets here (PNG)")
def transfer(tokens, reps, rounds, backends, kinds, page_sizes, layouts, slots, spread, quick, verbose, json_path,
             plot_path):
    """Transfer bandwidth of every backend, kind, layout and page size, as a ratio to the limit."""
    # A flag given twice times its cases once (twice, the progress bar stopped short and the JSON
    # held the rows twice).
    backends, kinds, page_sizes, layouts, slots = (tuple(dict.fromkeys(x))
                                                   for x in (backends, kinds, page_sizes, layouts, slots))
    if quick:
        given = [f"--{n}" for n in ("tokens", "reps") if click.get_current_context().get_parameter_source(n)
                 is not click.core.ParameterSource.DEFAULT]
        if given:
            raise click.BadParameter(f"--quick times 256 tokens once; leave out {' and '.join(given)}",
                                     param_hint="--quick")
        tokens, reps = 256, 1
    distinct_outputs(json=json_path, plot=plot_path)
    for b in backends:
        if parse_backend(b)[0] not in IO_BACKENDS:
            raise click.BadParameter(f"unknown backend {b!r}; use one of {list(IO_BACKENDS)} (kernel@N: N blocks)",
                                     param_hint="--backend")
    given = click.get_current_context().get_parameter_source("backends") is not click.core.ParameterSource.DEFAULT
    if given and not torch.cuda.is_available() and (gpu_only := [b for b in backends if parse_backend(b)[0] != "direct"]):
        raise click.BadParameter(f"{', '.join(gpu_only)} need{'s' if len(gpu_only) == 1 else ''} CUDA, which this "
                                 "torch does not have; without it only --backend direct runs (the default here)",
                                 param_hint="--backend")
    for k in kinds:
        if k not in SHAPES:
            raise click.BadParameter(f"unknown kind {k!r}; use one of {list(SHAPES)}", param_hint="--kind")
    for lay in layouts:
        if not any(lay in SUPPORTED[k] for k in kinds):
            have = "; ".join(f"{k}: {', '.join(SUPPORTED[k])}" for k in kinds)
            raise click.BadParameter(f"host layout {lay!r} is not one that --kind {', '.join(kinds)} supports "
                                     f"({have}); pass one of those, or add a kind that has it", param_hint="--layout")
    if tokens < 64 or reps < 1:
        raise click.BadParameter(f"need --tokens >= 64 and --reps >= 1, got {tokens} and {reps}")
    if odd := [ps for ps in page_sizes if tokens % ps]:
        if quick:
            raise click.BadParameter(f"--quick moves 256 tokens a transfer, not a whole number of pages of "
                                     f"{odd[0]}; use page sizes that divide 256", param_hint="--page-size")
        every = math.lcm(*page_sizes)
        fit = max(tokens // every * every, every)
        raise click.BadParameter(f"--tokens {tokens} is not a whole number of pages of --page-size {odd[0]}: a "
                                 f"transfer moves whole pages; use a multiple of every page size (such as {fit})",
                                 param_hint="--tokens")
    if rounds < 1:
        raise click.BadParameter(f"need --rounds >= 1 (1: each row timed once), got {rounds}", param_hint="--rounds")
    if spread < 2:
        raise click.BadParameter(f"need --spread-pool >= 2 (the pool holds both transfers of a pair), got {spread}",
                                 param_hint="--spread-pool")
    layers = 4 if quick else None
    huge_pages_default()  # a bad KVTIER_HOST_HUGE_PAGES is refused now, not at the first case's pool
    # Before any pool is made: the largest case must fit (cases run one at a time).
    need, big = host_bytes_needed(kinds, tokens, slots, spread, layers, torch.cuda.is_available())
    try:
        check_host_memory(need, None, f"the {big.upper()} case ({tokens} tokens a transfer, pools "
                          f"{'2x' + (f' and {spread}x' if 'spread' in slots else '')} the transfer)", BENCH_FIX)
    except MemoryError as e:
        raise click.UsageError(str(e)) from None
    start = time.perf_counter()

    def save(rows, groups=None, picks=None, final=False, samples="", rounds=None, pair="", huge=None, ends=None):
        if verbose and final:
            lim = {r.direction: r.gbps for r in rows if r.kind == "all"}
            click.echo(f"limits, best of the start and the end of the run: {lim}; (start, end): {ends}", err=True)
        elif verbose:
            r = rows[-1]
            extra = f" layers/copy={groups}" if groups else ""
            if picks:
                extra += " picks=" + ",".join(f"{d}:{c}x{n}" for (d, c), n in sorted(picks.items()))
            if samples:
                extra += f" samples=[{samples}]"
            if rounds:
                extra += f" rounds={rounds}"
            if pair:
                extra += f" pair_ms=[{pair}]"
            if huge is not None:
                extra += f" host_huge={huge:.0%}"
            click.echo(f"[{time.perf_counter() - start:6.1f}s] {r.kind} {r.layout} p{r.page_size} {r.direction} "
                       f"{r.host_slots} {r.backend}: {r.gbps} GB/s ({r.ratio}x) sms={r.sms}{extra}", err=True)
        if json_path:
            with open(json_path, "w") as f:
                json.dump([asdict(r) for r in rows], f, indent=1)

    rows = run_bench(tokens, reps, tuple(backends), kinds, page_sizes, layers, on_row=save, rounds=rounds,
                     layouts=set(layouts) or None, slots=tuple(slots), spread=spread)
    if verbose and torch.cuda.is_available():
        from ..transfer.base import get_backend
        for key, rate in get_backend("dma", torch.device("cuda")).group_rates.items():
            pl, group = key[0], key[-1]
            click.echo(f"trial load, {pl.layer_num} layers of {pl.chunk_bytes} B rows {pl.token} B apart, "
                       f"{2 ** key[2] // 2}+ slots, {group} layers per copy: {rate:.1f} GB/s", err=True)
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    click.echo(f"\n{dev}, {tokens} tokens per transfer; cells are GB/s and ratio to the contiguous limit")
    click.echo(huge_pages_note())
    click.echo(table(rows))
    if json_path:
        click.echo(f"wrote {len(rows)} rows to {json_path}")
    if plot_path:
        from .transfer_plot import plot_transfer
        plot_transfer(rows, plot_path, f"kvtier bench transfer: {dev}, {tokens} tokens per transfer")
        click.echo(f"wrote the figure to {plot_path}")
