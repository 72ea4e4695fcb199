"""What the probes share: their command line, a JSON log written after every entry, one timed transfer."""

from __future__ import annotations

import json
import statistics
import sys


def args(default_path: str, default_tokens: int = 32768) -> tuple[str, int]:
    """``OUT.json [--tokens N]`` from the command line (32,768 tokens by default)."""
    path = sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("--") else default_path
    tokens = int(sys.argv[sys.argv.index("--tokens") + 1]) if "--tokens" in sys.argv else default_tokens
    return path, tokens


class JsonLog:
    """Entries printed as they come and the whole log rewritten each time, so a probe
    stopped by its time box still leaves what it measured."""

    def __init__(self, path: str, **head):
        self.path, self.out = path, dict(head)

    def __call__(self, key: str, value) -> None:
        self.out[key] = value
        print(key, value, flush=True)
        with open(self.path, "w") as f:
            json.dump(self.out, f, indent=1)


def transfer(engine, h, d, to_host: bool) -> None:
    """One backup (all layers) or per-layer load, queued and waited for on the current stream."""
    if to_host:
        engine.backup(h, d).wait()
    else:
        ld = engine.load(h, d)
        ld.wait_layer(ld.layer_num - 1)


def in_turn(arms: dict, run, warmups: int = 2, rounds: int = 3) -> dict:
    """``run(arm)`` for every arm in turn: ``warmups`` passes thrown away (plans, staging,
    Triton), then ``rounds`` passes kept, per arm's name a list of what ``run`` returned."""
    for _ in range(warmups):
        for arm in arms.values():
            run(arm)
    rows = {k: [] for k in arms}
    for _ in range(rounds):
        for k, arm in arms.items():
            rows[k].append(run(arm))
    return rows


def cell(samples: list[float], limit: float) -> dict:
    """One A/B cell: the median GB/s of ``samples``, its ratio to ``limit``, and the samples."""
    gbps = statistics.median(samples)
    return {"gbps": round(gbps, 2), "ratio": round(gbps / limit, 3), "samples": [round(x, 2) for x in samples]}


def start(log: JsonLog, nbytes: int = 1 << 30):
    """What an A/B probe starts with: a device clock, the contiguous limits (logged), a seeded rng."""
    import numpy as np

    from kvtier.bench.transfer import Clock, contiguous_limit
    clock = Clock(True)
    limits = contiguous_limit(nbytes, clock, 5)
    log("limit_gbps", {k: round(v, 2) for k, v in limits.items()})
    return clock, limits, np.random.default_rng(0)


def read_text(path: str) -> str | None:
    """A system file's text, stripped (None if it cannot be read): /sys, /proc."""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def mha_host_bytes(tokens: int) -> int:
    """The host pool of an MHA case of the transfer table (llama-3-8b, 128 KiB a token, twice
    ``tokens`` slots)."""
    return 2 * tokens * 128 * 1024


def mla_pool_and_engine(tokens: int, clock):
    """An MLA layer_first page-1 case, its allocator slots (seed 1) and a dma engine on it,
    warmed by one load and one backup-and-load pair: ``(case, idx, engine)``."""
    import numpy as np

    from kvtier.bench.transfer import Case, measure
    from kvtier.transfer import TransferEngine
    case = Case("mla", "layer_first", 1, tokens, "cuda", None)
    idx = case.indices(False, np.random.default_rng(1))
    eng = TransferEngine(case.host, "dma")
    for direction in ("load", "both"):
        measure(case, eng, direction, idx, clock, 1)
    return case, idx, eng


def six_mha_pools_moved(tokens: int, clock, rng) -> None:
    """What the transfer table does before its MLA cases: an MHA case per layout and page size
    (1, 64) made, moved once each way by a dma engine, and closed."""
    import torch

    from kvtier.bench.transfer import Case, measure
    from kvtier.transfer import TransferEngine
    for layout in ("layer_first", "page_first", "page_head"):
        for ps in (1, 64):
            c = Case("mha", layout, ps, tokens, "cuda", None)
            idx = c.indices(False, rng)
            eng = TransferEngine(c.host, "dma")
            measure(c, eng, "both", idx, clock, 1)
            c.host.close()
            del c, eng
            torch.cuda.empty_cache()
