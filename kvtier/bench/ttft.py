"""``kvtier bench ttft``: time to first token when a long prefix is in the host tier or in storage,
against recomputing it.

For each context length ``L`` the reference engine serves prompts of
``L`` shared-prefix tokens plus ``new`` fresh ones, five ways, in one run:

- **recompute**: no prefix cache; the whole prompt is prefilled (fused
  attention: torch's ``scaled_dot_product_attention``);
- **host hit**: the prefix was served before, backed up to the host tier and
  evicted from the device; it is loaded back layer by layer while the
  forward pass of the new tokens runs;
- **device hit**: the prefix is still on the device: only the new tokens are
  prefilled (the floor a host hit can approach);
- **storage hit**: the prefix is only in a file store (both tiers emptied, the
  store's files written back and dropped from the page cache, as ``kvtier bench
  storage --cold`` does): it is read, verified, and loaded, all of it;
- **advisor**: the same, on an engine that asks the cache's advice (the
  measured storage and host bandwidths against its measured prefill rate) how
  much of the storage hit to load, and recomputes the rest.

The same run measures the contiguous-copy limit (one pinned host -> device
copy of the prefix's KV bytes) and the disk's raw read bandwidth (the store's
files read cold with plain reads). Acceptance (on the GPU): host-hit TTFT at
least 10x below recompute, and at most ``1.2 x KV bytes / limit + device-hit
TTFT``, which shows the loads overlap the forward pass; the advisor's TTFT
within 5% of the faster of recompute and the storage hit; a storage hit faster
than recomputing wherever reading the KV bytes at the disk's bandwidth is.
"""

from __future__ import annotations

import os
import random
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import click
import torch

from ..commands import JSON_HELP, JSON_PATH, check_engine_flags, echo_for, write_json
from ..engine import Engine, EngineConfig, Sequence, llama3_8b, tiny
from ..engine.config import INPUT_COPIES
from ..engine.engine import make_model
from .storage import drop_page_cache

MODELS = {
    "llama-3-8b": lambda: llama3_8b(torch.bfloat16),
    "tiny": lambda: tiny("llama", hidden_size=256, n_layers=4, n_heads=8, n_kv_heads=2, head_dim=32,
                         intermediate_size=512, vocab_size=1000),
}

# What `--contexts` defaults to: the sizes ANCHORS.md measured for the real shape; for the CPU
# smoke test, lengths it prefills in seconds (recomputing 16k tokens takes about 68 s on 2 cores).
DEFAULT_CONTEXTS = {"llama-3-8b": "16384,32768", "tiny": "1024,2048"}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def serve(engine: Engine, prompt: list[int]) -> Sequence:
    """Run one request alone to its first (and only) token; the device is idle before and after."""
    _sync(engine.pool.device)
    seq = engine.add_request(prompt, max_new_tokens=1)
    engine.run_until_done()
    _sync(engine.pool.device)
    return seq


def copy_limit_gbps(nbytes: int, device: torch.device, repeats: int = 5) -> float:
    """Contiguous host -> device copy of ``nbytes`` (pinned on CUDA): the physical limit, GB/s."""
    if device.type != "cuda":
        src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
        dst = torch.empty_like(src)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
        return nbytes / statistics.median(times) / 1e9
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return nbytes / statistics.median(times) / 1e9


def prefill_flops(cfg, n_tokens: int) -> float:
    """Matmul FLOPs of prefilling ``n_tokens`` from scratch (causal attention counted once per pair)."""
    h, d = cfg.hidden_size, cfg.head_dim
    proj = h * (cfg.n_heads * d + 2 * cfg.n_kv_heads * d) + cfg.n_heads * d * h + 3 * h * cfg.intermediate_size
    linear = 2 * cfg.n_layers * proj * n_tokens + 2 * h * cfg.vocab_size
    attention = 2 * 2 * cfg.n_layers * cfg.n_heads * d * n_tokens * (n_tokens + 1) / 2
    return linear + attention


def recompute_ttfts(none: Engine, prompts: list[list[int]]) -> tuple[list[float], list[list[int]]]:
    seqs = [serve(none, p) for p in prompts]
    return [s.ttft for s in seqs], [s.output_ids for s in seqs]


# Untimed host hits before the timed ones: the first loads of a shape compile kernels
# and allocate staging. auto also tries each candidate on its first transfers of a shape
# (``settling_transfers``: three each), so it gets as many (warm_hits).
WARM_HITS = 2


