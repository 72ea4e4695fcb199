"""Probe: from what copy size does the copy engine keep pace with PCIe, each way?

Run 16 (bench/NOTES_transfer.md): backups of host pages scattered at page 64 ran at
0.73-0.81x (copies of 73-128 KiB) while the same copies loaded at 0.95x, and the
DMA backend sends parts whose copies average under 32 KiB through the kernel.
This times batched 1-D copies (``cudaMemcpyBatchAsync``, as the DMA backend queues
them) of one size between a device buffer and host slots at random places in a
registered host buffer, both ways, for sizes 16 KiB .. 4 MiB, 256 MiB per batch,
and reports GB/s and the ratio to one contiguous copy of the same bytes.
Usage: python bench/probes/copy_size.py OUT.json
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch

from kvtier.transfer import cudart
from kvtier.transfer.timing import event_seconds

MiB = 1 << 20
PAYLOAD = 256 * MiB
SIZES = [16 << 10, 32 << 10, 64 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20, 4 << 20]


def main(path: str) -> None:
    work = torch.cuda.Stream()  # batched copies refuse the legacy default stream
    torch.cuda.set_stream(work)
    s = work.cuda_stream
    host = torch.empty(4 * PAYLOAD, dtype=torch.uint8, pin_memory=True)  # room to scatter into
    dev = torch.empty(PAYLOAD, dtype=torch.uint8, device="cuda")
    out: dict = {}

    def log(key, value):
        out[key] = value
        print(key, value, flush=True)
        with open(path, "w") as f:
            json.dump(out, f, indent=1)

    limit = {
        "d2h": PAYLOAD / event_seconds(lambda: host[:PAYLOAD].copy_(dev, non_blocking=True), 5) / 1e9,
        "h2d": PAYLOAD / event_seconds(lambda: dev.copy_(host[:PAYLOAD], non_blocking=True), 5) / 1e9,
    }
    log("limit_gbps", {k: round(v, 2) for k, v in limit.items()})
    rng = np.random.default_rng(0)
    for size in SIZES:
        n = PAYLOAD // size
        slots = rng.permutation(4 * PAYLOAD // size)[:n].astype(np.uint64)
        h_addr = slots * np.uint64(size) + np.uint64(host.data_ptr())
        d_addr = np.arange(n, dtype=np.uint64) * np.uint64(size) + np.uint64(dev.data_ptr())
        sizes = np.full(n, size, dtype=np.uint64)
        for way, (dst, src) in (("d2h", (h_addr, d_addr)), ("h2d", (d_addr, h_addr))):
            t = event_seconds(lambda: cudart.memcpy_batch(dst, src, sizes, s), 5)
            g = PAYLOAD / t / 1e9
            log(f"{way}/{size >> 10}KiB", {"gbps": round(g, 2), "ratio": round(g / limit[way], 3), "copies": n})


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/probe_copy_size.json")
