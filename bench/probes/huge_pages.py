"""Probe: do host pools backed by 2 MiB pages move short rows faster than 4 KiB pages?

A layer_first page-64 backup to scattered host pages moves one 72 KiB row per page and layer
(MLA); in 4 KiB pages each row spans 18 pages the GPU translates separately. Part 1, the copies
alone, in turn, into a 4.6 GB host buffer laid out as an MLA layer_first page-64 pool: ordinary
registered memory (4 KiB pages), ``HostBuffer(huge_pages=True)`` (its own mapping advised
``MADV_HUGEPAGE``, then registered) and ``cudaHostAlloc``; per buffer its share in huge pages and
the GB/s of one pitched copy per page for 512 random pages, and of one contiguous 1 GiB copy,
each way. Part 2, the engine, in turn, on MLA, MHA and DSA layer_first page-64 pools made with
and without huge pages (the same slots): dma and kernel backups and loads to scattered host
pages, dma on allocator slots, dma backup and load at once. Logs the machine's transparent huge
page setting and NUMA layout.

Run: ``PYTHONPATH=.:bench/probes python bench/probes/huge_pages.py OUT.json [--tokens N]``.
Backs: host pools in 2 MiB pages by default (``HostBuffer(huge_pages=)``, ``KVTIER_HOST_HUGE_PAGES``,
``memory.HUGE_PAGE``): the zero-copy kernel gains on every scattered row (MLA backup 0.858x ->
0.897x, load 0.846x -> 0.890x; MHA 0.897x -> 0.931x, 0.878x -> 0.902x; DSA 0.799x -> 0.833x,
0.816x -> 0.856x), the copy engines move within -0.02 to +0.014x.
Current answer: ``bench/results/h200/probes.json ("huge_pages")``.
"""

from __future__ import annotations

import copy
import subprocess

import numpy as np
import torch

from kvtier.bench.transfer import Case, measure
from kvtier.host_pool import host_pool_for
from kvtier.memory import HostBuffer, huge_page_bytes
from kvtier.transfer import TransferEngine
from kvtier.transfer.cudart import memcpy2d
from kvtier.transfer.cuda_common import event_seconds
from probelib import JsonLog, args, cell, in_turn, read_text, start

PATH, TOKENS = args("/tmp/probe_huge_pages.json")
log = JsonLog(PATH, tokens=TOKENS)
LAYERS, PAGES, ROW = 61, 1024, 64 * 1152  # an MLA layer_first page-64 host pool of 65,536 slots
MOVED = 512


def machine() -> dict:
    out = {"thp": read_text("/sys/kernel/mm/transparent_hugepage/enabled"),
           "thp_defrag": read_text("/sys/kernel/mm/transparent_hugepage/defrag")}
    for name, cmd in (("numa", ["lscpu"]), ("topo", ["nvidia-smi", "topo", "-m"])):
        try:
            text = subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout
        except (OSError, subprocess.SubprocessError) as e:
            text = repr(e)
        out[name] = [ln for ln in text.splitlines() if name != "numa" or "NUMA" in ln]
    return out


def buffers() -> dict[str, torch.Tensor]:
    n = LAYERS * PAGES * ROW
    bufs = {"4 KiB pages": HostBuffer((n,), torch.uint8, huge_pages=False),
            "huge pages": HostBuffer((n,), torch.uint8, huge_pages=True)}
    out = {k: b.tensor for k, b in bufs.items()}
    out["cudaHostAlloc"] = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    out["cudaHostAlloc"].fill_(0)  # touched, as registering touches the others
    log("buffers", {k: {"huge_share": round(huge_page_bytes(t) / t.numel(), 3)} for k, t in out.items()})
    out["_keep"] = bufs
    return out