def warm_hits(engine: Engine) -> int:
    """Untimed host hits ``engine`` needs before its timed ones."""
    return max(WARM_HITS, getattr(engine.kv.cache.engine.backend, "settling_transfers", 0))


def hit_ttfts(tiers: Engine, prefix: list[int], prompts: list[list[int]], others: list[list[int]],
              warm: list[list[int]] = ()) -> dict:
    """Host-hit TTFT of each prompt (prefix evicted to the host first), then a device hit with another suffix.

    ``warm`` prompts are served as host hits first, untimed.
    """
    L = len(prefix)
    serve(tiers, prefix)  # the prefix lands in both tiers (write-through)
    for prompt in warm:
        tiers.kv.cache.evict_device(tiers.kv.capacity)
        serve(tiers, prompt)
    host, device, outputs = [], [], []
    for prompt, other in zip(prompts, others):
        tiers.kv.cache.evict_device(tiers.kv.capacity)  # waits for the backup, then frees the device copy
        h = serve(tiers, prompt)
        d = serve(tiers, other)
        if h.reused_host != L or d.reused_device != L:
            raise RuntimeError(f"expected a {L}-token host hit and device hit, got {h.reused_host} and "
                               f"{d.reused_device}: the prefix did not stay in the tiers (pools too small?)")
        host.append(h.ttft)
        device.append(d.ttft)
        outputs.append(h.output_ids)
    return {"host": host, "device": device, "outputs": outputs}


def storage_engines(model, base: dict, model_name: str, root: str) -> dict[str, Engine]:
    """Two engines whose storage tier is a file store under ``root``: ``load`` loads a whole storage
    hit (waiting for all of it); ``advisor`` loads what the cache's advice says pays."""
    common = dict(prefix_cache="tiers", storage="file", model_id=f"kvtier-bench/{model_name}",
                  storage_write="write_through", storage_bytes=64 << 30, **base)
    return {"load": Engine(model, EngineConfig(storage_url=os.path.join(root, "load"),
                                               storage_prefetch="wait_complete", **common)),
            "advisor": Engine(model, EngineConfig(storage_url=os.path.join(root, "advisor"), use_advisor=True,
                                                  **common))}


def cold(engine: Engine) -> None:
    """Leave the engine's prefixes in its store only: written, both tiers emptied, the store's files
    written back and dropped from the page cache (POSIX_FADV_DONTNEED)."""
    cache = engine.kv.cache
    cache.flush()
    cache.evict_device(engine.kv.capacity)
    cache.evict_host(cache.host_pool.size)
    cache.flush()
    drop_page_cache(engine.config.storage_url)


def storage_ttfts(engine: Engine, prefix: list[int], prompts: list[list[int]], warm: list[int]) -> dict:
    """TTFT of each prompt whose prefix is in ``engine``'s store only (cold); ``warm``: one untimed
    such hit first. The prefix's tokens the engine loaded from storage, and its outputs."""
    serve(engine, prefix)
    cold(engine)
    serve(engine, warm)
    times, loaded, outputs = [], [], []
    for prompt in prompts:
        cold(engine)
        seq = serve(engine, prompt)
        times.append(seq.ttft)
        loaded.append(seq.reused_storage)
        outputs.append(seq.output_ids)
    return {"ttft": times, "loaded": loaded, "outputs": outputs}


def disk_read_gbps(root: str, threads: int = 4) -> float:
    """The store's files under ``root`` read cold with plain reads, ``threads`` at once (the file
    store's own concurrency), in GB/s: the disk's raw bandwidth."""
    files = [os.path.join(d, f) for d, _, names in os.walk(root) for f in names if f.endswith(".kvp")]
    drop_page_cache(root)

    def read(path: str) -> int:
        with open(path, "rb", buffering=0) as f:
            return len(f.read())
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        nbytes = sum(pool.map(read, files))
    return nbytes / (time.perf_counter() - t0) / 1e9


def _storage_fields(L: int, kv_bytes: int, recompute: list[float], stored: dict, ref: list[list[int]]) -> dict:
    r = statistics.median(recompute)
    load, adv = (statistics.median(stored[k]["ttft"]) for k in ("load", "advisor"))
    disk = stored["disk_gbps"]
    return {
        "storage_hit_ttft_s": load, "advisor_ttft_s": adv,
        "advisor_loaded_tokens": statistics.median(stored["advisor"]["loaded"]),
        "storage_loaded_tokens": statistics.median(stored["load"]["loaded"]), "disk_read_gbps": disk,
        "storage_speedup": r / load, "pass_advisor_5pct": adv <= 1.05 * min(r, load),
        "pass_storage_beats_recompute": load < r or kv_bytes / (disk * 1e9) >= r,
        "storage_first_tokens_equal": sum(a == b for k in ("load", "advisor")
                                          for a, b in zip(stored[k]["outputs"], ref)),
        "storage_samples": {"storage_hit": stored["load"]["ttft"], "advisor": stored["advisor"]["ttft"]},
    }


