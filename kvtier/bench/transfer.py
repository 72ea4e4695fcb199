"""``kvtier bench transfer``: every backend against the contiguous-copy limit of the same run.

For MHA (llama-3-8b), MLA (deepseek-v3) and DSA (glm-dsa), page sizes 1, 16
and 64, every host layout, host slots as the allocator hands them out and
scattered, it times an all-layer backup, a per-layer load and both at once
through :class:`~kvtier.transfer.TransferEngine`, and reports GB/s, the ratio
to one large contiguous copy in the same direction, and the SMs used.
Without CUDA the limit is a CPU memcpy and only ``direct`` runs.

This module holds the command and its table; the cases and measurements are in
:mod:`kvtier.bench.transfer_cases`, the sweep in :mod:`kvtier.bench.transfer_run`,
and every name of those is importable from here too.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict

import click
import torch

from ..commands import FIGURE_PATH, JSON_HELP, JSON_PATH, distinct_outputs, echo_for, write_json
from ..layouts import SUPPORTED
from ..memory import LIMIT_ENV, RESERVE_ENV, check_host_memory, huge_pages_default, huge_pages_note
from ..transfer.factory import IO_BACKENDS, Backends
from .transfer_plot import ratio_text
from .transfer_cases import (DIRECTIONS, HOST_SLOTS, PAGE_SIZES, SHAPES, SLOT_KINDS, SLOW_S,  # noqa: F401
                             SPREAD_POOL, Case, Clock, Row, _gb, _synced, _with_limits, asdict_spec,
                             contiguous_limit, host_bytes_needed, load_groups, measure, pair, pair_note,
                             parse_backend, round_order, sample_counts, sample_note, slots)
from .transfer_run import run_bench

BENCH_FIX = ("Time fewer tokens (--tokens), a smaller --spread-pool or no --slots spread, or lower the reserve "
             f"({RESERVE_ENV}); where the OS reports less memory than the machine can take (a VM whose memory "
             f"grows as it is used), set {LIMIT_ENV} to what this process may use.")


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
@click.option("--json", "json_path", type=JSON_PATH, help=JSON_HELP + " A file is rewritten after every row.")
@click.option("--plot", "plot_path", type=FIGURE_PATH,
              help="draw every row's ratio against the targets here (PNG)")
def transfer(tokens, reps, rounds, backends, kinds, page_sizes, layouts, slots, spread, quick, verbose, json_path,
             plot_path):
    """Transfer bandwidth of every backend, kind, layout and page size, as a ratio to the limit."""
    # A flag given twice times its cases once (twice would stop the progress bar short and write
    # the rows twice into the JSON).
    backends, kinds, page_sizes, layouts, slots = (tuple(dict.fromkeys(x))
                                                   for x in (backends, kinds, page_sizes, layouts, slots))
    if quick:
        tokens, reps = _quick_sizes()
    distinct_outputs(json=json_path, plot=plot_path)
    _check_backends(backends)
    _check_cases(kinds, layouts, tokens, reps, page_sizes, quick)
    if rounds < 1:
        raise click.BadParameter(f"need --rounds >= 1 (1: each row timed once), got {rounds}", param_hint="--rounds")
    if spread < 2:
        raise click.BadParameter(f"need --spread-pool >= 2 (the pool holds both transfers of a pair), got {spread}",
                                 param_hint="--spread-pool")
    layers = 4 if quick else None
    huge_pages_default()  # a bad KVTIER_HOST_HUGE_PAGES is refused now, not at the first case's pool
    _check_memory(kinds, tokens, slots, spread, layers)
    save = _saver(verbose, json_path, time.perf_counter())
    shared = Backends()
    rows = run_bench(tokens, reps, tuple(backends), kinds, page_sizes, layers, on_row=save, rounds=rounds,
                     layouts=set(layouts) or None, slots=tuple(slots), spread=spread, shared=shared)
    _report(rows, tokens, verbose, json_path, plot_path, shared)


def _quick_sizes() -> tuple[int, int]:
    """``--quick``'s tokens and reps (256, 1); a ``--tokens`` or ``--reps`` given with it is refused."""
    given = [f"--{n}" for n in ("tokens", "reps") if click.get_current_context().get_parameter_source(n)
             is not click.core.ParameterSource.DEFAULT]
    if given:
        raise click.BadParameter(f"--quick times 256 tokens once; leave out {' and '.join(given)}",
                                 param_hint="--quick")
    return 256, 1


