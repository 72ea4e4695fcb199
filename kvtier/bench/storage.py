"""``kvtier bench storage``: a store's put and get GB/s through kvtier, against the same store
driven without kvtier (the backend's :meth:`~kvtier.storage.StorageBackend.raw_baseline`: for
files, plain open/write/read of the same bytes in the same directory), in the same run.

Ops, each timed over the same pages and divided by the raw store's put or get:

- ``put``: seal each page (its header; the checksum comes from the copy that encoded it, see
  ``encode``) and store it, in one call as the tier writes a save;
- ``get``: read each page back and verify it (header, key, salt, checksum), as a prefetch does
  before writing pages into the host pool (``StorageTier.read_blobs``: a batch ahead, a page per
  worker thread);
- ``save`` / ``prefetch``: the whole tier, from host pages to the store and back into host pages
  (``StorageTier.save`` + ``flush``, ``StorageTier.prefetch`` + ``wait``): the gather and scatter
  of the canonical page order included;
- ``encode``: the copy out of a host pool with the xxh3-64 checksum fused into it (what ``save``
  does), against the same copy without it; ``checksum``: xxh3-64 reading the blobs again, against
  a plain copy of them (``crc32``: zlib's, for scale).

Raw and kvtier alternate within each repeat (the order flipped every repeat), and both start
from a directory without the pages; ``--cold`` also writes the page cache back and drops it
(fdatasync + POSIX_FADV_DONTNEED on every file) before each read, for both.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
import zlib

import click
import numpy as np
import xxhash
from tqdm import tqdm

from ..commands import FIGURE_PATH, JSON_HELP, JSON_PATH, distinct_outputs, echo_for, write_json
from ..spec import PRESETS, preset
from ..storage import backend_class
from ..storage.format import HEADER_BYTES, PageCodec, StorageSalt, read_header, store_key
from ..storage.servers import StoreFor
from ..storage.tier import StorageTier, TierConfig

OPS = ("put", "get", "save", "prefetch")


class Case:
    """One backend and page size: the pages, the store, its raw twin, and a host pool for the tier."""

    def __init__(self, backend_name: str, workdir: str, model: str, page_size: int, pages: int, seed: int):
        spec = preset(model)
        self.salt = StorageSalt(spec, page_size, f"kvtier-bench/{model}")
        self.codec = PageCodec(self.salt)
        self.pages = pages
        self.chain = [seed.to_bytes(8, "little") + i.to_bytes(8, "little") for i in range(pages)]
        self.keys = [store_key(self.salt.fingerprint, c) for c in self.chain]
        rng = np.random.default_rng(seed)
        self.blobs = [rng.integers(0, 256, self.codec.blob_bytes, dtype=np.uint8) for _ in range(pages)]
        for key, blob in zip(self.keys, self.blobs):
            self.codec.seal(blob, key)
        self.sums = [read_header(b).checksum for b in self.blobs]   # as save() has them from its copy
        self.buffers = [np.empty(self.codec.blob_bytes, np.uint8) for _ in range(pages)]
        cls = backend_class(backend_name)
        self.store = StoreFor(backend_name, workdir, 2 * pages * self.codec.blob_bytes)
        self.config = self.store.config
        try:
            self.raw = cls.raw_baseline(self.config)
        except NotImplementedError:
            raise ValueError(f"backend {backend_name!r} has no raw_baseline to compare with; give it one "
                             "(kvtier.storage.StorageBackend.raw_baseline)") from None
        self.backend = cls(self.config)
        self.tier_config = TierConfig(max_pending_bytes=(pages + 1) * self.codec.blob_bytes)
        self.workdir = workdir
        self._host = None
        self._tier: StorageTier | None = None

    @property
    def nbytes(self) -> int:
        return self.pages * self.codec.blob_bytes

    def host(self):
        """A host pool holding the pages (built on first use), and its slots."""
        if self._host is None:
            from ..device_pool import pool_from_spec
            from ..host_pool import host_pool_for
            spec, ps = self.salt.spec, self.salt.page_size
            dev = pool_from_spec(spec, ps, ps)
            pool = host_pool_for(dev, "layer_first", host_size_tokens=2 * self.pages * ps)
            slots = pool.alloc(self.pages * ps)
            self.codec.scatter(pool, (slots[::ps] // ps).numpy(), [b[HEADER_BYTES:] for b in self.blobs])
            self._host = (pool, slots, pool.alloc(self.pages * ps))
        return self._host

    @property
    def tier(self) -> StorageTier:
        if self._tier is None:
            self._tier = StorageTier(self.backend, self.salt, self.tier_config)
        return self._tier

    def close(self) -> None:
        (self._tier or self.backend).close()
        self.raw.close()
        self.store.close()


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _cpu_ticks() -> tuple[int, int] | None:
    """(busy, all) clock ticks of every CPU since boot, from /proc/stat; None where there is none."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)   # less idle and iowait