def _row(mcfg, L: int, new: int, limit: float, backend: str, recompute: list[float], hits: dict, same: int) -> dict:
    kv_bytes = L * mcfg.kv_spec().bytes_per_token
    r, h, d = (statistics.median(x) for x in (recompute, hits["host"], hits["device"]))
    bound = 1.2 * kv_bytes / (limit * 1e9) + d
    return {
        "context_tokens": L, "new_tokens": new, "io_backend": backend, "kv_bytes": kv_bytes,
        "copy_limit_gbps": limit, "recompute_ttft_s": r, "host_hit_ttft_s": h, "device_hit_ttft_s": d,
        "speedup": r / h, "bound_s": bound,
        "load_gbps_effective": kv_bytes / max(h - d, 1e-9) / 1e9,
        "prefill_tflops": prefill_flops(mcfg, L + new) / r / 1e12,
        "first_tokens_equal": same, "first_tokens_compared": len(hits["outputs"]),
        "pass_10x": r >= 10 * h, "pass_bound": h <= bound,
        "samples": {"recompute": recompute, "host_hit": hits["host"], "device_hit": hits["device"]},
    }


def run(model_name: str, lengths: list[int], new: int, repeats: int, device: str, io_backends: list[str | None],
        layout: str, page_size: int, seed: int, echo=click.echo, inputs: str = "sms",
        storage_dir: str | None = None) -> dict:
    """Every row of the bench; ``storage_dir``: where the storage rows' file stores go (a directory
    made in it, removed at the end; None: no storage rows)."""
    dev = torch.device(device)
    mcfg = MODELS[model_name]()
    if dev.type == "cpu" and mcfg.dtype != torch.float32:
        mcfg = mcfg.with_(dtype=torch.float32)
    tokens = (max(lengths) + 2 * new) // page_size * page_size + 2 * page_size
    base = dict(device_tokens=tokens, host_tokens=tokens, page_size=page_size, layout=layout,
                device=device, max_batch_tokens=tokens, inputs=inputs)
    t0 = time.perf_counter()
    model = make_model(mcfg, EngineConfig(**base), seed)
    none = Engine(model, EngineConfig(prefix_cache="none", **base))
    tiers = {b: Engine(model, EngineConfig(prefix_cache="tiers", io_backend=b, **base)) for b in io_backends}
    root = tempfile.mkdtemp(prefix="kvtier-bench-ttft-", dir=storage_dir) if storage_dir is not None else None
    stores = storage_engines(model, base, model_name, root) if root else {}
    names = {b: e.kv.cache.engine.io_backend for b, e in tiers.items()}
    echo(f"model {model_name} ({mcfg.kv_spec().describe()}) on {device}, built in {time.perf_counter() - t0:.1f} s; "
         f"io backends {list(names.values())}" + (f"; storage under {root}" if root else ""))
    rng = random.Random(seed)
    serve(none, [rng.randrange(mcfg.vocab_size) for _ in range(min(lengths))])  # warm-up: kernels, allocator
    for e in [*tiers.values(), *stores.values()]:
        serve(e, [rng.randrange(mcfg.vocab_size) for _ in range(new)])
    try:
        rows = [row for L in lengths for row in _rows_for(L, mcfg, new, repeats, rng, none, tiers, names, stores, echo)]
    finally:
        for e in stores.values():
            e.close()
        if root:
            shutil.rmtree(root, ignore_errors=True)
    device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    return {"model": model_name, "device": device_name, "layout": layout, "page_size": page_size,
            "inputs": inputs, "repeats": repeats, "torch": torch.__version__, "rows": rows,
            "cache_metrics": {**{names[b]: e.kv.metrics() for b, e in tiers.items()},
                              **{f"storage_{k}": e.kv.metrics() for k, e in stores.items()}}}


