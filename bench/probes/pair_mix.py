"""Probe: a backup and a load at once (a pair), each by a chosen way, timed as the table's pairs.

Arms, in turn, per case (one device pool and one huge-page host pool; the slots of the table's
pair rows): ``dma + dma``, ``kernel + kernel``, ``kernel backup + dma load``, ``dma backup +
kernel load``, ``auto``, and any ``X backup + Y load`` with X, Y ``dma`` or ``kernel@N`` (the
kernel on N blocks); engine and backend variants (no give-way, the backup queued wholly first,
its own DMA backend at 128/256/512 MiB staging); and suffixes that combine: ``, give-way N ms``
(``TransferEngine.give_way_s``), ``, switch N ms`` (the interpreter's switch interval),
``, triton launch`` (Triton's full launch path), ``, plan +N us`` (more GIL-held planning per
chunk). Logs GB/s of both transfers' bytes over the pair's time (first start to last end), the
ratio to the one-way limit, each arm's pair timeline (``pair_ms``), and auto's picks and samples.

Run: ``PYTHONPATH=.:bench/probes python bench/probes/pair_mix.py OUT.json [--case KIND/LAYOUT/PAGE[/SLOTS]]...
[--arm NAME]...`` (default: MLA, MHA, DSA layer_first page 64, scattered; every named arm). The
kept result: ``--case mha/page_first/1/allocator --case mla/page_first/1/allocator --case
mha/page_first/1 --case mla/page_first/1 --arm "dma + dma, give-way 5 ms" --arm "dma + dma,
give-way 20 ms" --arm "dma + dma, give-way 1000 ms"`` (its fourth arm, ``give-way ahead``, a rule
that gave way only while the backup's earlier chunks were on the device, is not in the engine).
Backs: ``engine.GIVE_WAY_S`` = 5 ms, the best of 5, 20 and 1000 ms or within 0.01x on all four
cases (scattered single tokens: MHA 1.391x against 1.303x and 1.050x, MLA 1.159x against 1.101x
and 0.996x; there the load's call returns after 59-110 ms: such pairs wait on the host).
Current answer: ``bench/results/h200/probes.json ("pair_mix")``.
"""

from __future__ import annotations

import re
import sys
import time
from collections import Counter

import torch

from kvtier.bench.transfer import Case, measure, pair_note
from kvtier.transfer import TransferEngine
from kvtier.transfer import Backends
from kvtier.transfer.online import DUPLEX
from kvtier.transfer.base import Backend
from kvtier.transfer.dma import DMABackend, DMAConfig
from kvtier.transfer.dma.chunked import ChunkedPlan
from kvtier.transfer.kernel import KernelBackend, KernelConfig
from kvtier.transfer import triton_kernels as tk
from probelib import JsonLog, args, cell, in_turn, start, switch_interval

PATH, TOKENS = args("/tmp/probe_pair_mix.json")
# KIND/LAYOUT/PAGE[/SLOTS]: host slots scattered (the default) or as the allocator hands them out.
CASES = [(c[0], c[1], int(c[2]), c[3] if len(c) > 3 else "scattered") for c in
         (sys.argv[i + 1].split("/") for i, a in enumerate(sys.argv) if a == "--case")] or \
    [(k, "layer_first", 64, "scattered") for k in ("mla", "mha", "dsa")]
if bad := [c for c in CASES if c[3] not in ("scattered", "allocator")]:
    sys.exit(f"--case slots must be 'scattered' or 'allocator', got {bad}")