def _seconds_busy(fn) -> tuple[float, float | None]:
    """Seconds of ``fn``, and the share of the machine's CPU time that was busy meanwhile (every
    process: a store's servers on the same machine count)."""
    a, s, b = _cpu_ticks(), _seconds(fn), _cpu_ticks()
    return s, (b[0] - a[0]) / (b[1] - a[1]) if a and b and b[1] > a[1] else None


def drop_page_cache(root: str) -> None:
    """Write every file under ``root`` back and drop it from the page cache."""
    for path, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(path, name), os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def kvtier_put(case: Case) -> None:
    for key, blob, checksum in zip(case.keys, case.blobs, case.sums):
        case.codec.seal(blob, key, None, checksum)
    if not all(case.backend.put(case.keys, case.blobs)):   # as the tier writes a save: one call
        raise click.ClickException(f"the {case.backend.name} store refused a page; check its space and --dir")


def kvtier_get(case: Case) -> None:
    for i, _, _, checks in case.tier.read_blobs(case.keys):
        if any(why is not None for why in checks):
            raise click.ClickException(f"a page read back failed its check: {next(w for w in checks if w)}")


def tier_save(case: Case) -> None:
    pool, slots, _ = case.host()
    if case.tier.save(case.chain, None, pool, slots) != case.pages or not case.tier.flush(600):
        raise click.ClickException("the tier dropped pages of the save; check --pages against memory")


def tier_prefetch(case: Case) -> None:
    pool, _, into = case.host()
    handle = case.tier.prefetch(case.chain, pool, into)
    if handle.wait(timeout=600) != case.pages:
        raise click.ClickException(f"prefetch loaded {handle.ready_pages()} of {case.pages} pages: {handle.outcome}")


def one_repeat(case: Case, cold: bool, flip: bool, with_tier: bool) -> dict[str, tuple[float, float]]:
    """Seconds of each op and of the raw put or get it is compared with."""
    raw, out = {}, {}

    def raw_side():
        case.raw.delete(case.keys)
        raw["put"] = _seconds_busy(lambda: case.raw.put(case.keys, case.blobs))
        if cold:
            drop_page_cache(case.workdir)
        raw["get"] = _seconds_busy(lambda: case.raw.get(case.keys, [memoryview(b) for b in case.buffers]))

    def kvtier_side():
        case.backend.delete(case.keys)
        out["put"] = _seconds(lambda: kvtier_put(case))
        if cold:
            drop_page_cache(case.workdir)
        out["get"] = _seconds(lambda: kvtier_get(case))
        if with_tier:
            case.backend.delete(case.keys)
            out["save"] = _seconds(lambda: tier_save(case))
            if cold:
                drop_page_cache(case.workdir)
            out["prefetch"] = _seconds(lambda: tier_prefetch(case))

    for side in ((kvtier_side, raw_side) if flip else (raw_side, kvtier_side)):
        side()
    base = {"put": raw["put"], "get": raw["get"], "save": raw["put"], "prefetch": raw["get"]}
    return {op: (out[op], *base[op]) for op in out}   # (kvtier s, raw s, the CPU busy during the raw op)


