"""``kvtier info``: what a model's KV costs in each tier, and what fits here."""

from __future__ import annotations

import os
import shutil
import time

import click
import torch

from ..layouts import LAYOUTS, SUPPORTED
from ..memory import (GB, LIMIT_ENV, MAX_GB, check_host_memory, host_memory, huge_pages_default, huge_pages_note,
                      layer_objects_bytes, thp_mode)
from ..spec import KVSpec
from . import JSON_HELP, JSON_PATH, FiniteFloat, echo_for, shape_options, write_json


def layout_rows(spec: KVSpec, page_size: int) -> list[dict]:
    """Per supported host layout: bytes per page and how many contiguous pieces hold it."""
    rows = []
    for name in SUPPORTED[spec.kind]:
        lay = LAYOUTS[name]
        placements = [lay.placement(c, spec.layer_num, page_size * 2, page_size) for c in spec.components]
        pieces = sum(pl.pieces_per_page for pl in placements)  # counted: a model may have any number of layers
        largest = max(pl.piece_bytes for pl in placements)
        rows.append({
            "layout": name,
            "bytes_per_token": spec.bytes_per_token,
            "page_bytes": spec.bytes_per_token * page_size,
            "pieces_per_page": pieces,
            "largest_piece": largest,
            "about": lay.doc,
        })
    return rows


