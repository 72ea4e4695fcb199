"""Probe: where the reference engine's device-hit TTFT goes (llama-3-8b shape, H200).

``kvtier bench ttft`` times a device hit (the prefix already on the device, 128 new tokens)
at 28-80 ms at 16k tokens across runs (run 74: 54-80 ms; samples 40-57 ms for one backend),
and 54-75 ms at 32k, where its matmuls are about 2 TFLOP (4 ms at the prefill's 500
TFLOP/s) and attention over the prefix a few ms more. Host hits follow it, so it bounds the
speedup at 16k (6-9x in run 74). This splits one: the engine set up as the bench sets it up
(random bf16 weights, page 64, layer_first host pool, the default io backend), the prefix
served once, then device hits of other 128-token suffixes:
- five timed as the bench times them (``serve``: wall clock from the request to its token);
- (branch sdpa-gqa) five pairs in turn: KV heads read in place by the flash kernel
  (``enable_gqa``) and repeated as before (run 75: the repeats were 8.9 ms of about 23 ms
  of device work; prediction: 3-9 ms sooner, the repeats' device time and their launches);
- one under ``cProfile`` (the host's Python, top 30 by cumulative time);
- one under ``torch.profiler`` (the 25 ops with the most device time, and the 25 with the
  most host time, each with its count).
Predictions: if the host, the profile's own Python (scheduling, the prefix match, the
inputs, polling the cache) adds up to most of the wall time and the device sits idle; if
the device, a few kernels (the per-layer gathers of the prefix's K/V, the head expansion,
attention) take most of it.
Run 82 (``probe_device_hit_h200.json``, branch sdpa-gqa): device work 14.2 ms (about 23 in
run 75), no repeat kernels; the hits in turn moved from a median of 42.1 to 39.8 ms, not 3-9:
the step is the host's (1,452 kernel launches, 8.7 ms; about 30 ms of Python).
Usage: python bench/probes/device_hit.py OUT.json [--tokens N] [--smoke]   (N: the prefix, default 16384)
"""

from __future__ import annotations

import cProfile
import io
import pstats
import random
import sys
import time

import torch
from torch.autograd import DeviceType

from kvtier.bench.ttft import MODELS, serve
from kvtier.engine import Engine, EngineConfig, attention
from kvtier.engine.engine import make_model
from probelib import JsonLog, args

PATH, PREFIX = args("/tmp/probe_device_hit.json", 16384)
# ``--smoke``: the tiny model on the CPU (a check of this script, not a measurement).
SMOKE = "--smoke" in sys.argv
NEW, PAGE = 128, 64
log = JsonLog(PATH, prefix_tokens=PREFIX, new_tokens=NEW)


def main():
    mcfg = MODELS["tiny" if SMOKE else "llama-3-8b"]()
    tokens = (PREFIX + 2 * NEW) // PAGE * PAGE + 2 * PAGE
    cfg = dict(device_tokens=tokens, host_tokens=tokens, page_size=PAGE, layout="layer_first",
               device="cpu" if SMOKE else "cuda", max_batch_tokens=tokens)
    t0 = time.perf_counter()
    engine = Engine(make_model(mcfg, EngineConfig(**cfg), 0), EngineConfig(prefix_cache="tiers", **cfg))
    log("built_s", round(time.perf_counter() - t0, 1))
    rng = random.Random(0)
    prefix = [rng.randrange(mcfg.vocab_size) for _ in range(PREFIX)]

    def hit() -> float:
        seq = serve(engine, prefix + [rng.randrange(mcfg.vocab_size) for _ in range(NEW)])
        if seq.reused_device != PREFIX:
            raise RuntimeError(f"expected a {PREFIX}-token device hit, got {seq.reused_device}")
        return round(seq.ttft * 1e3, 2)
    serve(engine, prefix)  # on the device (and, written through, on the host)
    for _ in range(2):
        hit()  # warm: kernels, allocator
    log("device_hit_ms", [hit() for _ in range(5)])
    # KV heads read in place by the flash kernel (enable_gqa) against repeated, in turn.
    real = attention._flash_takes_gqa
    arms = {"gqa in the kernel": real, "heads repeated": lambda *a: False}
    rows = {k: [] for k in arms}
    for _ in range(5):
        for k, fn in arms.items():
            attention._flash_takes_gqa = fn
            rows[k].append(hit())
    attention._flash_takes_gqa = real
    log("device_hit_ms_by_attention", rows)

    prof = cProfile.Profile()
    prof.enable()
    ms = hit()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(30)
    log("cprofile", {"ttft_ms": ms, "top_cumulative": out.getvalue().splitlines()[-40:]})

    activities = [torch.profiler.ProfilerActivity.CPU] + ([] if SMOKE else [torch.profiler.ProfilerActivity.CUDA])
    with torch.profiler.profile(activities=activities) as tp:
        ms = hit()
    events = tp.key_averages()

    # A kernel's time shows twice: as its own event (device type CUDA) and in the self device
    # time of the op that launched it (device type CPU). Totals count the kernels only (run
    # 75 summed both: 45.8 ms for about 23 of device work).
    ops = [e for e in events if e.device_type == DeviceType.CPU]
    kernels = [e for e in events if e.device_type != DeviceType.CPU]

    def top(rows: list, attr: str) -> list:
        rows = sorted(rows, key=lambda e: getattr(e, attr), reverse=True)[:25]
        return [[e.key[:80], e.count, round(getattr(e, attr) / 1e3, 3)] for e in rows]
    log("torch_profiler", {"ttft_ms": ms, "device_ms_total": round(sum(e.self_device_time_total for e in kernels) / 1e3, 2),
                           "top_ops_device_ms": top(ops, "self_device_time_total"),
                           "top_kernels_ms": top(kernels, "self_device_time_total"),
                           "top_host_ms": top(ops, "self_cpu_time_total")})


if __name__ == "__main__":
    main()