# Each arm's io_backend, from the shared kernel and DMA backends.
ALL_ARMS = {
    "dma + dma": lambda kernel, dma: "dma",
    "kernel + kernel": lambda kernel, dma: "kernel",
    "kernel + kernel, host order off": lambda kernel, dma: KernelBackend(KernelConfig(host_order=False)),
    "kernel backup + dma load": lambda kernel, dma: Split(kernel, dma),
    "dma backup + kernel load": lambda kernel, dma: Split(dma, kernel),
    "auto": lambda kernel, dma: "auto",
    # The kernel load on fewer blocks beside the DMA backup's gathers; and on layer_first, where
    # DMA sends single tokens to the kernel, a DMA backup of them anyway (every copy).
    "dma backup + kernel load, 16 blocks": lambda kernel, dma: Split(dma, KernelBackend(KernelConfig(max_blocks=16))),
    "dma backup (every copy) + kernel load": lambda kernel, dma: Split(DMABackend(DMAConfig(kernel_below=0)), kernel),
    # The engine's background thread not pausing for a load being prepared, and the backup
    # queued wholly by the caller before the load.
    "dma + dma, no give-way": lambda kernel, dma: "dma",
    "dma + dma, backup queued first": lambda kernel, dma: "dma",
    # Larger staging chunks, so each way has fewer chunks' fixed host costs (planning, a gather
    # or scatter launch, events). "own 128 MiB" is the control: a DMA backend of its own with
    # the default chunks, as the larger ones are.
    "dma + dma, own 128 MiB": lambda kernel, dma: DMABackend(DMAConfig(), fallback=kernel),
    "dma + dma, staging 256 MiB": lambda kernel, dma: DMABackend(DMAConfig(staging_bytes=256 << 20), fallback=kernel),
    "dma + dma, staging 512 MiB": lambda kernel, dma: DMABackend(DMAConfig(staging_bytes=512 << 20), fallback=kernel),
}
# Engine settings of the arms that differ from the others in the engine, not the backend.
ENGINE_OPTS = {"dma + dma, no give-way": {"give_way_s": 0.0},
               "dma + dma, backup queued first": {"background_backups": False}}
# Any "X backup + Y load" with X, Y "dma" or "kernel@N" (the kernel on N blocks), e.g.
# "kernel@8 backup + kernel@64 load": how a zero-copy backup's writes crowd out a zero-copy
# load's reads.
SIDE = re.compile(r"(dma|kernel@(\d+)) backup \+ (dma|kernel@(\d+)) load")


# Suffixes, in any order: ", give-way N ms" runs the arm with the engine's background thread
# giving way to a load being prepared for N ms in all (``TransferEngine.give_way_s``), e.g.
# "dma + dma, give-way 20 ms"; ", switch N ms" with the interpreter's thread switch interval at
# N ms (``sys.setswitchinterval``; 5 ms by default); ", triton launch" launches the gathers and
# scatters by Triton's full launch path every call (``triton_kernels.FAST_LAUNCH`` off);
# ", plan +N us" adds N us of GIL-held work per chunk planned.
SUFFIX = re.compile(r"(.+), (?:give-way (\d+(?:\.\d+)?) ms|switch (\d+(?:\.\d+)?) ms|(triton launch)"
                    r"|plan \+(\d+(?:\.\d+)?) us)")


def base_and_opts(name: str) -> tuple[str, dict]:
    """An arm's name without its suffixes, and its engine settings (and ``switch_s``)."""
    opts = {}
    while m := SUFFIX.fullmatch(name):
        if m[5]:
            opts.setdefault("plan_extra_s", float(m[5]) / 1e6)
        elif m[4]:
            opts["triton_launch"] = True
        elif m[3]:
            opts.setdefault("switch_s", float(m[3]) / 1e3)
        else:
            opts.setdefault("give_way_s", float(m[2]) / 1e3)
        name = m[1]
    return name, {**ENGINE_OPTS.get(name, {}), **opts}


def switched(fn, switch_s: float | None, triton_launch: bool = False, plan_extra_s: float = 0.0):
    """``fn`` run with the interpreter's switch interval at ``switch_s`` (:func:`switch_interval`),
    with Triton's full launch path if ``triton_launch``, and ``plan_extra_s`` more of GIL-held
    work each time a :class:`ChunkedPlan` chunk is planned."""
    def run():
        with switch_interval(switch_s):
            tk.FAST_LAUNCH = not triton_launch
            ChunkedPlan._chunk_calls = _slower(_PLAN_CHUNK, plan_extra_s) if plan_extra_s else _PLAN_CHUNK
            try:
                return fn()
            finally:
                tk.FAST_LAUNCH = True
                ChunkedPlan._chunk_calls = _PLAN_CHUNK
    return run


_PLAN_CHUNK = ChunkedPlan._chunk_calls


def _slower(plan_chunk, extra_s: float):
    """``plan_chunk`` holding the GIL ``extra_s`` more whenever it plans a chunk (not when it
    hands one back already planned)."""
    def planned(self, i):
        if i not in self._calls:
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < extra_s:
                pass
        return plan_chunk(self, i)
    return planned


def one_side(name: str, blocks: str | None, dma):
    return dma if name == "dma" else KernelBackend(KernelConfig(max_blocks=int(blocks)))