def checksum_rows(case: Case, repeats: int) -> list[dict]:
    """The checksum against a plain copy of the same bytes: ``encode``, the copy out of a host pool
    with the checksum fused into it (what save() does) against the copy alone; ``checksum``, xxh3-64
    reading the pages again; ``crc32``, zlib's, for scale (GB/s, medians)."""
    pool, slots, _ = case.host()
    pages = (slots[:: case.salt.page_size] // case.salt.page_size).numpy()
    rows = [b[HEADER_BYTES:] for b in case.buffers]
    dst = np.empty(case.codec.blob_bytes, np.uint8)
    timed = {"copy": lambda: [np.copyto(dst, b) for b in case.blobs],
             "checksum": lambda: [xxhash.xxh3_64_intdigest(b) for b in case.blobs],
             "crc32": lambda: [zlib.crc32(b) for b in case.blobs],
             "gather": lambda: case.codec.gather(pool, pages, rows, checksum=False),
             "encode": lambda: case.codec.gather(pool, pages, rows)}
    samples = [{name: _seconds(f) for name, f in timed.items()} for _ in range(repeats)]
    base = {"encode": "gather", "checksum": "copy", "crc32": "copy"}
    pairs = [{op: (s[op], s[b]) for op, b in base.items()} for s in samples]
    return [_row("cpu", op, case, pairs, op, False) for op in base]


def _row(backend: str, op: str, case: Case, samples: list[dict], key: str, cold: bool) -> dict:
    """GB/s medians of each side, and the median of the ratios of samples taken back to back (a
    machine whose speed drifts between repeats moves both sides of each ratio); ``raw_cpu_busy``:
    the median share of the machine's CPU busy while the raw side ran (None where not measured):
    near 1, kvtier's checks compete with the store itself for the CPU."""
    gb = case.nbytes / 1e9
    busy = [s[key][2] for s in samples if len(s[key]) > 2 and s[key][2] is not None]
    return {"backend": backend, "op": op, "page_bytes": case.codec.blob_bytes, "pages": case.pages,
            "gbps": round(statistics.median(gb / s[key][0] for s in samples), 3),
            "raw_gbps": round(statistics.median(gb / s[key][1] for s in samples), 3),
            "ratio": round(statistics.median(s[key][1] / s[key][0] for s in samples), 3), "cold": cold,
            "raw_cpu_busy": round(statistics.median(busy), 2) if busy else None}


def run(backends, workdir: str, model: str, page_sizes, pages: int, repeats: int, cold: bool, with_tier: bool,
        progress: bool = True) -> list[dict]:
    rows = []
    bar = tqdm(total=len(backends) * len(page_sizes) * (repeats + 1), desc="bench storage", disable=not progress)
    for name in backends:
        for ps in page_sizes:
            with tempfile.TemporaryDirectory(prefix=f"kvtier-bench-{name}-", dir=workdir) as d:
                case = Case(name, d, model, ps, pages, seed=ps)
                try:
                    one_repeat(case, cold, False, with_tier)  # warm-up: allocators, threads, directories
                    bar.update()
                    samples = []
                    for r in range(repeats):
                        samples.append(one_repeat(case, cold, r % 2 == 1, with_tier))
                        bar.update()
                    for op in samples[0]:
                        rows.append(_row(name, op, case, samples, op, cold))
                    if name == backends[0]:
                        rows.extend(checksum_rows(case, repeats))
                finally:
                    case.close()
    bar.close()
    return rows


def table(rows: list[dict]) -> str:
    w = max([len("backend")] + [len(r["backend"]) for r in rows]) + 2
    lines = [f"{'backend':<{w}}{'op':<10}{'page':>10}{'pages':>7}{'GB/s':>9}{'raw GB/s':>10}{'ratio':>8}"
             f"{'raw CPU':>9}"]
    for r in rows:
        busy = r.get("raw_cpu_busy")
        lines.append(f"{r['backend']:<{w}}{r['op']:<10}{r['page_bytes'] / 2**20:>7.2f}MiB{r['pages']:>7}"
                     f"{r['gbps']:>9.2f}{r['raw_gbps']:>10.2f}{r['ratio']:>7.2f}x"
                     f"{'-' if busy is None else f'{busy:.0%}':>9}")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r["op"] in OPS]
    labels = [f"{r['backend']} {r['op']}\n{r['page_bytes'] / 2**20:.0f} MiB" for r in shown]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.15 * len(shown)), 4))
    ax.bar(labels, [r["ratio"] for r in shown], color=["tab:blue" if r["op"] in ("put", "save") else "tab:orange"
                                                        for r in shown])
    ax.axhline(1.0, color="black", lw=0.8)
    ax.axhline(0.9, color="gray", lw=0.8, ls="--")
    ax.set_ylabel("GB/s through kvtier / raw store GB/s")
    ax.set_title("kvtier bench storage (checksum on)" + (" cold cache" if shown and shown[0]["cold"] else ""))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


@click.command()
@click.option("--backend", "backends", multiple=True, default=("file",), show_default=True,
              help="Backend name or 'module:Class' (repeatable).")
@click.option("--dir", "workdir", type=click.Path(file_okay=False, writable=True), default=None,
              help="Where file stores go (default: the system's temporary directory).")
@click.option("--model", type=click.Choice(sorted(PRESETS)), default="llama-3-8b", show_default=True)
@click.option("--page-size", "page_sizes", type=click.IntRange(min=1), multiple=True, default=(32, 64),
              show_default=True, help="Tokens a page (repeatable); llama-3-8b: 32 -> 4 MiB, 64 -> 8 MiB.")
@click.option("--pages", type=click.IntRange(min=1), default=32, show_default=True, help="Pages per op.")
@click.option("--repeats", type=click.IntRange(min=1), default=5, show_default=True, help="Samples (median taken).")
@click.option("--cold", is_flag=True, help="Drop the page cache before every read (both sides).")
@click.option("--no-tier", is_flag=True, help="Skip the save/prefetch rows (host pool <-> store).")
@click.option("--json", "json_path", type=JSON_PATH, default=None, help=JSON_HELP)
@click.option("--plot", "plot_path", type=FIGURE_PATH, default=None, help="Write a bar chart of the ratios.")
def storage(backends, workdir, model, page_sizes, pages, repeats, cold, no_tier, json_path, plot_path) -> None:
    """Put and get GB/s of a store through kvtier (checksum on) against the raw store, same run."""
    distinct_outputs(json=json_path, plot=plot_path)
    for name in backends:
        try:
            backend_class(name)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--backend") from None
    if workdir is not None and not os.path.isdir(workdir):
        raise click.BadParameter(f"{workdir!r} is not a directory; create it or leave --dir out", param_hint="--dir")
    try:
        rows = run(list(backends), workdir, model, list(page_sizes), pages, repeats, cold, not no_tier)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    echo = echo_for(json_path)
    echo(table(rows))
    if json_path:
        write_json(json_path, rows, indent=2)
    if plot_path:
        plot(rows, plot_path)
        echo(f"wrote {plot_path}")
