"""Probe: what does it cost when PyTorch hands two kvtier streams the same CUDA stream?

``torch.cuda.Stream()`` draws from 32 pooled streams per priority, in turn
(``kvtier/transfer/streams.py``). The transfer bench makes three engines per case, so now and
then an engine's backup (or load) stream is the DMA staging ring's side stream. Then the
ring's gathers and the engine's copies (for a load: copies and scatters) run in turn. In run
47 the dma row of MLA page_first p64 allocator backups ran at 0.81x, both rounds, where auto,
on the same DMA backend but another engine, made 0.94x; run 32 had DSA layer_first p64 at
0.86x against auto's 0.96x, and runs 20-28 auto at 0.86x against dma's 0.95x on MLA
layer_first p64: always one engine in both rounds, never reproduced alone (run 29).

Per shape, one engine timed in turn, three rounds: its stream as drawn ("distinct"); made to
share the ring's side stream with ``kvtier.transfer.streams.repair`` off ("aliased"); and the
same with repair on ("repaired": the first transfer draws the ring a new side stream).
Prediction: aliased MLA page_first p64 backups at about 0.81x, distinct and repaired at about
0.94x; loads lose less (their copies run ahead on the side stream only one chunk at a time).
Run 48 (``probe_stream_alias_h200.json``): prediction met for backups, and loads lose as much.
MLA page_first p64 backup: distinct 0.949x, aliased 0.824x, repaired 0.954x. MHA layer_first
p64 backup 0.966 / 0.899 / 0.968; load 0.956 / 0.847 / 0.957. (That run's code held each
kvtier stream by a weak reference, and the process crashed at exit in Python's weakref exit
handler; the registry now holds the engines and rings weakly instead.) Run 50, on that
registry: MLA page_first p64 backup 0.938 / 0.820 / 0.940; MHA layer_first p64 backup
0.965 / 0.900 / 0.967, load 0.971 / 0.864 / 0.970; no crash at exit.
Usage: python bench/probes/stream_alias.py OUT.json [--tokens N]
"""

from __future__ import annotations

import torch

from kvtier.bench.transfer import Case, measure
from kvtier.transfer import TransferEngine, streams
from probelib import JsonLog, args, cell, start

PATH, TOKENS = args("/tmp/probe_stream_alias.json")
log = JsonLog(PATH, tokens=TOKENS)
SHAPES = [("mla", "page_first", 64, "backup"), ("mha", "layer_first", 64, "backup"), ("mha", "layer_first", 64, "load")]


class Held:
    """Keeps the engine's own stream counted as kvtier's while the engine holds an alias, so
    the "repaired" arm's new side stream is not drawn onto it (run 49 met that: the next
    round's "distinct" arm then found the engine's stream shared with the ring)."""

    def __init__(self, stream):
        self.stream = stream

    def kvtier_streams(self):
        return [self.stream]


def alias_of(stream):
    for _ in range(2 * streams.POOL):
        s = torch.cuda.Stream(priority=stream.priority)
        if s.cuda_stream == stream.cuda_stream:
            return s
    raise RuntimeError("the pool did not come round")


def main():
    clock, limits, rng = start(log)
    device = torch.device("cuda", torch.cuda.current_device())
    for kind, layout, ps, direction in SHAPES:
        to_host = direction == "backup"
        name = "backup_stream" if to_host else "load_stream"
        case = Case(kind, layout, ps, TOKENS, "cuda", None)
        idx = case.indices(False, rng)
        eng = TransferEngine(case.host, "dma")
        measure(case, eng, direction, idx, clock, 1)  # the staging rings exist from here
        ring = eng.backend.ring(device, to_host)
        own = getattr(eng, name)
        held = Held(own)
        streams.register(held)
        times = {"distinct": [], "aliased": [], "repaired": []}
        for _ in range(3):
            for arm in times:
                streams.repair = arm != "aliased"
                setattr(eng, name, own if arm == "distinct" else alias_of(ring.side))
                shared = getattr(eng, name).cuda_stream == ring.side.cuda_stream
                assert shared == (arm != "distinct"), arm
                times[arm].append(measure(case, eng, direction, idx, clock, 3))
                assert (getattr(eng, name).cuda_stream == ring.side.cuda_stream) == (arm == "aliased"), arm
        streams.repair = True
        log(f"{kind}/{layout}/p{ps}/allocator/{direction}", {a: cell(g, limits[direction]) for a, g in times.items()})
        case.host.close()
        del case, eng, held


if __name__ == "__main__":
    main()
