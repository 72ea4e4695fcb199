"""``kvtier bench ttft``: time to first token when a long prefix is in the host tier, against recomputing it.

For each context length ``L`` the reference engine serves prompts of
``L`` shared-prefix tokens plus ``new`` fresh ones, three ways, in one run:

- **recompute**: no prefix cache; the whole prompt is prefilled (fused
  attention: torch's ``scaled_dot_product_attention``);
- **host hit**: the prefix was served before, backed up to the host tier and
  evicted from the device; it is loaded back layer by layer while the
  forward pass of the new tokens runs;
- **device hit**: the prefix is still on the device: only the new tokens are
  prefilled (the floor a host hit can approach).

The same run measures the contiguous-copy limit (one pinned host -> device
copy of the prefix's KV bytes). Acceptance (on the GPU): host-hit TTFT at
least 10x below recompute, and at most ``1.2 x KV bytes / limit + device-hit
TTFT``, which shows the loads overlap the forward pass.
"""

from __future__ import annotations

import random
import statistics
import time

import click
import torch

from ..commands import JSON_HELP, JSON_PATH, check_engine_flags, echo_for, write_json
from ..engine import Engine, EngineConfig, Sequence, llama3_8b, tiny
from ..engine.config import INPUT_COPIES
from ..engine.engine import make_model

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
        layout: str, page_size: int, seed: int, echo=click.echo, inputs: str = "sms") -> dict:
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
    names = {b: e.kv.cache.engine.io_backend for b, e in tiers.items()}
    echo(f"model {model_name} ({mcfg.kv_spec().describe()}) on {device}, built in {time.perf_counter() - t0:.1f} s; "
         f"io backends {list(names.values())}")
    rng = random.Random(seed)
    serve(none, [rng.randrange(mcfg.vocab_size) for _ in range(min(lengths))])  # warm-up: kernels, allocator
    for e in tiers.values():
        serve(e, [rng.randrange(mcfg.vocab_size) for _ in range(new)])
    rows = []
    for L in lengths:
        limit = copy_limit_gbps(L * mcfg.kv_spec().bytes_per_token, dev)
        prefix = [rng.randrange(mcfg.vocab_size) for _ in range(L)]
        prompts = [prefix + [rng.randrange(mcfg.vocab_size) for _ in range(new)]
                   for _ in range(2 * repeats + max(map(warm_hits, tiers.values())))]
        recompute, ref_outputs = recompute_ttfts(none, prompts[:repeats])
        for b, e in tiers.items():
            hits = hit_ttfts(e, prefix, prompts[:repeats], prompts[repeats:2 * repeats],
                             prompts[2 * repeats:2 * repeats + warm_hits(e)])
            same = sum(a == c for a, c in zip(ref_outputs, hits["outputs"]))
            rows.append(_row(mcfg, L, new, limit, names[b], recompute, hits, same))
            echo(_line(rows[-1]))
    device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    return {"model": model_name, "device": device_name, "layout": layout, "page_size": page_size,
            "inputs": inputs, "repeats": repeats, "torch": torch.__version__, "rows": rows,
            "cache_metrics": {names[b]: e.kv.metrics() for b, e in tiers.items()}}


def _line(r: dict) -> str:
    return (f"{r['context_tokens']:>6} ctx + {r['new_tokens']} new [{r['io_backend']}]: recompute {r['recompute_ttft_s'] * 1e3:8.1f} ms "
            f"({r['prefill_tflops']:.3g} TFLOP/s) | host hit {r['host_hit_ttft_s'] * 1e3:7.1f} ms "
            f"| device hit {r['device_hit_ttft_s'] * 1e3:6.1f} ms | {r['speedup']:5.1f}x "
            f"| bound {r['bound_s'] * 1e3:6.1f} ms (KV {r['kv_bytes'] / 1e9:.3g} GB, limit {r['copy_limit_gbps']:.1f} GB/s)")


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
    return "\n".join(lines)


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
@click.option("--json", "json_path", type=JSON_PATH, default=None, help=JSON_HELP)
def ttft(model_name, contexts, new_tokens, repeats, device, io_backends, layout, page_size, seed, inputs, json_path):
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
    try:
        doc = run(model_name, lengths, new_tokens, repeats, device, backends, layout, page_size, seed, inputs=inputs)
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
