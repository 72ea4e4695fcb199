"""The cases and measurements of ``kvtier bench transfer``: pools, slots, clocks, limits, notes.

A :class:`Case` is one device pool and host pool of a kind, host layout and page size
(shapes: MHA llama-3-8b, MLA deepseek-v3, DSA glm-dsa); :func:`measure` times one direction
of its transfers through a :class:`~kvtier.transfer.TransferEngine` in GB/s, and
:func:`contiguous_limit` one large contiguous copy each way, the limit every row is a ratio to.
Without CUDA the limit is a CPU memcpy.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import click
import numpy as np
import torch

from ..device_pool import pool_from_spec
from ..host_pool import host_pool_for
from ..spec import preset
from ..transfer import TransferEngine
from ..transfer.online import DUPLEX, score

SHAPES = {"mha": "llama-3-8b", "mla": "deepseek-v3", "dsa": "glm-dsa"}
PAGE_SIZES = (1, 64, 16)  # the acceptance rows (1, 64) first
DIRECTIONS = ("backup", "load", "both")
HOST_SLOTS = ("allocator", "scattered")
# ``spread``: scattered pages of a host pool many times the transfer (``--spread-pool``), as a
# long-running cache's free pages are; not in the default table, as the GPU writes such pages
# slower (single tokens by the kernel: 0.914x from a 2x pool, 0.548x from an 8x one on an H200;
# docs/performance.md).
SLOT_KINDS = HOST_SLOTS + ("spread",)
SPREAD_POOL = 8
# A row whose first timed run takes longer than this is reported from that run alone.
SLOW_S = 0.5


@dataclass(frozen=True)
class Row:
    """One row of the table and the JSON: a transfer's GB/s, its limit's, and their ratio
    (``sms``: the SMs the backend used, 0 where none; the limit's own rows are kind ``all``)."""

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
        """Seconds of one call of ``fn``, waited for."""
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
        """The median of ``reps`` timings after ``warmup`` untimed runs; the first timing alone
        where it takes longer than ``SLOW_S``."""
        for _ in range(warmup):
            self.once(fn)
        first = self.once(fn)
        if first > SLOW_S:
            return first
        return float(np.median([first] + [self.once(fn) for _ in range(reps - 1)]))


def contiguous_limit(nbytes: int, clock: Clock, reps: int) -> dict[str, float]:
    """GB/s of one large contiguous copy each way (pinned host <-> device, or CPU memcpy).

    Keys ``backup``, ``load`` and ``duplex`` (both directions at once on two streams). The
    best of at least five copies after two untimed ones: a physical ceiling, so one slow
    copy (clocks still rising) must not lower it and flatter every ratio.
    """
    reps = max(reps, 5)
    if not clock.cuda:
        # The best as on CUDA: a single timing of a few MB (--quick, one rep) reads anywhere from
        # 0.4 to 1.3 GB/s on a CI core where the copy runs at 25-85, and every ratio swings with it.
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
    """Token slots of ``n_pages`` pages of ``page_size``: from ``host_pool``'s allocator where it
    is given and not ``scattered``, else whole pages drawn by ``rng`` from ``pages`` pages."""
    if host_pool is not None and not scattered:
        return host_pool.alloc(n_pages * page_size)
    chosen = rng.permutation(pages)[:n_pages]
    return torch.from_numpy((chosen[:, None] * page_size + np.arange(page_size)).reshape(-1).astype(np.int64))


class Case:
    """One pool pair (kind, layout, page size) and its transfers: a device pool of twice the
    transfer (``tokens`` rounded down to whole pages), filled with random bytes, and a host pool
    of as many slots (``host``); ``layers``, where given, replaces the shape's layer count."""

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
    """A spec's dataclass fields, by name (to build one like it)."""
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
    # A backup and a load at once vary more between timings (by up to 0.24x of the limit on an
    # H200): their median takes at least five.
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
    """``event``, once it has fired."""
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
    (a CPU's quick run measures ~0.15 GB/s, and two decimals would put its ratios off by 3%)."""
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


# -- kvtier bench vllm-worker: the vLLM spec's worker on blocks in vLLM's KV layout ----------------

def _vllm_blocks(layers: int, blocks: int, heads: int, block_size: int, head_dim: int, dtype, device):
    """vLLM 0.32's KV cache as allocated for offloading (``LBHNC``: one buffer, per layer a
    ``(num_blocks, heads, block_size, 2 * head_dim)`` view), random, and the worker's int8 views."""
    buf = torch.empty((layers, blocks, heads, block_size, 2 * head_dim), dtype=dtype, device=device)
    buf.view(torch.uint8).random_(0, 256)
    return buf, [buf[i].view(torch.int8).view(blocks, -1) for i in range(layers)]


@click.command("vllm-worker")
@click.option("--layers", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--kv-heads", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--head-dim", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--block-size", type=click.IntRange(min=1), default=16, show_default=True,
              help="tokens per vLLM block (FlashAttention's default)")
@click.option("--dtype", default="bf16", show_default=True)
@click.option("--blocks", type=click.IntRange(min=1), default=1024, show_default=True,
              help="blocks per transfer: scattered on the device, host chunks as the manager hands them out")
@click.option("--io-backend", default=None, help="direct | kernel | dma | auto (default: auto on CUDA)")
@click.option("--reps", type=click.IntRange(min=1), default=5, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="write the rows as JSON")
def vllm_worker(layers, kv_heads, head_dim, block_size, dtype, blocks, io_backend, reps, json_path) -> None:
    """GB/s of kvtier's vLLM spec worker storing and loading blocks in vLLM's KV layout, against one
    contiguous copy of the same bytes each way in the same run (the limit); checks every byte."""
    import itertools
    from collections import namedtuple

    from ..commands import write_json
    from ..integrations.vllm import KvtierPages, KvtierWorker
    from ..spec import parse_dtype

    cuda = torch.cuda.is_available()
    try:
        dt = parse_dtype(dtype)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--dtype") from None
    buf, views = _vllm_blocks(layers, 2 * blocks, kv_heads, block_size, head_dim, dt, "cuda" if cuda else "cpu")
    worker = KvtierWorker(views, 1, blocks, io_backend)
    gpu = namedtuple("GPULoadStoreSpec", "block_ids group_sizes block_indices")  # vLLM's fields
    perm = torch.randperm(2 * blocks, generator=torch.Generator().manual_seed(0)).tolist()
    src, dst, host = perm[:blocks], perm[blocks:], KvtierPages(range(blocks))
    jobs, clock = itertools.count(), Clock(cuda)

    def move(store: bool, dev) -> None:
        job = next(jobs)
        (worker.submit_store(job, gpu(dev, [blocks], [0]), host) if store
         else worker.submit_load(job, host, gpu(dev, [blocks], [0])))
        worker.wait({job})
        worker.get_finished()
    nbytes = blocks * layers * views[0].shape[1]
    limit = contiguous_limit(nbytes, clock, reps)
    warmup = max(1, getattr(worker.mover.engine.backend, "settling_transfers", 1))
    rows = [{"direction": name, "backend": worker.mover.engine.io_backend, "gib": nbytes / 2**30,
             "gbps": (g := nbytes / clock.median(lambda: move(store, src), reps, warmup) / 1e9),
             "limit_gbps": limit[key], "ratio": g / limit[key]}
            for name, store, key in (("store", True, "backup"), ("load", False, "load"))]
    move(False, dst)
    exact = bool(torch.equal(buf[:, dst].view(torch.uint8), buf[:, src].view(torch.uint8)))  # bytes: NaNs too
    worker.shutdown()
    click.echo(f"vLLM worker, {layers} layers x {kv_heads} KV heads x {head_dim} ({dtype}), {block_size}-token "
               f"blocks: {blocks} blocks ({nbytes / 2**30:.2f} GiB) a transfer, {'CUDA' if cuda else 'CPU'}")
    for r in rows:
        click.echo(f"  {r['direction']:<6} {r['backend']:<7} {r['gbps']:7.2f} GB/s   contiguous limit "
                   f"{r['limit_gbps']:7.2f} GB/s   ratio {r['ratio']:.3f}")
    click.echo(f"  bytes after a store and a load: {'exact' if exact else 'DIFFERENT'}")
    if json_path:
        write_json(json_path, {"rows": rows, "bytes_exact": exact, "cuda": cuda}, indent=2)
    if not exact:
        raise SystemExit(1)
