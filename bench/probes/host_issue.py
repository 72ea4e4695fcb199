"""Probe: is a DMA transfer limited by the host queueing it, by its gather/scatter kernels, or by its layer groups?

For 32k-token cases on allocator slots (MHA layer_first and page_head, MLA layer_first and
page_first, DSA layer_first), with the DMA backend under four settings: ``default`` (32 MiB
staging, gathers on 16 blocks: the baseline), ``blocks48``, ``stg128`` and ``stg128_blocks48``
(today's ``DMAConfig()``), it times the host's queueing and the device time of a backup, a load
and both at once (either order), and the gather and scatter kernels alone on one chunk; for the
page-major layouts, loads with the layers per copy forced (``g4`` ... ``g61``, also with 6
buffers and 8 MiB staging). Also writes a cProfile of one backup and load to ``OUT_profile.txt``.

Run: ``PYTHONPATH=. python bench/probes/host_issue.py OUT.json``.
Backs: ``DMAConfig.staging_bytes`` (128 MiB: a 4 GiB MHA backup's host time 22 -> 9 ms),
``gather_blocks`` (48: DSA loads 38.9 -> 53.2 GB/s, gathers 158 -> 246 GB/s), ``buffers`` (6 gain
nothing over 3), ``load_group``/``group_target`` (the grouped-load rates, which the CPU tests of the group
choice read).
Current answer: ``bench/results/h200/probes.json ("host_issue")``.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import torch

from kvtier.bench.transfer import Case
from kvtier.transfer import TransferEngine
from kvtier.transfer.dma import DMABackend, DMAConfig, MiB

out: dict = {}
PATH = sys.argv[1] if len(sys.argv) > 1 else "/tmp/probe_host_issue.json"
BASE = dict(staging_bytes=32 * MiB, gather_blocks=16)  # the baseline the defaults are measured against


def log(k, v):
    out[k] = v
    print(k, v, flush=True)
    with open(PATH, "w") as f:
        json.dump(out, f, indent=1)


def engine(case, cfg):
    eng = TransferEngine(case.host, "dma")
    eng.backend = DMABackend(cfg)
    return eng


def timed(eng, case, idx, direction, reps=3):
    """(GB/s, host seconds to queue, per-stream seconds for 'both')."""
    h1, d1, h2, d2 = idx
    res = []
    for i in range(reps + 1):
        torch.cuda.synchronize()
        a = torch.cuda.Event(enable_timing=True)
        eb, el = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t0 = time.perf_counter()
        if direction in ("backup", "both", "both_rev"):
            if direction == "both_rev":
                ld = eng.load(h2, d2)
                el.record(eng.load_stream)
            hd = eng.backup(h1, d1)
            eb.record(eng.backup_stream)
        if direction in ("load", "both"):
            ld = eng.load(h2 if direction == "both" else h1, d2 if direction == "both" else d1)
            el.record(eng.load_stream)
        host = time.perf_counter() - t0
        torch.cuda.synchronize()
        tb = a.elapsed_time(eb) / 1e3 if direction != "load" else 0.0
        tl = a.elapsed_time(el) / 1e3 if direction != "backup" else 0.0
        if i:
            res.append((max(tb, tl), host, tb, tl))
    t, host, tb, tl = (float(np.median([r[k] for r in res])) for k in range(4))
    n = case.nbytes * (2 if direction.startswith("both") else 1)
    return {"gbps": round(n / t / 1e9, 2), "host_ms": round(host * 1e3, 2),
            "backup_ms": round(tb * 1e3, 2), "load_ms": round(tl * 1e3, 2), "total_ms": round(t * 1e3, 2)}


def kernel_alone(eng, case, idx, to_host):
    """Gather (or scatter) of one full staging chunk of part 0, on its own: GB/s of device bytes."""
    from kvtier.transfer.triton_kernels import copy_items
    be = eng.backend
    h1, d1, _, _ = idx
    part = case.host.transfer_parts()[0]
    h_np = h1.numpy()
    p = be.plan_part(part, h_np, to_host, whole=to_host)
    if p is None:
        return None
    if not to_host:
        p = p.plans[max(p.plans)]
    d = d1.to("cuda")
    ptrs = be.tables.get(part, d.device)
    buf = torch.empty(p.staging_bytes, dtype=torch.uint8, device="cuda")
    j0, m, _ = p.chunk(0)
    layers = part.layer_num if to_host else max(1, p.staging.layer_num)
    fn = lambda: copy_items(p.staging, buf, part.device_layers, ptrs, None, d, j0, m, 0, layers, to_host,
                            be.config.gather_blocks)
    from kvtier.transfer.cuda_common import event_seconds
    s = event_seconds(fn, reps=5)
    return round(m * layers * part.item_bytes / s / 1e9, 1)


def profile_host(path):
    """Where the host time of queueing one DMA backup and one load goes (cProfile, by own time)."""
    import cProfile
    import io
    import pstats
    case = Case("mha", "layer_first", 1, 32768, "cuda", None)
    idx = case.indices(False, np.random.default_rng(1))
    eng = engine(case, DMAConfig())
    h1, d1, _, _ = idx
    for _ in range(2):
        eng.backup(h1, d1), eng.load(h1, d1)
        torch.cuda.synchronize()
    text = io.StringIO()
    for direction in ("backup", "load"):
        prof = cProfile.Profile()
        prof.enable()
        getattr(eng, direction)(h1, d1)
        prof.disable()
        torch.cuda.synchronize()
        text.write(f"== {direction}\n")
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    open(path, "w").write(text.getvalue())
    case.host.close()


def main():
    profile_host(PATH.replace(".json", "_profile.txt"))
    rng = np.random.default_rng(0)
    cases = [("mha", "layer_first"), ("mha", "page_head"), ("mla", "layer_first"), ("mla", "page_first"),
             ("dsa", "layer_first")]
    for kind, layout in cases:
        case = Case(kind, layout, 1, 32768, "cuda", None)
        idx = case.indices(False, rng)
        name = f"{kind}/{layout}"
        for label, cfg in (("default", DMAConfig(**BASE)), ("blocks48", DMAConfig(**dict(BASE, gather_blocks=48))),
                           ("stg128", DMAConfig(**dict(BASE, staging_bytes=128 * MiB))),
                           ("stg128_blocks48", DMAConfig(staging_bytes=128 * MiB, gather_blocks=48))):
            eng = engine(case, cfg)
            for direction in ("backup", "load", "both", "both_rev"):
                log(f"{name}/{label}/{direction}", timed(eng, case, idx, direction))
            if label in ("default", "blocks48"):
                log(f"{name}/{label}/gather_alone_gbps", kernel_alone(eng, case, idx, True))
                log(f"{name}/{label}/scatter_alone_gbps", kernel_alone(eng, case, idx, False))
            log(f"{name}/{label}/groups", eng.backend.last_groups)
        pl = case.host.transfer_parts()[0].host
        if pl.layer_stride == pl.chunk_bytes:  # page-major: forced layers per copy
            for g in (4, 8, 16, 32, pl.layer_num):
                if g > pl.layer_num:
                    continue
                for label, cfg in (("", DMAConfig(**BASE, load_group=g)),
                                   ("_blocks48", DMAConfig(**dict(BASE, gather_blocks=48), load_group=g)),
                                   ("_buf6", DMAConfig(**BASE, load_group=g, buffers=6)),
                                   ("_stg8", DMAConfig(**dict(BASE, staging_bytes=8 * MiB), load_group=g))):
                    log(f"{name}/g{g}{label}/load", timed(engine(case, cfg), case, idx, "load"))
        case.host.close()
        del case
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
