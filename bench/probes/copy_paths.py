"""Probe: how fast each way of moving strided KV rows over PCIe runs on this GPU.

Measures, against the contiguous pinned copy of the same run: pitched 2-D copies by row width
and pitch (section 1, and the width/pitch pairs grouped page-major loads make); batched 1-D
copies (``cudaMemcpyBatchAsync``) against one runtime call per copy, GPU GB/s and host us per
copy (2); the zero-copy Triton kernel by blocks (16-132), tile bytes and warps (3); kernel and
copy engine each on part of the rows (4); host time to queue a 4k-token per-layer load (5).

Run: ``PYTHONPATH=. python bench/probes/copy_paths.py OUT.json [SECTIONS]`` (SECTIONS: digits,
default ``12345``; the kept result is sections 2-5 and the page-major pairs).
Backs: ``KernelConfig.max_blocks`` (32), ``TILE_BYTES``/``NUM_WARPS`` (the kernel's rate does not
move with blocks, tile or warps), ``TALL_MIN``/``CLOSE_PITCH`` and ``auto.PITCH_ROWS`` (rows 8
widths apart move at full speed, 32 widths apart at 0.6x), ``DMAConfig.batch_min`` and
``kernel_below`` (the copy engine's cost per small copy).
Current answer: ``bench/results/h200/probes.json ("copy_paths")``.
"""

from __future__ import annotations

import json
import mmap
import sys
import time

import numpy as np
import torch

from kvtier.layouts import Placement
from kvtier.memory import _register
from kvtier.transfer import cudart
from kvtier.transfer import triton_kernels as tk
from kvtier.transfer.cuda_common import event_seconds  # warm-up, then the median of reps

MiB = 1 << 20
PAYLOAD = 128 * MiB
out: dict = {}


def log(key, value):
    out[key] = value
    print(key, value, flush=True)


def gbps(nbytes, fn, reps=5):
    return round(nbytes / event_seconds(fn, reps) / 1e9, 2)


def registered(nbytes, huge: bool):
    m = mmap.mmap(-1, nbytes)
    if huge:
        m.madvise(mmap.MADV_HUGEPAGE)
    t = torch.frombuffer(m, dtype=torch.uint8)
    t.fill_(1)
    _register(t)
    return t, m