def roundtrip(spec: KVSpec, page_size: int, tokens: int, reserve: int | None) -> dict:
    """Fill a CPU device pool, back it up to a host pool, load it into other slots, compare."""
    from ..device_pool import pool_from_spec
    from ..host_pool import host_pool_for
    from ..transfer import TransferEngine

    tokens = max(page_size, tokens // page_size * page_size)
    dev = pool_from_spec(spec, 2 * tokens, page_size, "cpu")
    gen = torch.Generator().manual_seed(0)
    for stack in dev.stacks.values():
        raw = stack.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
    results = {}
    for layout in SUPPORTED[spec.kind]:
        host = host_pool_for(dev, layout, host_size_tokens=2 * tokens, reserve_bytes=reserve)
        engine = TransferEngine(host)
        src = torch.arange(tokens)
        dst = torch.arange(tokens, 2 * tokens)
        before = {n: s[:, src].clone() for n, s in dev.stacks.items()}
        h = host.alloc(tokens)
        t0 = time.perf_counter()
        engine.backup(h, src).synchronize()
        t1 = time.perf_counter()
        engine.load(h, dst).synchronize()
        t2 = time.perf_counter()
        same = all(
            torch.equal(dev.stacks[n][:, dst].view(torch.uint8), before[n].view(torch.uint8)) for n in before
        )
        nbytes = tokens * spec.bytes_per_token
        results[layout] = {
            "identical": same,
            "backup_gbps": nbytes / (t1 - t0) / GB,
            "load_gbps": nbytes / (t2 - t1) / GB,
            "huge_page_share": host.huge_page_share(),
        }
        host.free(h)
    return {"tokens": tokens, "bytes": tokens * spec.bytes_per_token, "layouts": results}


@click.command()
@shape_options
@click.option("--page-size", type=click.IntRange(min=1), default=64, show_default=True, help="Tokens per page.")
@click.option("--reserve-gb", type=FiniteFloat(0.0, high=MAX_GB), default=None,
              help="Host memory to leave free (default 10 GiB, or KVTIER_HOST_RESERVE_GB).")
@click.option("--roundtrip/--no-roundtrip", default=False, show_default=True,
              help="Also run a CPU round trip device -> host -> device and check every byte.")
@click.option("--roundtrip-tokens", type=click.IntRange(min=1), default=4096, show_default=True)
@click.option("--storage-dir", type=click.Path(file_okay=False), default=None,
              help="A file store's directory: what it holds, and its capacity for this model.")
@click.option("--storage-gb", type=FiniteFloat(0.0, strict=True, high=MAX_GB), default=None,
              help="That store's capacity (default: what it holds plus the disk's free space).")
@click.option("--json", "json_path", type=JSON_PATH, default=None, help=JSON_HELP)
def info(spec: KVSpec, page_size: int, reserve_gb, roundtrip: bool, roundtrip_tokens: int, storage_dir, storage_gb,
         json_path) -> None:
    """Bytes per token per tier and layout, how many tokens the host tier holds here, and a storage tier's use."""
    reserve = None if reserve_gb is None else int(reserve_gb * GB)
    huge_pages_default()  # a bad KVTIER_HOST_HUGE_PAGES is refused before the table, not after it
    mem = host_memory(reserve)
    if roundtrip:  # its CPU device pool and a host pool per layout of twice the tokens, and a copy of them
        rt_tokens = max(page_size, roundtrip_tokens // page_size * page_size)
        objects = layer_objects_bytes(spec.layer_num, len(spec.components)) * (1 + len(SUPPORTED[spec.kind]))
        try:
            check_host_memory(5 * rt_tokens * spec.bytes_per_token + objects, reserve,
                              f"--roundtrip-tokens {roundtrip_tokens:,} of a model of {spec.layer_num:,} layers",
                              "Lower --roundtrip-tokens.")
        except MemoryError as e:
            raise click.UsageError(str(e)) from None
    if storage_gb is not None and storage_dir is None:
        raise click.UsageError("--storage-gb sizes the store named by --storage-dir; give --storage-dir too")
    if storage_dir is not None and not os.path.isdir(storage_dir):
        raise click.BadParameter(f"{storage_dir!r} is not a directory; name a file store's directory",
                                 param_hint="--storage-dir")
    fits = mem.available // spec.bytes_per_token // page_size * page_size  # whole pages
    echo = echo_for(json_path)
    rows = _echo_tiers(spec, page_size, echo)
    _echo_host(mem, fits, page_size, echo)
    out = {
        "model": spec.name, "kind": spec.kind, "describe": spec.describe(),
        "bytes_per_token": spec.bytes_per_token,
        "bytes_per_token_per_layer": {c.name: c.item_bytes for c in spec.components},
        "page_size": page_size, "layouts": rows,
        "host_available_bytes": mem.available, "host_capacity_tokens": fits,
        "cgroup_limit_bytes": mem.cgroup_limit, "cgroup_path": mem.cgroup_path, "host_limit_bytes": mem.limit,
        "huge_pages": huge_pages_default(), "transparent_huge_pages": thp_mode(),
    }
    if storage_dir is not None:
        out["storage"] = _echo_storage(spec, page_size, storage_dir, storage_gb, echo)
    if roundtrip:
        out["roundtrip"] = _echo_roundtrip(spec, page_size, roundtrip_tokens, reserve, echo)
    if json_path:
        write_json(json_path, out, indent=2)


def storage_capacity(spec: KVSpec, page_size: int, path: str, capacity_gb: float | None) -> dict:
    """A file store's use (read-only) and its capacity for pages of ``spec``: ``capacity_gb``, else
    what it holds plus the free space of its disk."""
    from ..storage.file import directory_usage
    from ..storage.format import HEADER_BYTES

    usage = directory_usage(path)
    free = shutil.disk_usage(path).free
    capacity = int(capacity_gb * GB) if capacity_gb is not None else usage.used_bytes + free
    page_bytes = HEADER_BYTES + page_size * spec.bytes_per_token
    return {"path": os.path.abspath(path), "pages": usage.pages, "used_bytes": usage.used_bytes,
            "capacity_bytes": capacity, "capacity_from": "--storage-gb" if capacity_gb is not None else "disk",
            "disk_free_bytes": free, "page_bytes": page_bytes, "capacity_pages": capacity // page_bytes,
            "capacity_tokens": capacity // page_bytes * page_size}


def _echo_storage(spec: KVSpec, page_size: int, path: str, capacity_gb, echo) -> dict:
    s = storage_capacity(spec, page_size, path, capacity_gb)
    source = "--storage-gb" if capacity_gb is not None else (
        f"what it holds + the disk's {s['disk_free_bytes'] / GB:.1f} GB free")
    echo("")
    echo(f"storage (file store) {s['path']}: {s['pages']:,} pages, {s['used_bytes'] / GB:.2f} GB held, "
         f"capacity {s['capacity_bytes'] / GB:.1f} GB ({source}), {s['used_bytes'] / max(s['capacity_bytes'], 1):.0%} used")
    echo(f"storage tier capacity for this model: {s['capacity_tokens']:,} tokens ({s['capacity_pages']:,} pages of "
         f"{page_size}, {s['page_bytes']:,} B each with its header)")
    return s


def _echo_roundtrip(spec: KVSpec, page_size: int, tokens: int, reserve, echo) -> dict:
    """Run :func:`roundtrip` and print what it found; a click error where bytes changed."""
    echo("")
    rt = _roundtrip_or_exit(spec, page_size, tokens, reserve)
    echo(f"CPU round trip: {rt['tokens']} tokens ({rt['bytes'] / 2**20:.1f} MiB) device -> host -> other device slots")
    for layout, r in rt["layouts"].items():
        verdict = "identical" if r["identical"] else "MISMATCH"
        echo(f"  {layout:<12} {verdict:<10} backup {r['backup_gbps']:6.2f} GB/s   "
             f"load {r['load_gbps']:6.2f} GB/s   host pool in huge pages {r['huge_page_share']:.0%}")
    if not all(r["identical"] for r in rt["layouts"].values()):
        raise click.ClickException("round trip changed bytes")
    return rt


def _echo_tiers(spec: KVSpec, page_size: int, echo=click.echo) -> list[dict]:
    """Print the model's bytes per token and page, and the table of tiers and host layouts;
    return the layouts' rows (:func:`layout_rows`)."""
    echo(f"model      {spec.name}: {spec.describe()}")
    for c in spec.components:
        echo(f"  {c.name:<8} {c.item_bytes:>8,} B per token per layer")
    echo(f"  total    {spec.bytes_per_token_per_layer:>8,} B per token per layer, "
         f"{spec.bytes_per_token:,} B per token ({spec.bytes_per_token / 1024:.1f} KiB)")
    echo(f"  page     {page_size} tokens = {spec.bytes_per_token * page_size / 2**20:.2f} MiB")
    echo("")
    echo("tier  layout        bytes/token  pieces/page  largest piece  note")
    echo(f"L1    device        {spec.bytes_per_token:>11,}  {len(spec.components) * spec.layer_num:>11}  "
         f"{page_size * max(c.item_bytes for c in spec.components):>13,}  per-layer GPU buffers")
    rows = layout_rows(spec, page_size)
    for r in rows:
        echo(f"L2    {r['layout']:<12}  {r['bytes_per_token']:>11,}  {r['pieces_per_page']:>11}  "
             f"{r['largest_piece']:>13,}  {r['about']}")
    echo("")
    return rows


def _echo_host(mem, fits: int, page_size: int, echo=click.echo) -> None:
    """Print the host memory ``mem`` (:class:`~kvtier.memory.HostMemory`) and which limit counts,
    the host tier's capacity here (``fits`` tokens, whole pages), and the huge-page note."""
    source = "cgroup limit" if mem.cgroup_limit is not None else "host limit"
    if mem.limit is not None:
        source += f"; {LIMIT_ENV}={mem.limit / GB:g} in place of the OS's available memory"
    echo(f"host memory: {mem.total / GB:.1f} GB total, {mem.available / GB:.1f} GB usable "
         f"after a {mem.reserve / GB:.1f} GB reserve ({source}"
         + (f", cgroup limit {mem.cgroup_limit / GB:.1f} GB" if mem.cgroup_limit else "")
         + (f" at {mem.cgroup_path}" if mem.cgroup_limit and mem.cgroup_path else "") + ")")
    echo(f"host tier capacity here: {fits:,} tokens ({fits // page_size:,} pages of {page_size})")
    echo(huge_pages_note())


def _roundtrip_or_exit(spec, page_size, tokens, reserve):
    try:
        return roundtrip(spec, page_size, tokens, reserve)
    except MemoryError as e:
        raise click.ClickException(str(e)) from None