def _check_backends(backends) -> None:
    """Every ``--backend`` is a known one (``kernel@N``: N blocks), and one asked for by name runs
    on this torch (without CUDA, only ``direct``)."""
    for b in backends:
        if parse_backend(b)[0] not in IO_BACKENDS:
            raise click.BadParameter(f"unknown backend {b!r}; use one of {list(IO_BACKENDS)} (kernel@N: N blocks)",
                                     param_hint="--backend")
    given = click.get_current_context().get_parameter_source("backends") is not click.core.ParameterSource.DEFAULT
    if given and not torch.cuda.is_available() and (gpu_only := [b for b in backends if parse_backend(b)[0] != "direct"]):
        raise click.BadParameter(f"{', '.join(gpu_only)} need{'s' if len(gpu_only) == 1 else ''} CUDA, which this "
                                 "torch does not have; without it only --backend direct runs (the default here)",
                                 param_hint="--backend")


def _check_cases(kinds, layouts, tokens: int, reps: int, page_sizes, quick: bool) -> None:
    """Every ``--kind`` is known, every ``--layout`` one a kind asked for supports, and a transfer
    of ``tokens`` is at least 64 tokens of whole pages of every page size, timed ``reps`` >= 1 times."""
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


def _check_memory(kinds, tokens: int, slots, spread: int, layers: int | None) -> None:
    """Before any pool is made: the largest case fits in host memory (cases run one at a time);
    else a usage error naming the case, the sizes and the fixes."""
    need, big = host_bytes_needed(kinds, tokens, slots, spread, layers, torch.cuda.is_available())
    try:
        check_host_memory(need, None, f"the {big.upper()} case ({tokens} tokens a transfer, pools "
                          f"{'2x' + (f' and {spread}x' if 'spread' in slots else '')} the transfer)", BENCH_FIX)
    except MemoryError as e:
        raise click.UsageError(str(e)) from None


def _saver(verbose: bool, json_path, start: float):
    """The ``on_row`` of :func:`run_bench` for the command: each row logged to stderr where
    ``verbose`` (seconds since ``start``, and what the sweep reports besides GB/s), and every
    row so far written to ``json_path`` where it is a file (to stdout, '-', once at the end)."""

    def save(rows, groups=None, picks=None, final=False, samples="", rounds=None, pair="", huge=None, ends=None):
        if verbose and final:
            lim = {r.direction: r.gbps for r in rows if r.kind == "all"}
            click.echo(f"limits, best of the start and the end of the run: {lim}; (start, end): {ends}", err=True)
        elif verbose:
            click.echo(_row_line(rows[-1], time.perf_counter() - start, groups, picks, samples, rounds, pair, huge),
                       err=True)
        if json_path and json_path != "-":
            write_json(json_path, [asdict(r) for r in rows], said="", indent=1)
    return save


def _row_line(r: Row, elapsed: float, groups, picks, samples: str, rounds, pair: str, huge) -> str:
    """The ``--verbose`` line of row ``r``, ``elapsed`` seconds into the command."""
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
    return (f"[{elapsed:6.1f}s] {r.kind} {r.layout} p{r.page_size} {r.direction} "
            f"{r.host_slots} {r.backend}: {r.gbps} GB/s ({r.ratio}x) sms={r.sms}{extra}")


def _report(rows: list[Row], tokens: int, verbose: bool, json_path, plot_path, shared: Backends) -> None:
    """The table of ``rows`` on stdout (with the trial load rates of the sweep's DMA backend,
    ``shared``'s, on stderr where ``verbose`` on CUDA), and the figure drawn to ``plot_path``."""
    if verbose and torch.cuda.is_available():
        for key, rate in shared.get("dma", torch.device("cuda")).group_rates.items():
            pl, group = key[0], key[-1]
            click.echo(f"trial load, {pl.layer_num} layers of {pl.chunk_bytes} B rows {pl.token} B apart, "
                       f"{2 ** key[2] // 2}+ slots, {group} layers per copy: {rate:.1f} GB/s", err=True)
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    echo = echo_for(json_path)
    echo(f"\n{dev}, {tokens} tokens per transfer; cells are GB/s and ratio to the contiguous limit")
    echo(huge_pages_note())
    echo(table(rows))
    if json_path == "-":
        write_json(json_path, [asdict(r) for r in rows], indent=1)
    elif json_path:
        echo(f"wrote {len(rows)} rows to {json_path}")
    if plot_path:
        from .transfer_plot import plot_transfer
        plot_transfer(rows, plot_path, f"kvtier bench transfer: {dev}, {tokens} tokens per transfer")
        echo(f"wrote the figure to {plot_path}")