def part1(limits) -> None:
    bufs = buffers()
    keep = bufs.pop("_keep")
    rng = np.random.default_rng(1)
    pages = np.sort(rng.permutation(PAGES)[:MOVED])
    stg = torch.empty(MOVED * LAYERS * ROW, dtype=torch.uint8, device="cuda")
    big = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    s = torch.cuda.current_stream().cuda_stream
    layer = PAGES * ROW

    def pitched(host: torch.Tensor, to_host: bool) -> float:
        base, sb = host.data_ptr(), stg.data_ptr()

        def go():
            for i, p in enumerate(pages.tolist()):
                h, d = base + p * ROW, sb + i * ROW
                if to_host:
                    memcpy2d(h, layer, d, MOVED * ROW, ROW, LAYERS, s)
                else:
                    memcpy2d(d, MOVED * ROW, h, layer, ROW, LAYERS, s)
        return MOVED * LAYERS * ROW / event_seconds(go, reps=1) / 1e9

    def contiguous(host: torch.Tensor, to_host: bool) -> float:
        h = host[: 1 << 30]
        return (1 << 30) / event_seconds(lambda: (h.copy_(big, non_blocking=True) if to_host
                                                  else big.copy_(h, non_blocking=True)), reps=1) / 1e9
    arms = {}
    for name, t in bufs.items():
        arms[f"{name}, pitched 72 KiB rows, to host"] = lambda t=t: pitched(t, True)
        arms[f"{name}, pitched 72 KiB rows, to device"] = lambda t=t: pitched(t, False)
        arms[f"{name}, contiguous 1 GiB, to host"] = lambda t=t: contiguous(t, True)
        arms[f"{name}, contiguous 1 GiB, to device"] = lambda t=t: contiguous(t, False)
    times = in_turn(arms, lambda fn: fn(), rounds=5)
    log("copies", {k: cell(g, limits["backup" if "to host" in k else "load"]) for k, g in times.items()})
    del bufs, keep, stg, big
    torch.cuda.empty_cache()


def part2(clock, limits, rng) -> None:
    for kind in ("mla", "mha", "dsa"):
        case = Case(kind, "layer_first", 64, TOKENS, "cuda", None)  # ordinary pages
        huge = copy.copy(case)
        huge.host = host_pool_for(case.dev, "layer_first", host_size_tokens=case.host.size, validate_indices=False,
                                  huge_pages=True)
        log(f"{kind}/huge_share", {name: round(sum(huge_page_bytes(t) for t in c.host.component_tensors.values())
                                              / c.nbytes / 2, 3) for name, c in (("4 KiB", case), ("huge", huge))})
        idx, alloc = case.indices(True, rng), case.indices(False, rng)
        huge.host.clear()
        engines = {(name, be): TransferEngine(c.host, be) for name, c in (("4 KiB", case), ("huge", huge))
                   for be in ("dma", "kernel")}
        cases = {"4 KiB": case, "huge": huge}
        for slots, which, rows in (("scattered", idx, (("dma", "backup"), ("kernel", "backup"), ("dma", "load"),
                                                        ("kernel", "load"), ("dma", "both"))),
                                   ("allocator", alloc, (("dma", "backup"), ("dma", "load")))):
            arms = {f"{name}, {be}, {d}": (lambda c=cases[name], e=engines[(name, be)], d=d, w=which:
                                           measure(c, e, d, w, clock, 1))
                    for be, d in rows for name in cases}
            times = in_turn(arms, lambda fn: fn())
            log(f"{kind}/layer_first/p64/{slots}",
                {k: cell(g, limits["load" if k.endswith("load") else "backup"])
                 for k, g in times.items()})
        for c in cases.values():
            c.host.close()
        del case, huge, engines, cases
        torch.cuda.empty_cache()


def main() -> None:
    log("machine", machine())
    torch.cuda.set_stream(torch.cuda.Stream())  # batched copies refuse the legacy default stream
    clock, limits, rng = start(log)
    part1(limits)
    part2(clock, limits, rng)


if __name__ == "__main__":
    main()
