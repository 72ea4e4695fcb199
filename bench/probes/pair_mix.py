"""Probe: a backup and a load at once on scattered layer_first page-64 pages, each by the way
that is best for it alone?

Run 93 (huge-page pools): one way, the zero-copy kernel is best for these backups (MHA
0.932x, MLA 0.920x, DSA 0.822x) and DMA for the loads (0.952x, 0.926x, 0.897x); at once, DMA
both ways reached 1.472x (MHA), 1.433x (MLA), 1.211x (DSA), the kernel both ways 0.98-1.11x,
and `auto` 1.499x, 1.439x, 1.211x. Not timed yet: the backup by the kernel and the load by
DMA together (or the other way round).

Arms, in turn, per kind, one device pool and one huge-page host pool, the same slots as the
table's scattered pairs: ``dma + dma``, ``kernel + kernel``, ``kernel backup + dma load``,
``dma backup + kernel load``, ``auto``; GB/s of both transfers' bytes over the pair's time,
ratio to the one-way limit (as the table's ``both``).
Predictions: if the kernel's writes to the host and the copy engine's reads from it share
the link as two copy streams do, ``kernel backup + dma load`` reaches 1.5x or more for MHA and
MLA; if the kernel takes the link as DSA's index-K kernel did beside copies (the copy engine
at 11-13 GB/s, run 84), it lands near the kernel's own pairs (1.1-1.3x).
Run 95 (``probe_pair_mix_h200.json``): the second. ``kernel backup + dma load`` 1.085x (MLA),
1.087x (MHA), 1.145x (DSA), as the kernel both ways (1.093x, 1.142x, 1.012x); ``dma backup +
kernel load`` 1.285x, 1.207x, 1.190x; DMA both ways 1.397x, 1.538x, 1.267x, and ``auto``
with it (1.394x, 1.519x, 1.245x). A zero-copy transfer beside copies the other way holds the
pair near one direction's rate, so the pairs go by DMA both ways, as ``auto`` already sends
them; what they lack is DMA's own pair rate on page-long host rows.

After run 112 (not yet run): ``--case kind/layout/page`` (repeatable; default the three
above) times the same arms on other rows, scattered. For `auto` on single-token pairs
(run 111: MHA page_head 0.97x against the kernel's 1.05x; DMA's pairs there are host-bound,
their load call returning after 70-110 ms): ``--case mha/page_head/1 --case
mha/page_first/1 --case mla/page_first/1 --case mha/layer_first/64``. Predictions there:
the kernel both ways 1.03-1.08x, steadiest; DMA both ways 0.96-1.15x; ``kernel backup + dma
load`` near the kernel's own pair; ``auto`` at or below DMA both ways (it sends both by DMA).
Also after run 112: ``kernel + kernel, host order off`` (the kernel's backups in the
caller's order), for run 111's single-token pairs 0.08-0.11x below run 98's. Prediction: on
a 2x pool within 0.02x of host order on (run 110's one-way backups: 0.897x against 0.907x
sorted), so the drop was the machine.
Run 113 (``probe_pair_mix_h200_run113.json``): ``dma backup + kernel load`` 1.251x (MHA
page_head), 1.277x (MHA page_first), 1.115x (MLA page_first), the best arm on single tokens,
against DMA both ways 0.993x, 1.051x, 1.009x and the kernel both ways 1.028x, 1.062x, 1.001x
(host order off: 1.025x, 1.058x, 1.022x: the drop since run 98 was not the order); MHA
layer_first page 64: DMA both ways 1.490x, ``dma backup + kernel load`` 1.164x. ``auto`` sent
both by DMA (0.948x, 1.003x, 1.043x; 1.475x).
Run 114: ``auto`` choosing a shared load by its own rate plus the backups' beside it sent
the loads by DMA everywhere (1.01-1.09x on single tokens). Run 115 (its shared samples and
pair timelines logged) showed why: a DMA load of single tokens timed 50 GB/s on its own in
pairs that moved 60 GB/s (the kernel's 37 GB/s in pairs of 71). Then ``auto`` choosing a
shared load by its pairs' GB/s (both transfers' bytes, first start to last end:
``OnlineChooser.pair_loads``), ``--arm`` naming the arms to time. Prediction: ``auto``
within 0.03x of the best arm in every case (kernel loads on single tokens, DMA on page-64
pages).
After run 119 (not yet run): ``dma backup + kernel load, 16 blocks`` (the load's kernel on
16 blocks, not 32) and ``dma backup (every copy) + kernel load`` (DMA takes single tokens
even where its copies average under ``kernel_below``: layer_first). Predictions: 16 blocks
within 0.03x of 32 (one way the kernel's rate did not depend on its SMs, run 33); on
layer_first single tokens the DMA backup is 1-2M copies of 2-4 KiB for MHA (a row per
token, layer and K/V; in host order neighbours join, 4,091 bytes on average by
``mean_copy_bound``), ~0.3 us each to queue, so 0.3 s or more of host time for a 4 GiB backup: the pair well under the kernel's own (1.05-1.09x), an arm
that bounds the idea rather than a candidate. Command:
``--case mha/layer_first/1 --case mla/layer_first/1 --case mha/page_first/1 --arm "dma
backup + kernel load" --arm "dma backup + kernel load, 16 blocks" --arm "dma backup (every
copy) + kernel load" --arm "kernel + kernel"``.
Run 120 (``probe_pair_mix_h200_run120.json``): the load's kernel on 16 blocks beside a DMA
backup, 1.302x against 1.275x on 32 (MHA page_first: within 0.03x, as predicted) but 0.997x
against 1.076x and 0.946x against 1.034x on layer_first (MHA, MLA: not); a DMA backup of
layer_first single tokens 0.42x (predicted well under the kernel's pair: yes). On layer_first
``dma backup + kernel load`` is the kernel both ways (DMA hands those tokens to the kernel).
Run 121 (``probe_pair_mix_h200_run121.json``), the kernel both ways on different blocks: a
backup on 8 blocks beside a load on 32, 1.280x (MHA layer_first), 1.224x (MLA layer_first),
1.297x (MHA page_first) against 1.071x, 1.040x, 1.075x on 32 and 32; but 0.805x against
1.024x on MLA page_first. More blocks for the load alone (132) 1.09-1.13x. The zero-copy
backup's writes crowd out the load's reads; fewer blocks leave them room.
Run 122 (``probe_pair_mix_h200_run122.json``): ``auto`` trying a shared kernel backup on 8
blocks too (``AutoBackend.shared_backup_blocks``) and keeping what its pairs moved more:
1.278x (MHA layer_first), 1.135x (MLA), 1.053x (DSA) against the kernel both ways' 1.071x,
1.031x, 0.940x and the 8-block arm's 1.298x, 1.162x, 1.080x; MLA page_first kept its DMA
backups (1.109x, the best arm 1.105x).
After run 126 (not yet run): DMA both ways on single scattered tokens is host-bound (run
124, MHA page_first: load() returned at 63.5 ms, the backup wholly queued at 109.5 ms, the
pair 1.16x), while the copy engines move 32k scattered 64-128 KiB copies both ways at 93-95
GB/s when queued ahead (1.69-1.72x; ``probe_queue_cost_h200.json``), and two threads queue
them in 20 ms. While a load is prepared the background thread waits up to ``give_way_s`` (5
ms) between the backup's chunks. Arms ``dma + dma, no give-way`` (it does not wait) and
``dma + dma, backup queued first`` (no background thread: the caller queues the backup, then
the load). Command: ``--case mha/page_first/1 --case mha/page_head/1 --case mla/page_first/1
--arm "dma + dma" --arm "dma + dma, no give-way" --arm "dma + dma, backup queued first" --arm
"dma backup + kernel load" --arm auto``. Predictions: if the two threads' host work overlaps
(the runtime's calls let go of the GIL), no give-way ends the backup's queueing with the
load's and lifts the pair from ~1.15x toward 1.3x; if the Python between the calls holds the
GIL most of the time, within 0.03x of ``dma + dma``; backup queued first lowest.
Run 132 (``probe_pair_ab_h200_run132.log``, ``pair_ab.sh`` on 26d9347 against 9abd80f): the
5 ms give-way cost DMA's allocator pairs 0.02-0.08x (MHA page_first 1.603/1.658x ->
1.525/1.642x, MLA 1.460/1.565x -> 1.420/1.517x, two rounds): their load's first call takes
10-18 ms, and with the backup thread beside it returned at 11-18 ms against 10-15. Next:
``--case mha/page_first/1/allocator --case mla/page_first/1/allocator --case mha/page_first/1
--case mla/page_first/1 --arm "dma + dma, give-way 5 ms" --arm "dma + dma, give-way 20 ms"
--arm "dma + dma, give-way 1000 ms" --arm "dma + dma, give-way ahead"`` (1000: as good as the
old wait at every chunk; ahead: only while the backup's copy engine has a chunk queued beyond
the one it is on). Predictions: 20 ms keeps the allocator pairs of the long wait and most of
the scattered pairs' gain of 5 ms (their loads' first call takes 50-130 ms); ahead is at least
as good as the best of the three on every case.
Run 133 (``probe_pair_mix_h200_run133.json``, a slow host, duplex 92.3 GB/s): 5 ms the best or
within 0.01x of it on all four: allocator 1.586/1.526x (20 ms 1.595/1.519, 1000 ms
1.568/1.481, ahead 1.572/1.492), scattered 1.391/1.159x (20 ms 1.303/1.101, 1000 ms
1.050/0.996, ahead 1.294/1.138). Both predictions wrong; ``give_way_ahead`` was taken out of
the engine after it (its arm is gone). Run 135 (``probe_pair_mix_h200_run135.json``, a host
~3x faster: a load call 21 ms against 63 in run 134): ", switch N ms" (the interpreter's
switch interval) 1 and 0.2 ms within 0.03x of 5 ms everywhere, and every DMA pair at
1.60-1.79x: on that host nothing is host-bound.
After run 141: ``dma + dma, staging 256 MiB`` and ``512 MiB`` (against ``own 128 MiB``, the
default chunks in a DMA backend of its own). Prediction: on a slow host (a DMA call of 32k
scattered MHA tokens over 40 ms, ``host speed:``) single-token scattered pairs gain 0.05-0.15x
at 256 MiB (half the chunks: ~10-15 ms less host work a way), a little more at 512; allocator
pairs within 0.02x.
After the session of 2026-12-04 with no device (planning a chunk of ~500 scattered runs 79 ->
43 us on a CPU core, about a third of a single-token DMA call's planning): ", plan +N us" holds
the GIL N us more each time a ``ChunkedPlan`` chunk is planned, which puts back what that
saved. ``--case mha/page_head/1 --case mla/page_first/1 --arm "dma + dma" --arm "dma + dma, plan
+100 us"``. Prediction: on a slow host (``host speed:`` a DMA call of 32k scattered MHA tokens
over 40 ms) the pair loses 0.05-0.15x with the 100 us (so the saving gained that much), on a
fast one under 0.03x.
Usage: python bench/probes/pair_mix.py OUT.json [--tokens N] [--case KIND/LAYOUT/PAGE[/SLOTS] ...] [--arm NAME ...]
"""

