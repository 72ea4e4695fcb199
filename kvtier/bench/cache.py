"""``kvtier bench cache``: match and insert time as the prefix tree grows, against a token-by-token tree.

The tree grows from conversations: each new 32k-token sequence continues
an earlier one from a random page boundary with fresh tokens (the shape of
multi-turn traffic), until it caches 10^4, 10^5 and 10^6 tokens. At each
size, a prompt that shares a cached sequence's first ``prompt`` tokens is
matched (median of repeats), then half-new prompts are inserted. The same
sequences go into :class:`~.cache_reference.ReferenceRadixTree`, matched
on the same prompts in the same run. Matching takes the prompt as a CPU
tensor (what an engine holds); ``match_list_us`` gives the time from a
Python list, conversion included.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import click
import numpy as np
import torch
from tqdm import tqdm

from ..cache import CacheConfig, HiCache
from ..commands import FINITE_POSITIVE, JSON_HELP, JSON_PATH, echo_for, write_json
from ..device_pool import MHATokenToKVPool
from .cache_reference import ReferenceRadixTree

VOCAB = 128_000
SEQ_LEN = 32_768


@dataclass(frozen=True)
class Row:
    cached_tokens: int
    prompt_tokens: int
    page_size: int
    matched_tokens: int
    path_nodes: int
    match_us: float
    match_list_us: float
    insert_us: float
    reference_match_us: float

    @property
    def ratio(self) -> float:
        return self.reference_match_us / self.match_us

    @property
    def match_us_per_ktok(self) -> float:
        return self.match_us / (self.matched_tokens / 1000) if self.matched_tokens else float("nan")


def median_us(fn, repeats: int) -> float:
    fn()
    times = []
    gc.disable()
    try:
        for _ in range(repeats):
            t = time.perf_counter_ns()
            fn()
            times.append(time.perf_counter_ns() - t)
    finally:
        gc.enable()
    return statistics.median(times) / 1e3


class Workload:
    """Both trees, fed the same sequences."""

    def __init__(self, capacity: int, page_size: int, seed: int):
        self.ps = page_size
        self.rng = np.random.default_rng(seed)
        pool = MHATokenToKVPool(capacity, page_size, torch.float16, 1, 1, 1, "cpu")
        self.cache = HiCache(pool, None, CacheConfig(page_size=page_size))
        self.ref = ReferenceRadixTree()
        self.seqs: list[np.ndarray] = []
        self.cached = 0

    def branch(self, length: int, shared: int | None = None) -> np.ndarray:
        """A sequence continuing a random earlier one from a random page boundary."""
        if not self.seqs:
            return self.rng.integers(0, VOCAB, length)
        src = self.seqs[self.rng.integers(len(self.seqs))]
        if shared is None:
            shared = int(self.rng.integers(0, len(src) // self.ps + 1)) * self.ps
        shared = min(shared, len(src), length)
        return np.concatenate([src[:shared], self.rng.integers(0, VOCAB, length - shared)])

    def add(self, seq: np.ndarray) -> float:
        """Insert into both trees; returns the HiCache insert time in microseconds."""
        m = self.cache.match_prefix(torch.from_numpy(seq))
        new = len(seq) - m.device_len
        own = self.cache.alloc_device(-(-new // self.ps) * self.ps)
        assert own is not None, "bench pool too small"
        slots = torch.cat([m.device_indices, own[:new]])
        t = time.perf_counter_ns()
        before = self.cache.insert(torch.from_numpy(seq), slots)
        took = (time.perf_counter_ns() - t) / 1e3
        full = len(seq) // self.ps * self.ps
        self.cache.free_device(own[full - m.device_len :])
        self.ref.insert(seq[:full].tolist(), slots[:full].tolist())
        self.seqs.append(seq[:full])
        self.cached += full - before
        return took

    def grow_to(self, tokens: int, bar) -> None:
        while self.cached < tokens:
            before = self.cached
            self.add(self.branch(min(SEQ_LEN, max(tokens - self.cached, self.ps))))
            bar.update(self.cached - before)


def probe_for(w: Workload, prompt: int) -> np.ndarray:
    """A prompt whose first ``prompt`` tokens are a cached sequence's (as far as one is that long)."""
    src = [s for s in w.seqs if len(s) >= prompt]
    if src:
        return src[int(w.rng.integers(len(src)))][:prompt].copy()
    longest = max(w.seqs, key=len)
    return np.concatenate([longest, w.rng.integers(0, VOCAB, prompt - len(longest))])