def main(path, sections):
    work = torch.cuda.Stream()  # batched copies refuse the legacy default stream
    torch.cuda.set_stream(work)
    s = work.cuda_stream
    try:
        log("thp", open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip())
    except OSError as e:
        log("thp", str(e))
    span = 32 * PAYLOAD
    hosts = {"registered": registered(span, False)[0], "thp": registered(span, True)[0],
             "hostalloc": torch.empty(span, dtype=torch.uint8, pin_memory=True)}
    dev = torch.empty(span, dtype=torch.uint8, device="cuda")
    dp = dev.data_ptr()
    # Contiguous limit on each host memory.
    for name, h in hosts.items():
        hp = h.data_ptr()
        log(f"limit/{name}/d2h", gbps(PAYLOAD * 4, lambda: cudart.memcpy2d(hp, PAYLOAD * 4, dp, PAYLOAD * 4, PAYLOAD * 4, 1, s)))
        log(f"limit/{name}/h2d", gbps(PAYLOAD * 4, lambda: cudart.memcpy2d(dp, PAYLOAD * 4, hp, PAYLOAD * 4, PAYLOAD * 4, 1, s)))
    # 1. pitched 2-D copies by width and pitch.
    for name in (("registered", "thp", "hostalloc") if "1" in sections else ()):
        hp = hosts[name].data_ptr()
        for w in (256, 1024, 2048, 4096, 8192, 16384, 65536):
            for ratio in ((2, 32) if name == "registered" else (32,)):
                pitch, rows = ratio * w, PAYLOAD // w
                log(f"ce2d/{name}/w{w}/p{ratio}/h2d", gbps(PAYLOAD, lambda: cudart.memcpy2d(dp, w, hp, pitch, w, rows, s)))
                log(f"ce2d/{name}/w{w}/p{ratio}/d2h", gbps(PAYLOAD, lambda: cudart.memcpy2d(hp, pitch, dp, w, w, rows, s)))
    # 1b. the (width, pitch) pairs a grouped per-layer load from page-major layouts makes.
    hp = hosts["registered"].data_ptr()
    pairs = [(2048 * g, 65536) for g in (1, 2, 4, 8, 16, 32)]   # MHA page_first, 32 layers
    pairs += [(1152 * g, 1152 * 61) for g in (1, 4, 8, 16, 32, 61)]  # MLA page_first, 61 layers
    pairs += [(256 * g, 8192) for g in (1, 4, 8, 16, 32)]  # MHA page_head, 32 layers of 256 B
    for w, pitch in pairs:
        rows = min(PAYLOAD // w, span // pitch - 1)
        log(f"group/w{w}/pitch{pitch}/h2d", gbps(rows * w, lambda: cudart.memcpy2d(dp, w, hp, pitch, w, rows, s)))
    # 2. batched 1-D copies vs a Python loop of single copies.
    hp = hosts["registered"].data_ptr()
    log("batch/available", cudart.has_batch())
    for w in (2048, 16384, 131072):
        n = min(PAYLOAD // w, 8192)
        rng = np.random.default_rng(0)
        hoff = rng.permutation(span // w // 2)[:n].astype(np.uint64) * np.uint64(2 * w)
        doff = np.arange(n, dtype=np.uint64) * np.uint64(w)
        sizes = np.full(n, w, dtype=np.uint64)
        for direction in ("h2d", "d2h"):
            src, dst = (hp + hoff, dp + doff) if direction == "h2d" else (dp + doff, hp + hoff)
            if cudart.has_batch():
                try:
                    fn = lambda: cudart.memcpy_batch(dst, src, sizes, s)  # noqa: E731
                    log(f"batch/w{w}/{direction}/gbps", gbps(n * w, fn))
                    t = time.perf_counter()
                    fn()
                    log(f"batch/w{w}/{direction}/cpu_us_per_copy", round((time.perf_counter() - t) / n * 1e6, 3))
                except RuntimeError as e:
                    log(f"batch/w{w}/{direction}/error", str(e))
            pairs = list(zip(dst.tolist(), src.tolist()))

            def loop():
                for a, b in pairs:
                    cudart.memcpy2d(a, w, b, w, w, 1, s)
            log(f"loop/w{w}/{direction}/gbps", gbps(n * w, loop, 3))
            torch.cuda.synchronize()
            t = time.perf_counter()
            loop()
            log(f"loop/w{w}/{direction}/cpu_us_per_copy", round((time.perf_counter() - t) / n * 1e6, 3))
    torch.cuda.synchronize()
    # 3. zero-copy kernel: 2 KiB rows 64 KiB apart (a page_first per-layer load), both ways.
    host = hosts["registered"]
    w, ratio = 2048, 32
    rows = PAYLOAD // w
    pl = Placement(1, ratio * w, 0, 0, 0, w, 1, 1, rows * ratio * w)
    layer = dev[: rows * w].view(rows, w)
    ptrs = tk.layer_ptr_table((layer,), dev.device)
    idx = torch.arange(rows, device="cuda")
    didx = torch.randperm(rows, device="cuda")
    for tile, warps in ((32768, 8), (65536, 8), (65536, 16), (16384, 4), (131072, 16)):
        tk.TILE_BYTES, tk.NUM_WARPS = tile, warps
        for blocks in (16, 32, 64, 132):
            for to_buf, direction in ((False, "h2d"), (True, "d2h")):
                log(f"kernel/t{tile}/w{warps}/b{blocks}/{direction}",
                    gbps(PAYLOAD, lambda: tk.copy_items(pl, host, (layer,), ptrs, idx, didx, 0, rows, 0, 1, to_buf, blocks)))
    tk.TILE_BYTES, tk.NUM_WARPS = 32768, 8
    # 4. kernel on a fraction of the rows while the copy engine moves the rest (h2d).
    side = torch.cuda.Stream()
    hp = host.data_ptr()
    for frac in (0.3, 0.5, 0.7):
        k = int(rows * frac)

        def hybrid():
            side.wait_stream(torch.cuda.current_stream())
            cudart.memcpy2d(dp + k * w, w, hp + k * ratio * w, ratio * w, w, rows - k, side.cuda_stream)
            tk.copy_items(pl, host, (layer,), ptrs, idx, idx, 0, k, 0, 1, False, 32)
            torch.cuda.current_stream().wait_stream(side)
        log(f"hybrid/kernel_frac{frac}/h2d", gbps(PAYLOAD, hybrid))
    json.dump(out, open(path, "w"), indent=1)
    # 5. CPU time to queue a per-layer load vs GPU time.
    from kvtier.bench.transfer import Case
    from kvtier.transfer import TransferEngine
    rng = np.random.default_rng(0)
    for kind, layout, ps in (("mha", "layer_first", 64), ("mla", "layer_first", 64), ("mha", "page_first", 1)):
        case = Case(kind, layout, ps, 4096, "cuda", None)
        h1, d1, _, _ = case.indices(False, rng)
        for backend in ("kernel", "dma", "auto"):
            eng = TransferEngine(case.host, backend)
            for direction in ("load", "backup"):
                for _ in range(3):
                    torch.cuda.synchronize()
                    a = torch.cuda.Event(enable_timing=True)
                    a.record()
                    t = time.perf_counter()
                    hd = eng.load(h1, d1) if direction == "load" else eng.backup(h1, d1)
                    cpu = time.perf_counter() - t
                    hd.synchronize()
                    b = torch.cuda.Event(enable_timing=True)
                    b.record()
                    b.synchronize()
                gpu = a.elapsed_time(b) / 1e3
                log(f"enqueue/{kind}/{layout}/p{ps}/{backend}/{direction}",
                    {"cpu_ms": round(cpu * 1e3, 3), "total_ms": round(gpu * 1e3, 3),
                     "gbps": round(case.nbytes / gpu / 1e9, 2)})
        case.host.close()
    json.dump(out, open(path, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "12345")
