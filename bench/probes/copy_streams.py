"""Probe: do small copies to scattered host places go faster spread over several streams?

The rows this hardware was said to block rest on one measurement: batched 1-D copies of one
size to random places in pinned host memory, all queued on one stream, reached 0.55x of the
link at 64 KiB and 0.71x at 128 KiB device to host, 0.96x only from 1 MiB (run 17,
``probe_copy_size_h200.json``). So layer_first page-64 backups to scattered host pages (one
73-128 KiB copy per page and layer) run at 0.75-0.87x by DMA and 0.87-0.90x by the zero-copy
kernel (run 81). The DMA backend queues every copy of a transfer on one stream. An H200 has
several copy engines; if one engine's rate of copies bounds small copies, copies spread over
streams that land on different engines go faster, up to the link.

Arms, each way, for 256 MiB moved as copies of 16, 64, 128, 256 KiB and 1 MiB between a device
buffer and random places in a 1 GiB pinned host buffer: the copies split into K contiguous
shares (K = 1, 2, 4), each share queued on its own stream (all after one start event) as
``cudaMemcpyBatchAsync`` calls of at most ``PER_CALL`` copies, as the DMA backend queues a
chunk's copies; the end waits for every stream. At 64 and 128 KiB also both ways at once
(each way on its own K streams), against the duplex limit. And device to host as a
layer_first backup to scattered pages queues it: one pitched copy per page, 61 rows (layers)
of 64 or 128 KiB, a layer's stride apart on the host, ``cudaMemcpy2DAsync`` each, the pages
split over the K streams. Median of five, after a warm-up.
Predictions: if one engine's rate of copies bounds them, K = 2 runs 64-128 KiB copies up to
twice as fast, to the link's rate; if the link or the host's memory system does (the IOMMU,
the host's writes to scattered pages), K changes nothing.
Run 82 (``probe_copy_streams_h200.json``): more streams change nothing (within 0.01x from 64
KiB; host-to-device 16 KiB copies slower, 0.54x, 0.47x, 0.35x for 1, 2, 4). But one stream's
rates are far above run 17's: 64 KiB 0.878x device to host, 0.913x host to device (run 17:
0.548x, 0.556x), 128 KiB 0.912x / 0.941x; pitched 61 rows of 64 KiB 0.897x, of 128 KiB 0.946x.
Run 17 queued all 16,384 copies in one batched call, this probe 512 per call, as the backend.
Usage: python bench/probes/copy_streams.py OUT.json
"""

from __future__ import annotations

import numpy as np
import torch

from kvtier.transfer import cudart
from kvtier.transfer.cudart import memcpy2d
from kvtier.transfer.timing import event_seconds
from probelib import JsonLog, args, start

MiB = 1 << 20
PAYLOAD = 256 * MiB
SIZES = [16 << 10, 64 << 10, 128 << 10, 256 << 10, 1 << 20]
STREAMS = (1, 2, 4)
PER_CALL = 512
PATH, _ = args("/tmp/probe_copy_streams.json")
log = JsonLog(PATH, payload_mib=PAYLOAD // MiB, per_call=PER_CALL)


def queue(ways: list[tuple[np.ndarray, np.ndarray, int]], pool: list[torch.cuda.Stream], k: int) -> None:
    """Each way's copies ``(dst, src, size)`` in ``k`` contiguous shares, share ``i`` of way ``w``
    on stream ``w * k + i`` of ``pool``, after everything on the current stream; then the
    current stream waits for them all."""
    cur = torch.cuda.current_stream()
    for w, (dst, src, size) in enumerate(ways):
        for i, share in enumerate(np.array_split(np.arange(dst.size), k)):
            s = pool[w * k + i]
            s.wait_stream(cur)
            for j in range(0, share.size, PER_CALL):
                sel = share[j:j + PER_CALL]
                cudart.memcpy_batch(dst[sel], src[sel], np.full(sel.size, size, dtype=np.uint64), s.cuda_stream)
    for s in pool[: len(ways) * k]:
        cur.wait_stream(s)


def queue_pitched(pages: np.ndarray, width: int, height: int, host_base: int, dev_base: int,
                  pool: list[torch.cuda.Stream], k: int) -> None:
    """One pitched copy per page (``height`` rows of ``width`` bytes, ``PAYLOAD // height``
    apart on the host, packed on the device), the pages in ``k`` contiguous shares, share ``i``
    on stream ``i`` of ``pool`` after the current stream; then it waits for them all."""
    cur = torch.cuda.current_stream()
    stride = 4 * PAYLOAD // height
    for i, share in enumerate(np.array_split(np.arange(pages.size), k)):
        s = pool[i]
        s.wait_stream(cur)
        for j in share.tolist():
            memcpy2d(host_base + int(pages[j]) * width, stride, dev_base + j * width * height, width, width, height,
                     s.cuda_stream)
    for s in pool[:k]:
        cur.wait_stream(s)


def main() -> None:
    work = torch.cuda.Stream()  # batched copies refuse the legacy default stream
    torch.cuda.set_stream(work)
    pool = [torch.cuda.Stream() for _ in range(2 * max(STREAMS))]
    host = torch.empty(4 * PAYLOAD, dtype=torch.uint8, pin_memory=True)  # room to scatter into
    dev = torch.empty(2 * PAYLOAD, dtype=torch.uint8, device="cuda")      # one half per way
    _, limits, rng = start(log, PAYLOAD)  # the bench's contiguous limits, on copies of this size
    limit = {"d2h": limits["backup"], "h2d": limits["load"], "both": limits["duplex"]}
    for size in SIZES:
        n = PAYLOAD // size
        # Two disjoint sets of host places (the backup's and the load's, for both at once).
        places = rng.permutation(4 * PAYLOAD // size)[: 2 * n].astype(np.uint64) * np.uint64(size)
        h_out, h_in = places[:n] + np.uint64(host.data_ptr()), places[n:] + np.uint64(host.data_ptr())
        d_out = np.arange(n, dtype=np.uint64) * np.uint64(size) + np.uint64(dev.data_ptr())
        d_in = d_out + np.uint64(PAYLOAD)
        ways = {"d2h": [(h_out, d_out, size)], "h2d": [(d_in, h_in, size)]}
        if size in (64 << 10, 128 << 10):
            ways["both"] = ways["d2h"] + ways["h2d"]
        for way, spec in ways.items():
            cells = {}
            for k in STREAMS:
                t = event_seconds(lambda: queue(spec, pool, k), 5)
                g = len(spec) * PAYLOAD / t / 1e9
                cells[f"{k} streams"] = {"gbps": round(g, 2), "ratio": round(g / limit[way], 3)}
            log(f"{way}/{size >> 10}KiB", {"copies": n, **cells})
        if size in (64 << 10, 128 << 10):
            height = 61
            n_pages = PAYLOAD // (size * height)
            pages = rng.permutation(4 * PAYLOAD // height // size)[:n_pages]
            cells = {}
            for k in STREAMS:
                t = event_seconds(lambda: queue_pitched(pages, size, height, host.data_ptr(), dev.data_ptr(), pool, k), 5)
                g = n_pages * size * height / t / 1e9
                cells[f"{k} streams"] = {"gbps": round(g, 2), "ratio": round(g / limit["d2h"], 3)}
            log(f"d2h_pitched/{size >> 10}KiBx{height}", {"copies": int(n_pages), **cells})


if __name__ == "__main__":
    main()
