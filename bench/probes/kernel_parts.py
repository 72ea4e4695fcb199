"""Probe: does the zero-copy kernel move a transfer's parts faster side by side?

The kernel backend moves a transfer's parts one after another on one stream: K then V for
MHA, the latent rows then the index-K rows for DSA. Run 93 (huge-page pools): DSA's
layer_first scattered backups by the kernel ran at 0.826x (page 64) and 0.733x (page 1), MLA's
alone (the same latent rows, no index-K part) at 0.920x and 0.875x. DSA's index-K part is a
tenth of the bytes in 132-byte rows; if the kernel moves such rows slowly (short of the link),
it holds the link idle for its share of the time, and run beside the latent part it would
fill the link's slack instead.

Here, per kind (DSA, MHA) and page size (64, 1), layer_first, scattered host pages as the
transfer table draws them, on a huge-page host pool, in turn: ``engine`` (the kernel backend
through the engine, as the table times it), ``in turn, 32`` (the parts one after another on
one stream, 32 blocks each: what the backend does, without the engine), and the parts side
by side, the largest on the current stream and the others on a second one, with ``32 + 32``,
``24 + 8`` and ``16 + 16`` blocks (largest + others). A backup moves every layer in one
launch per part; a per-layer load one launch per part and layer. GB/s of the whole transfer.
Also each part alone (32 blocks), to see how fast the kernel moves each kind of row.
Predictions: DSA side by side 32 + 32 gains 0.03-0.07x on backups and loads where the index
part alone runs well below the latent part's GB/s; MHA (two equal parts) within 0.01x; with
fewer blocks for the others (24 + 8) the gain shrinks if the index part is latency-bound.
Usage: python bench/probes/kernel_parts.py OUT.json [--tokens N]
"""

from __future__ import annotations

import torch

from kvtier.bench.transfer import Case, measure
from kvtier.transfer import TransferEngine, streams
from kvtier.transfer.kernel import KernelBackend, on_device
from probelib import JsonLog, args, cell, in_turn, start

PATH, TOKENS = args("/tmp/probe_kernel_parts.json")
log = JsonLog(PATH, tokens=TOKENS)


def timed(fn) -> float:
    """Seconds of the work ``fn`` queues on the current stream (it joins any other stream it
    uses back into the current one)."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 1e3


def moves(kb: KernelBackend, parts, h, d, layers: int, to_host: bool, blocks: tuple[int, int] | None,
          side: torch.cuda.Stream, only: int | None = None):
    """Queue a backup (``to_host``) or a per-layer load of ``parts``: in turn on the current
    stream at 32 blocks (``blocks`` None), or the largest part on the current stream with
    ``blocks[0]`` and the others beside it on ``side`` with ``blocks[1]``. ``only``: that part alone."""
    cur = torch.cuda.current_stream()
    order = sorted(range(len(parts)), key=lambda i: -parts[i].item_bytes)
    steps = [None] if to_host else list(range(layers))

    def go():
        for layer in steps:
            if only is not None:
                kb.copy_part(parts[only], h, d, layer, 32)
            elif blocks is None:
                for p in parts:
                    kb.copy_part(p, h, d, layer, 32)
            else:
                side.wait_stream(cur)
                kb.copy_part(parts[order[0]], h, d, layer, blocks[0])
                with torch.cuda.stream(side):
                    for i in order[1:]:
                        kb.copy_part(parts[i], h, d, layer, blocks[1])
                cur.wait_stream(side)
    return go


def main() -> None:
    torch.cuda.set_stream(torch.cuda.Stream())
    clock, limits, rng = start(log)
    kb = KernelBackend()
    for kind in ("dsa", "mha"):
        for ps in (64, 1):
            case = Case(kind, "layer_first", ps, TOKENS, "cuda", None)
            idx = case.indices(True, rng)
            parts = case.host.transfer_parts()
            layers = case.host.layer_num
            dev = torch.device("cuda")
            h, d = on_device(idx[0], dev), on_device(idx[1], dev)
            side = streams.fresh(dev, 0, (torch.cuda.current_stream(),))
            eng = TransferEngine(case.host, "kernel")
            log(f"{kind}/p{ps}/parts", {p.name: {"item_bytes": p.item_bytes,
                                                  "share": round(p.item_bytes / sum(q.item_bytes for q in parts), 3)}
                                        for p in parts})
            for direction, to_host in (("backup", True), ("load", False)):
                arms = {"engine": lambda dr=direction: measure(case, eng, dr, idx, clock, 1)}
                for name, blocks in (("in turn, 32", None), ("side by side, 32 + 32", (32, 32)),
                                     ("side by side, 24 + 8", (24, 8)), ("side by side, 16 + 16", (16, 16))):
                    fn = moves(kb, parts, h, d, layers, to_host, blocks, side)
                    arms[name] = lambda fn=fn: case.nbytes / timed(fn) / 1e9
                for i, p in enumerate(parts):
                    fn = moves(kb, parts, h, d, layers, to_host, None, side, only=i)
                    nbytes = case.nbytes * p.item_bytes // sum(q.item_bytes for q in parts)
                    arms[f"{p.name} alone, 32"] = lambda fn=fn, n=nbytes: n / timed(fn) / 1e9
                times = in_turn(arms, lambda fn: fn())
                log(f"{kind}/layer_first/p{ps}/scattered/{direction}",
                    {k: cell(g, limits[direction]) for k, g in times.items()})
            case.host.close()
            del case, eng, parts, h, d
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