def measure_match(w: Workload, prompt: int, repeats: int, probes: int = 5) -> dict:
    """Median over ``probes`` random prompts of each one's median match time."""
    cols: dict[str, list[float]] = {"match_us": [], "match_list_us": [], "reference_match_us": [],
                                    "matched_tokens": [], "path_nodes": []}
    for _ in range(probes):
        probe = probe_for(w, prompt)
        tensor, as_list = torch.from_numpy(probe), probe.tolist()
        m = w.cache.match_prefix(tensor)
        got = w.ref.match(as_list)
        # Both trees must give the same answer before their times mean anything.
        assert m.device_len == len(got) // w.ps * w.ps and m.device_indices.tolist() == got[: m.device_len]
        cols["matched_tokens"].append(m.device_len)
        cols["path_nodes"].append(len(w.cache.tree.path_to(m.node)))
        cols["match_us"].append(median_us(lambda: w.cache.match_prefix(tensor), repeats))
        cols["match_list_us"].append(median_us(lambda: w.cache.match_prefix(as_list), max(3, repeats // 5)))
        cols["reference_match_us"].append(median_us(lambda: w.ref.match(as_list), max(3, repeats // 10)))
    out = {k: statistics.median(v) for k, v in cols.items()}
    out["matched_tokens"], out["path_nodes"] = int(out["matched_tokens"]), int(out["path_nodes"])
    return dict(cached_tokens=w.cached, prompt_tokens=prompt, page_size=w.ps, **out)


def measure_insert(w: Workload, prompt: int) -> float:
    """Median time to insert a prompt whose first half is cached (the tree grows by the rest)."""
    half = prompt // 2 // w.ps * w.ps
    return statistics.median(w.add(w.branch(prompt, shared=half)) for _ in range(3))


def print_table(rows: list[Row], echo=click.echo) -> None:
    head = (f"{'cached':>9} {'prompt':>7} {'matched':>8} {'nodes':>5} {'match us':>9} {'us/1k tok':>9} "
            f"{'from list':>9} {'insert us':>9} {'ref us':>9} {'ref/ours':>8}")
    echo(head)
    echo("-" * len(head))
    for r in rows:
        echo(f"{r.cached_tokens:>9} {r.prompt_tokens:>7} {r.matched_tokens:>8} {r.path_nodes:>5} {r.match_us:>9.1f} "
             f"{r.match_us_per_ktok:>9.2f} {r.match_list_us:>9.1f} {r.insert_us:>9.1f} "
             f"{r.reference_match_us:>9.1f} {r.ratio:>7.1f}x")


def verdict(rows: list[Row], page_size: int, budget_us: float, echo=click.echo) -> None:
    big = [r for r in rows if r.prompt_tokens == SEQ_LEN]
    if not big:
        return
    last = max(big, key=lambda r: r.cached_tokens)
    ok = last.match_us <= budget_us
    echo(f"\n{SEQ_LEN}-token prompt, page {page_size}, {last.cached_tokens} tokens cached: "
         f"{last.match_us:.1f} us (budget {budget_us:.0f} us) -> {'PASS' if ok else 'FAIL'}")
    for prompt in sorted({r.prompt_tokens for r in rows}):
        full = [r for r in rows if r.prompt_tokens == prompt and r.matched_tokens == prompt]
        if len(full) > 1:
            per = [r.match_us_per_ktok for r in full]
            sizes = ", ".join(f"{r.cached_tokens:.0e}: {r.match_us_per_ktok:.2f}" for r in full)
            echo(f"full {prompt}-token hits, us per 1k tokens by cached size ({sizes}): "
                 f"max/min {max(per) / min(per):.2f}")


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not comma-separated integers, e.g. 10000,100000", param_hint=flag) from None
    return values


@click.command("cache")
@click.option("--sizes", default="10000,100000,1000000", show_default=True,
              help="Cached-token counts to grow through (each size's insert timings add ~1.5x the prompts; "
                   "a size closer than that to the one before is passed, and said so).")
@click.option("--prompts", default="4096,8192,32768", show_default=True, help="Prompt lengths matched at each size.")
@click.option("--page-size", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--repeats", default=50, show_default=True, type=click.IntRange(min=1), help="Timed matches per row (median).")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, 2**63 - 1))
@click.option("--budget-us", default=200.0, show_default=True, type=FINITE_POSITIVE,
              help="Acceptance: 32k-token match time at the largest size.")
@click.option("--json", "json_path", type=JSON_PATH, help=JSON_HELP)
def cache(sizes, prompts, page_size, repeats, seed, budget_us, json_path):
    """Prefix-cache match and insert time as the tree grows, vs a token-by-token radix tree."""
    sizes_l = sorted(_int_list(sizes, "--sizes"))
    prompts_l = _int_list(prompts, "--prompts")
    if min(sizes_l) <= 0:
        raise click.BadParameter(f"sizes must be positive, got {min(sizes_l)}", param_hint="--sizes")
    if min(prompts_l) < page_size:
        raise click.BadParameter(f"a prompt of {min(prompts_l)} tokens is shorter than a page (--page-size "
                                 f"{page_size}); give prompts of at least one page", param_hint="--prompts")
    capacity = (max(sizes_l) + (3 * len(sizes_l) + 2) * max(prompts_l + [SEQ_LEN])) // page_size * page_size + page_size
    try:
        w = Workload(capacity, page_size, seed)
    except MemoryError as e:  # refused by the pool's check before anything is allocated
        need = str(e).split(". Lower")[0]  # the pool's own fix names its constructor's argument
        raise click.UsageError(f"--sizes up to {max(sizes_l):,} and --prompts up to {max(prompts_l):,} need a pool "
                               f"of {capacity:,} token slots: {need}. Lower --sizes.") from None
    rows: list[Row] = []
    with tqdm(total=max(sizes_l), desc="growing the trees", unit="tok", leave=False) as bar:
        for size in sizes_l:
            if w.cached > size:
                # Each row's insert timings grow the tree by ~1.5x its prompts (insert_us).
                tqdm.write(f"note: the tree already holds {w.cached:,} tokens, past --sizes {size:,} (the rows "
                           "before grew it by their insert timings); its rows are at that size", file=sys.stderr)
            w.grow_to(size, bar)
            matches = [measure_match(w, p, repeats) for p in prompts_l]
            rows += [Row(**m, insert_us=measure_insert(w, p)) for m, p in zip(matches, prompts_l)]
    echo = echo_for(json_path)
    print_table(rows, echo)
    verdict(rows, page_size, budget_us, echo)
    if json_path:
        write_json(json_path, [asdict(r) for r in rows], indent=1)