def _rows_for(L: int, mcfg, new: int, repeats: int, rng, none: Engine, tiers: dict, names: dict, stores: dict,
              echo) -> list[dict]:
    """The rows of context length ``L``: one per io backend, each with the storage fields where measured."""
    kv_bytes = L * mcfg.kv_spec().bytes_per_token
    limit = copy_limit_gbps(kv_bytes, torch.device(none.config.device))
    prefix = [rng.randrange(mcfg.vocab_size) for _ in range(L)]
    prompts = [prefix + [rng.randrange(mcfg.vocab_size) for _ in range(new)]
               for _ in range(2 * repeats + max(map(warm_hits, tiers.values())) + 1)]
    recompute, ref_outputs = recompute_ttfts(none, prompts[:repeats])
    stored = {k: storage_ttfts(e, prefix, prompts[:repeats], prompts[-1]) for k, e in stores.items()}
    if stores:
        stored["disk_gbps"] = disk_read_gbps(stores["load"].config.storage_url)
    rows = []
    for b, e in tiers.items():
        hits = hit_ttfts(e, prefix, prompts[:repeats], prompts[repeats:2 * repeats],
                         prompts[2 * repeats:2 * repeats + warm_hits(e)])
        same = sum(a == c for a, c in zip(ref_outputs, hits["outputs"]))
        rows.append(_row(mcfg, L, new, limit, names[b], recompute, hits, same))
        if stores:
            rows[-1].update(_storage_fields(L, kv_bytes, recompute, stored, ref_outputs))
        echo(_line(rows[-1]))
    return rows


def _line(r: dict) -> str:
    line = (f"{r['context_tokens']:>6} ctx + {r['new_tokens']} new [{r['io_backend']}]: recompute "
            f"{r['recompute_ttft_s'] * 1e3:8.1f} ms ({r['prefill_tflops']:.3g} TFLOP/s) | host hit "
            f"{r['host_hit_ttft_s'] * 1e3:7.1f} ms | device hit {r['device_hit_ttft_s'] * 1e3:6.1f} ms | "
            f"{r['speedup']:5.1f}x | bound {r['bound_s'] * 1e3:6.1f} ms (KV {r['kv_bytes'] / 1e9:.3g} GB, limit "
            f"{r['copy_limit_gbps']:.1f} GB/s)")
    if "storage_hit_ttft_s" in r:
        line += (f" | storage hit {r['storage_hit_ttft_s'] * 1e3:.1f} ms, advisor {r['advisor_ttft_s'] * 1e3:.1f} ms "
                 f"({r['advisor_loaded_tokens']:,.0f} tokens loaded), disk {r['disk_read_gbps']:.2f} GB/s")
    return line


def table(doc: dict) -> str:
    head = ("| context | new | io backend | recompute TTFT | prefill TFLOP/s | host-hit TTFT | device-hit TTFT | "
            "speedup | bound | copy limit | 10x | bound ok | same first token |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for r in doc["rows"]:
        lines.append(
            f"| {r['context_tokens']:,} | {r['new_tokens']} | {r['io_backend']} | {r['recompute_ttft_s'] * 1e3:.1f} ms | "
            f"{r['prefill_tflops']:.3g} | {r['host_hit_ttft_s'] * 1e3:.1f} ms | {r['device_hit_ttft_s'] * 1e3:.1f} ms | "
            f"{r['speedup']:.1f}x | {r['bound_s'] * 1e3:.1f} ms | {r['copy_limit_gbps']:.1f} GB/s | "
            f"{'yes' if r['pass_10x'] else 'NO'} | {'yes' if r['pass_bound'] else 'NO'} | "
            f"{r['first_tokens_equal']}/{r.get('first_tokens_compared', '?')} |")
    return "\n".join(lines + _storage_table(doc["rows"]))


def _storage_table(rows: list[dict]) -> list[str]:
    """The storage rows: recompute, the whole storage hit and the advisor's split, beside the disk."""
    rows = [r for r in rows if "storage_hit_ttft_s" in r]
    if not rows:
        return []
    head = ("| context | recompute TTFT | storage-hit TTFT (loaded) | advisor TTFT (loaded) | disk read | "
            "KV at disk speed | storage vs recompute | advisor within 5% | storage beats recompute where it can | "
            "same first token |")
    out = ["", head, "|---" * (head.count("|") - 1) + "|"]
    for r in rows[:: max(1, len({x["io_backend"] for x in rows}))]:
        out.append(
            f"| {r['context_tokens']:,} | {r['recompute_ttft_s'] * 1e3:.1f} ms | {r['storage_hit_ttft_s'] * 1e3:.1f} ms "
            f"({r['storage_loaded_tokens']:,.0f}) | {r['advisor_ttft_s'] * 1e3:.1f} ms ({r['advisor_loaded_tokens']:,.0f}) "
            f"| {r['disk_read_gbps']:.2f} GB/s | {r['kv_bytes'] / (r['disk_read_gbps'] * 1e9) * 1e3:.1f} ms | "
            f"{r['storage_speedup']:.1f}x | {'yes' if r['pass_advisor_5pct'] else 'NO'} | "
            f"{'yes' if r['pass_storage_beats_recompute'] else 'NO'} | {r['storage_first_tokens_equal']}/"
            f"{2 * len(r['samples']['recompute'])} |")
    return out


@click.command()
@click.option("--model", "model_name", type=click.Choice(sorted(MODELS)), default="llama-3-8b", show_default=True,
              help="llama-3-8b: the real shape, random bf16 weights (GPU); tiny: a CPU smoke test")
@click.option("--contexts", default=None,
              help="comma-separated prefix lengths [default: 16384,32768 for llama-3-8b, 1024,2048 for tiny: "
                   "its CPU recompute holds float64 scores, minutes at 16k]")
@click.option("--new-tokens", type=click.IntRange(min=1), default=128, show_default=True,
              help="fresh tokens after the prefix")
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--device", default=None, help="cuda or cpu (default: cuda if available)")
@click.option("--io-backends", default="default", show_default=True,
              help="comma-separated: default (the transfer engine's choice), direct, kernel, dma, auto")
@click.option("--layout", default="layer_first", show_default=True)
@click.option("--page-size", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, 2**63 - 1))
@click.option("--inputs", type=click.Choice(INPUT_COPIES), default="sms", show_default=True,
              help="how the engine copies each step's inputs to the GPU (EngineConfig.inputs): sms, or "
                   "pinned / pageable copy-engine copies, to see what an engine that copies them so gets")