def arm_backend(name: str, kernel, dma):
    name = base_and_opts(name)[0]
    if name in ALL_ARMS:
        return ALL_ARMS[name](kernel, dma)
    m = SIDE.fullmatch(name)
    return Split(one_side(m[1], m[2], dma), one_side(m[3], m[4], dma))


ARMS = [sys.argv[i + 1] for i, a in enumerate(sys.argv) if a == "--arm"] or list(ALL_ARMS)
if unknown := [a for a in ARMS if (b := base_and_opts(a)[0]) not in ALL_ARMS and not SIDE.fullmatch(b)]:
    sys.exit(f"unknown --arm {unknown}; use some of {list(ALL_ARMS)}, or 'X backup + Y load' "
             f"with X and Y each 'dma' or 'kernel@N' (N blocks), any with ', give-way N ms', ', switch N ms', ', triton launch' or ', plan +N us' after it")
log = JsonLog(PATH, tokens=TOKENS, cases=["/".join(map(str, c)) for c in CASES])


class Split(Backend):
    """Backups by one backend, loads by another (each as the engine would call it alone)."""

    name = "split"

    def __init__(self, up, down):
        self.up, self.down = up, down

    def prepare(self, parts, host_idx, dev_idx, to_host, block_quota=None, whole=True, host_np=None, dev_np=None):
        b = self.up if to_host else self.down
        if b.name == "kernel":
            return b.prepare(parts, host_idx, dev_idx, to_host, block_quota, host_np=host_np)
        return b.prepare(parts, host_idx, dev_idx, to_host, block_quota, whole, host_np=host_np, dev_np=dev_np)

    def backup(self, parts, host_idx, dev_idx, block_quota=None):
        self.prepare(parts, host_idx, dev_idx, True, block_quota)(None)

    def load(self, parts, host_idx, dev_idx, layer):
        self.prepare(parts, host_idx, dev_idx, False, whole=False)(layer)


def engine_for(host, backend, opts: dict) -> TransferEngine:
    eng = TransferEngine(host, backend, background_backups=opts.get("background_backups", True))
    eng.give_way_s = opts.get("give_way_s", eng.give_way_s)
    return eng


def main() -> None:
    torch.cuda.set_stream(torch.cuda.Stream())
    clock, limits, rng = start(log)
    dev = torch.device("cuda")
    shared = Backends()  # one set for every arm and case: what auto and dma measure carries over
    kernel, dma = shared.get("kernel", dev), shared.get("dma", dev)
    backends = {name: arm_backend(name, kernel, dma) for name in ARMS}
    seen_keys = set()
    for kind, layout, ps, slots in CASES:
        case = Case(kind, layout, ps, TOKENS, "cuda", None)
        idx = case.indices(slots == "scattered", rng)
        engines = {name: engine_for(case.host, b, base_and_opts(name)[1]) for name, b in backends.items()}
        auto = shared.get("auto", dev)
        before = Counter(auto.picks)
        switch = {k: base_and_opts(k)[1].get("switch_s") for k in engines}
        slow = {k: base_and_opts(k)[1].get("triton_launch", False) for k in engines}
        extra = {k: base_and_opts(k)[1].get("plan_extra_s", 0.0) for k in engines}
        times = in_turn({k: switched(lambda e=e: measure(case, e, "both", idx, clock, 1), switch[k], slow[k], extra[k])
                         for k, e in engines.items()}, lambda fn: fn(), warmups=1, rounds=3)
        cells = {k: cell(g, limits["backup"]) for k, g in times.items()}
        if "auto" in engines:  # what auto sent each way, exploring included, and its shared samples
            cells["auto picks"] = {f"{d} {c}": n for (d, c), n in (Counter(auto.picks) - before).items()}
            for key, by in list(auto.chooser.samples.items()):
                if key and key[-1] == DUPLEX and key not in seen_keys:
                    seen_keys.add(key)
                    pairs = auto.chooser.pairs.get(key, {})
                    cells[f"{'backup' if key[0] else 'load'} shared samples"] = {
                        c: {"own": [round(x, 1) for x in v], "pairs": [round(x, 1) for x in pairs.get(c, [])]}
                        for c, v in by.items()}
        for k, e in engines.items():  # each arm's pair timeline (ms after the backup call), one more pair
            pl = []
            switched(lambda e=e: measure(case, e, "both", idx, clock, 1, pl), switch[k], slow[k], extra[k])()
            cells[k]["timeline"] = pair_note(pl)
        log(f"{kind}/{layout}/p{ps}/{slots}/both", cells)
        case.host.close()
        del case, engines
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