from __future__ import annotations

import re
import sys
import time
from collections import Counter

import torch

from kvtier.bench.transfer import Case, measure, pair_note
from kvtier.transfer import TransferEngine
from kvtier.transfer.base import Backend, get_backend
from kvtier.transfer.online import DUPLEX
from kvtier.transfer.dma import DMABackend, DMAConfig
from kvtier.transfer.dma_plan import ChunkedPlan
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
    # After run 119 (next steps 1-2): what holds the best single-token mix at 1.10-1.28x: the
    # kernel load with fewer blocks beside the DMA backup's gathers, and on layer_first, where
    # DMA sends single tokens to the kernel, a DMA backup of them anyway.
    "dma backup + kernel load, 16 blocks": lambda kernel, dma: Split(dma, KernelBackend(KernelConfig(max_blocks=16))),
    "dma backup (every copy) + kernel load": lambda kernel, dma: Split(DMABackend(DMAConfig(kernel_below=0)), kernel),
    # After run 126 (DMA's single-token pairs host-bound): the background thread not pausing
    # for the load being prepared, and the backup queued wholly by the caller before the load.
    "dma + dma, no give-way": lambda kernel, dma: "dma",
    "dma + dma, backup queued first": lambda kernel, dma: "dma",
    # After run 141 (both copy streams of a single-token pair wait on a slow host all through
    # it): larger staging chunks, so each way has fewer chunks' fixed host costs (~30 numpy
    # calls of planning, a gather or scatter launch, events). "own 128 MiB" is the control: a
    # DMA backend of its own with the default chunks, as the larger ones are.
    "dma + dma, own 128 MiB": lambda kernel, dma: DMABackend(DMAConfig(), fallback=kernel),
    "dma + dma, staging 256 MiB": lambda kernel, dma: DMABackend(DMAConfig(staging_bytes=256 << 20), fallback=kernel),
    "dma + dma, staging 512 MiB": lambda kernel, dma: DMABackend(DMAConfig(staging_bytes=512 << 20), fallback=kernel),
}
# Engine settings of the arms that differ from the others in the engine, not the backend.
ENGINE_OPTS = {"dma + dma, no give-way": {"give_way_s": 0.0},
               "dma + dma, backup queued first": {"background_backups": False}}
