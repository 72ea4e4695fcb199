"""What the probes share: their command line, a JSON log written after every entry, one timed
transfer, A/B arms timed in turn, and per-chunk pacing of the DMA backend.

Not a probe: the probes import it (``PYTHONPATH=.:bench/probes``).
"""

from __future__ import annotations

import json
import statistics
import sys
from contextlib import contextmanager


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


@contextmanager
def switch_interval(seconds: float | None):
    """The interpreter's thread switch interval at ``seconds`` inside the block (None: as it
    is), restored after."""
    before = sys.getswitchinterval()
    if seconds is not None:
        sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


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


class Pace:
    """Events around every chunk's copies and every staging kernel (a backup's gathers, a
    load's scatters) of the ``direction`` being paced, while ``on``."""

    def __init__(self):
        import torch
        self._torch = torch
        self.on = None  # None, or True (backups) / False (loads): the direction paced
        self.marks: list[tuple[str, int, int, torch.cuda.Event, torch.cuda.Event]] = []

    def _bracket(self, stream, what: str, nbytes: int, calls: int, fn):
        torch = self._torch
        b, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        b.record(stream)
        out = fn()
        e.record(stream)
        self.marks.append((what, nbytes, calls, b, e))
        return out

    def wrap(self):
        """Bracket the DMA backend's ``issue_copies`` and ``copy_items`` from now on (in every engine)."""
        import kvtier.transfer.dma.issue as dma_mod
        torch = self._torch
        real_issue, real_copy = dma_mod.issue_copies, dma_mod.copy_items

        def issue(tall, flat, host_base, stg_base, to_host, stream, *a, **k):
            run = lambda: real_issue(tall, flat, host_base, stg_base, to_host, stream, *a, **k)  # noqa: E731
            if self.on is None or to_host != self.on:
                return run()
            nbytes = (int((tall[:, 2] * tall[:, 3]).sum()) if len(tall) else 0) + (int(flat[:, 2].sum()) if len(flat) else 0)
            return self._bracket(torch.cuda.ExternalStream(stream), "copy", nbytes, len(tall) + len(flat), run)

        def copy(*a, **k):  # a[10]: to_buf, a backup's gather into staging (else a load's scatter)
            if self.on is None or a[10] != self.on:
                return real_copy(*a, **k)
            return self._bracket(torch.cuda.current_stream(), "staging", 0, 0, lambda: real_copy(*a, **k))
        dma_mod.issue_copies, dma_mod.copy_items = issue, copy

    def transfer(self, eng, h, d, to_host: bool) -> dict:
        """One backup (``to_host``) or per-layer load, paced: its total, the host's wait for the
        call, and per chunk its bytes, calls, staging kernel, copies and the gap before them."""
        import time
        torch = self._torch
        torch.cuda.synchronize()
        self.marks.clear()
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.on = to_host
        t0.record()
        called = time.perf_counter()
        handle = eng.backup(h, d) if to_host else eng.load(h, d)
        returned_ms = round(1e3 * (time.perf_counter() - called), 3)  # the host's wait for the call
        handle.wait() if to_host else handle.wait_layer(handle.layer_num - 1)
        t1.record()
        t1.synchronize()
        self.on = None
        ms = lambda ev: round(t0.elapsed_time(ev), 3)  # noqa: E731
        copies = [(n, c, ms(b), ms(e)) for kind, n, c, b, e in self.marks if kind == "copy"]
        kernels = [(ms(b), ms(e)) for kind, _, _, b, e in self.marks if kind == "staging"]
        chunks, prev = [], None
        for i, (n, c, b, e) in enumerate(copies):
            k = kernels[i] if i < len(kernels) else (None, None)
            chunks.append({"bytes": n, "calls": c, ("gather_ms" if to_host else "scatter_ms"): k, "copy_ms": (b, e),
                           "copy_gbps": round(n / max(e - b, 1e-6) / 1e6, 2),
                           "gap_ms": round(b - prev, 3) if prev is not None else None})
            prev = e
        total = ms(t1)
        return {"total_ms": total, "call_returned_ms": returned_ms, "gbps": round(sum(c[0] for c in copies) / total / 1e6, 2),
                "before_first_copy_ms": copies[0][2], "in_copies_ms": round(sum(e - b for _, _, b, e in copies), 3),
                "in_gaps_ms": round(sum(c["gap_ms"] for c in chunks[1:]), 3),
                "after_last_copy_ms": round(total - copies[-1][3], 3), "chunks": chunks}


def read_text(path: str) -> str | None:
    """A system file's text, stripped (None if it cannot be read): /sys, /proc."""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None








def spread_pool(case, span: int, rng):
    """A host pool ``span`` times the size of ``case``'s transfer (``Case.spread_host``) and
    host slots for that transfer: its pages drawn at random from the whole pool."""
    import numpy as np
    import torch

    ps = case.dev.page_size
    host = case.spread_host(span)
    pages = rng.permutation(host.page_num)[:case.tokens // ps]
    return host, torch.from_numpy((pages[:, None] * ps + np.arange(ps)).reshape(-1).astype(np.int64))
