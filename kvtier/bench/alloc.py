"""``kvtier bench alloc``: the page allocator against the seed's free list, same run.

The seed keeps free slots in one tensor: alloc slices its head, free appends
with ``torch.cat``, which copies the whole free list on every free. The
baseline below reproduces that behaviour (our code, the seed's algorithm).
"""

from __future__ import annotations

import statistics
import time

import click
import torch

from ..allocator import PageAllocator
from ..commands import JSON_HELP, JSON_PATH, echo_for, write_json


class SeedFreeList:
    """The seed's host allocator: a tensor free list, sliced on alloc, concatenated on free."""

    def __init__(self, size: int, page_size: int):
        self.page_size = page_size
        self.free_slots = torch.arange(size, dtype=torch.int64)

    def alloc(self, need_size: int):
        if need_size > len(self.free_slots):
            return None
        out = self.free_slots[:need_size]
        self.free_slots = self.free_slots[need_size:]
        return out

    def free(self, indices: torch.Tensor) -> int:
        self.free_slots = torch.cat([self.free_slots, indices])
        return len(indices)


def time_alloc_free(alloc, need: int, iters: int, repeats: int) -> float:
    """Median seconds of one alloc+free pair, over ``repeats`` batches of ``iters``."""
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            alloc.free(alloc.alloc(need))
        samples.append((time.perf_counter() - t0) / iters)
    return statistics.median(samples)


def run(size: int, page_sizes: list[int], iters: int, repeats: int, echo=click.echo) -> list[dict]:
    rows = []
    for ps in page_sizes:
        for pages in (1, 64):
            need = pages * ps
            if need > size:
                continue
            ours = PageAllocator(size, ps)
            seed = SeedFreeList(size, ps)
            # Warm up both, then measure them interleaved in the same run.
            time_alloc_free(ours, need, 10, 1)
            time_alloc_free(seed, need, 10, 1)
            t_ours = time_alloc_free(ours, need, iters, repeats)
            t_seed = time_alloc_free(seed, need, max(iters // 10, 10), repeats)
            row = {
                "pool_tokens": size, "page_size": ps, "pages_per_alloc": pages,
                "kvtier_us": t_ours * 1e6, "seed_us": t_seed * 1e6, "speedup": t_seed / t_ours,
            }
            rows.append(row)
            echo(f"{size:>10,} {ps:>5} {pages:>6} {row['kvtier_us']:>12.2f} {row['seed_us']:>12.2f} "
                 f"{row['speedup']:>9.1f}x")
    return rows


@click.command()
@click.option("--size", type=click.IntRange(min=1), default=1 << 20, show_default=True, help="Pool size in tokens.")
@click.option("--page-size", "page_sizes", type=click.IntRange(min=1), multiple=True, default=(1, 64),
              show_default=True, help="Page sizes to measure (repeatable).")
@click.option("--iters", type=click.IntRange(min=10), default=2000, show_default=True, help="alloc+free pairs per sample.")
@click.option("--repeats", type=click.IntRange(min=1), default=5, show_default=True, help="Samples (median taken).")
@click.option("--json", "json_path", type=JSON_PATH, default=None, help=JSON_HELP)
def alloc(size: int, page_sizes, iters: int, repeats: int, json_path) -> None:
    """One alloc+free pair: kvtier's PageAllocator vs the seed's torch.cat free list."""
    if short := [ps for ps in page_sizes if ps > size]:
        raise click.BadParameter(f"--size {size} holds no page of --page-size {short[0]}; raise --size or lower "
                                 "--page-size", param_hint="--size")
    from ..memory import HostMemoryError, check_host_memory
    try:  # the seed's free list (and its copy on every free) and ours, for the largest case
        check_host_memory(3 * 8 * size + 16 * size // min(page_sizes), 0, f"--size {size:,} (two allocators)",
                          "Lower --size.")
    except HostMemoryError as e:
        raise click.UsageError(str(e)) from None
    echo = echo_for(json_path)
    echo(f"{'pool':>10} {'page':>5} {'pages':>6} {'kvtier us':>12} {'seed us':>12} {'ratio':>10}")
    rows = run(size, list(page_sizes), iters, repeats, echo)
    if json_path:
        write_json(json_path, rows, indent=2)