@click.option("--storage-dir", type=click.Path(file_okay=False), default=None,
              help="where the storage rows' file stores go (default: the system's temporary directory; name one "
                   "on the disk to measure: a tmpfs keeps no page cache to drop)")
@click.option("--storage/--no-storage", "with_storage", default=True, show_default=True,
              help="the storage-hit and advisor rows")
@click.option("--json", "json_path", type=JSON_PATH, default=None, help=JSON_HELP)
def ttft(model_name, contexts, new_tokens, repeats, device, io_backends, layout, page_size, seed, inputs,
         storage_dir, with_storage, json_path):
    """TTFT of a host-tier prefix hit against recomputing the prefix (and a device hit)."""
    contexts = DEFAULT_CONTEXTS[model_name] if contexts is None else contexts
    try:
        lengths = [int(x) for x in contexts.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"{contexts!r} is not a comma-separated list of integers", param_hint="--contexts")
    if not lengths or min(lengths) < page_size:
        raise click.BadParameter(f"every context must be >= page_size={page_size}", param_hint="--contexts")
    if any(L % page_size for L in lengths):
        raise click.BadParameter(f"contexts must be multiples of page_size={page_size} (whole pages are cached)",
                                 param_hint="--contexts")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    backends = [None if b.strip() == "default" else b.strip() for b in io_backends.split(",") if b.strip()]
    if not backends:
        raise click.BadParameter(f"{io_backends!r} names no io backend; give one or more, comma-separated "
                                 "(default, direct, kernel, dma, auto)", param_hint="--io-backends")
    check_engine_flags(device, layout, MODELS[model_name]().kv_spec().kind, backends, "--io-backends")
    if storage_dir is not None and not (os.path.isdir(storage_dir) and os.access(storage_dir, os.W_OK)):
        raise click.BadParameter(f"{storage_dir!r} is not a writable directory; create it or leave --storage-dir out",
                                 param_hint="--storage-dir")
    try:
        doc = run(model_name, lengths, new_tokens, repeats, device, backends, layout, page_size, seed, inputs=inputs,
                  storage_dir=(storage_dir or tempfile.gettempdir()) if with_storage else None)
    except MemoryError as e:
        raise click.ClickException(str(e)) from None
    echo = echo_for(json_path)
    echo("")
    echo(table(doc))
    if json_path:
        write_json(json_path, doc, said="json: {}", indent=2, default=str)
    differ = [r for r in doc["rows"] if r["first_tokens_equal"] != r["first_tokens_compared"]]
    if differ:
        raise click.ClickException(
            f"a host hit's first token differs from recomputing's in {len(differ)} row(s) (context "
            f"{differ[0]['context_tokens']:,}, {differ[0]['io_backend']}): the cache changed the output")
