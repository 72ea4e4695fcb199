"""Probe: do MLA's single-token rows move steadier with a host row pitch that keeps them
inside 4 KiB blocks?

The zero-copy kernel writes MLA's 1,152-byte layer_first rows to scattered host slots at
0.85-0.95x, swinging between processes (runs 98-103), while MHA's 2,048-byte rows hold at
0.93-0.95x; not the engine, the NUMA node, huge pages or masked columns (runs 99-102). Packed
at 1,152 bytes, a row starts on a 128-byte boundary and about a quarter of rows cross a
4 KiB boundary, which a PCIe request may not cross; a row pitch of 2,048 bytes never crosses,
1,280 and 1,536 still do.

Here, MLA layer_first single tokens to scattered host slots, the kernel alone on device
indices, in turn: the pool's own rows (packed), and the same device rows written to and read
from a host buffer of the same kind (registered, huge pages) laid out with a row pitch of
1,280, 1,536 and 2,048 bytes. Backups (all layers) and per-layer loads. Run in several
processes (the device command runs it twice).
Predictions: if crossings cost, pitch 2,048 reaches MHA's 0.94x in every process and 1,280 /
1,536 sit between; else all pitches within 0.01x of packed in each process.
Usage: python bench/probes/row_pitch.py OUT.json [--tokens N]
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kvtier.bench.transfer import Case
from kvtier.layouts import Placement
from kvtier.memory import HostBuffer
from kvtier.transfer.kernel import KernelBackend, on_device
from probelib import JsonLog, args, cell, in_turn, start

PATH, TOKENS = args("/tmp/probe_row_pitch.json")
log = JsonLog(PATH, tokens=TOKENS)


def main() -> None:
    torch.cuda.set_stream(torch.cuda.Stream())
    clock, limits, rng = start(log)
    kb = KernelBackend()
    case = Case("mla", "layer_first", 1, TOKENS, "cuda", None)
    h, d = case.indices(True, rng)[:2]
    dev = torch.device("cuda")
    hg, dg = on_device(h, dev), on_device(d, dev)
    (part,) = case.host.transfer_parts()
    pl, layers, size = part.host, case.host.layer_num, case.host.size
    variants, buffers = {"packed, 1152 B": part}, []
    for pitch in (1280, 1536, 2048):
        nbytes = layers * size * pitch
        buf = HostBuffer((nbytes,), torch.uint8, pin=True, huge_pages=True)
        buffers.append(buf)
        variants[f"pitch {pitch} B"] = replace(
            part, host_raw=buf.tensor,
            host=Placement(1, pitch, pitch, size * pitch, 0, pl.chunk_bytes, 1, layers, nbytes), mapped=None)
    log("huge_page_share", {"packed, 1152 B": round(case.host.huge_page_share(), 3)})
    for direction, to_host in (("backup", True), ("load", False)):
        steps = [None] if to_host else list(range(layers))

        def arm(p):
            def go():
                for layer in steps:
                    kb.copy_part(p, hg, dg, layer, 32)
            return lambda: case.nbytes / clock.once(go) / 1e9
        times = in_turn({k: arm(p) for k, p in variants.items()}, lambda fn: fn(), rounds=5)
        log(f"mla/layer_first/p1/scattered/{direction}", {k: cell(g, limits[direction]) for k, g in times.items()})
    for b in buffers:
        b.release()
    case.host.close()


if __name__ == "__main__":
    main()
