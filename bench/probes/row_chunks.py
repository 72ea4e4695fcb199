"""Probe: does the zero-copy kernel move short odd rows faster cut into 128-byte chunks?

Run 98, layer_first single tokens to scattered host slots by the kernel: MHA (2,048-byte
rows) backups 0.93x, loads 0.90x; MLA (1,152-byte rows) 0.85x and 0.89x; DSA (1,152 + 132)
0.72x and 0.85x. The kernel's tile is ``BLOCK_R`` rows by ``BLOCK_W`` words, ``BLOCK_W`` the
row's words rounded up to a power of two: a 1,152-byte row (144 8-byte words) fills 256
columns, so 44% of each tile is masked off, and a tile carries 18 KiB, not the 32 KiB its size
was chosen for (``TILE_BYTES``: enough host requests in flight per SM). Cut into 128-byte
chunks (the largest power of two dividing 1,152), a tile is 256 chunks, 32 KiB, none masked.
Against it: more SMs did not speed these rows up (run 33), nor other blocks, tiles or warps
(`probe_copy_paths_h200.json`).

Here, per kind (MLA, DSA, MHA), layer_first page 1, scattered host slots as the table draws
them, huge-page pools, in turn: each part's rows as the backend cuts them (``rows``), and
cut into chunks of 128, 256 and 512 bytes where they divide the row (a part whose row no
such chunk divides stays as it is). Backups (one launch per part, all layers) and per-layer
loads, GB/s of the whole transfer.
Predictions: MLA backups and loads within 0.01x (the run 33 and copy_paths evidence says the row's rate
is set outside the kernel); if the masked columns matter, +0.03-0.06x at 128 bytes.
Usage: python bench/probes/row_chunks.py OUT.json [--tokens N]
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kvtier.bench.transfer import Case
from kvtier.transfer.kernel import KernelBackend, on_device
from probelib import JsonLog, args, cell, in_turn, start

PATH, TOKENS = args("/tmp/probe_row_chunks.json")
log = JsonLog(PATH, tokens=TOKENS)


def cut(part, chunk: int):
    """``part`` with each item cut into ``chunk``-byte pieces, or None where that is not possible."""
    pl = part.host
    if pl.n_chunks != 1 or pl.item_bytes % chunk or pl.item_bytes == chunk:
        return None
    return replace(part, host=replace(pl, chunk=chunk, chunk_bytes=chunk, n_chunks=pl.item_bytes // chunk))


def main() -> None:
    torch.cuda.set_stream(torch.cuda.Stream())
    clock, limits, rng = start(log)
    kb = KernelBackend()
    for kind in ("mla", "dsa", "mha"):
        case = Case(kind, "layer_first", 1, TOKENS, "cuda", None)
        idx = case.indices(True, rng)
        parts = case.host.transfer_parts()
        layers = case.host.layer_num
        dev = torch.device("cuda")
        h, d = on_device(idx[0], dev), on_device(idx[1], dev)
        variants = {"rows": parts}
        for c in (128, 256, 512):
            got = [cut(p, c) for p in parts]
            if any(got):
                variants[f"{c} B chunks"] = [g or p for g, p in zip(got, parts)]
        log(f"{kind}/parts", {p.name: p.item_bytes for p in parts})
        for direction, to_host in (("backup", True), ("load", False)):
            def arm(ps, to_host=to_host):
                def go():
                    for layer in ([None] if to_host else range(layers)):
                        for p in ps:
                            kb.copy_part(p, h, d, layer, 32)
                return lambda: case.nbytes / clock.once(go) / 1e9
            times = in_turn({k: arm(v) for k, v in variants.items()}, lambda fn: fn())
            log(f"{kind}/layer_first/p1/scattered/{direction}",
                {k: cell(g, limits[direction]) for k, g in times.items()})
        case.host.close()
        del case, parts, h, d
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