# After run 120: any "X backup + Y load" with X, Y "dma" or "kernel@N" (the kernel on N blocks),
# e.g. "kernel@8 backup + kernel@64 load": does a zero-copy backup crowd out a zero-copy load's
# reads (their requests go up the link beside the backup's writes)?
SIDE = re.compile(r"(dma|kernel@(\d+)) backup \+ (dma|kernel@(\d+)) load")


# After run 132: any arm with ", give-way N ms" after it runs with the engine's background thread
# giving way to a load being prepared for N ms in all (``TransferEngine.give_way_s``), e.g.
# "dma + dma, give-way 20 ms" or "auto, give-way 20 ms".
# After run 134: ", switch N ms" runs the arm with the interpreter's thread switch interval at
# N ms (``sys.setswitchinterval``; 5 ms by default). Suffixes combine, in any order.
# After run 147: ", triton launch" launches the gathers and scatters by Triton's full launch path
# every call (``triton_kernels.FAST_LAUNCH`` off), against the kept launcher of the default.
# After the nineteenth session: ", plan +N us", N us more of GIL-held work per chunk planned.
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
    kernel, dma = get_backend("kernel", dev), get_backend("dma", dev)
    backends = {name: arm_backend(name, kernel, dma) for name in ARMS}
    seen_keys = set()
    for kind, layout, ps, slots in CASES:
        case = Case(kind, layout, ps, TOKENS, "cuda", None)
        idx = case.indices(slots == "scattered", rng)
        engines = {name: engine_for(case.host, b, base_and_opts(name)[1]) for name, b in backends.items()}
        auto = get_backend("auto", dev)
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
