"""Probe: do host pools on one NUMA node move single tokens faster than on another?

How fast the zero-copy kernel moves MLA layer_first single tokens to scattered host slots
swings between processes with nothing else changed: 0.939x (run 99), 0.908x (run 101),
0.85-0.88x through the table (runs 98, 100); copies of short host rows swing alike (0.87x
against 0.94x, runs 88-91). Host memory comes from the node of the CPU that first touches
it; a pool on the node away from the GPU's PCIe root would reach the link through the
link between the sockets.

Run under ``taskset`` on each node's CPUs in turn (see the device command in NOTES). Logs
the machine's nodes, the GPU's node, each host pool's pages per node (``/proc/self/numa_maps``),
and the kernel alone (on device indices) for MLA and MHA layer_first single tokens to
scattered host slots, backups and per-layer loads, three timings each.
Predictions: if the machine has more than one node, the pool lands on the node the process
runs on, and the node away from the GPU moves these rows 0.03-0.08x slower.
Usage: python bench/probes/numa_nodes.py OUT.json [--tokens N]
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

import torch

from kvtier.bench.transfer import Case
from kvtier.transfer.kernel import KernelBackend, on_device
from probelib import JsonLog, args, start

PATH, TOKENS = args("/tmp/probe_numa_nodes.json")
log = JsonLog(PATH, tokens=TOKENS)


def nodes_of(t: torch.Tensor) -> dict:
    """Pages per NUMA node of the mappings ``t`` lies in, from /proc/self/numa_maps."""
    lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    out: dict[str, int] = {}
    for line in Path("/proc/self/numa_maps").read_text().splitlines():
        fields = line.split()
        start_addr = int(fields[0], 16)
        if lo - (1 << 21) <= start_addr < hi:
            for f in fields[1:]:
                if f.startswith("N") and "=" in f:
                    k, v = f.split("=")
                    out[k] = out.get(k, 0) + int(v)
    return out


def main() -> None:
    sysnodes = sorted(p.name for p in Path("/sys/devices/system/node").glob("node[0-9]*"))
    bdf = torch.cuda.get_device_properties(0).pci_bus_id if hasattr(torch.cuda.get_device_properties(0),
                                                                       "pci_bus_id") else None
    gpu_node = None
    for dev in Path("/sys/bus/pci/devices").glob("*"):
        try:
            if (dev / "class").read_text().startswith("0x0302") or (dev / "class").read_text().startswith("0x0300"):
                gpu_node = (dev / "numa_node").read_text().strip()
        except OSError:
            pass
    log("machine", {"nodes": {n: (Path("/sys/devices/system/node") / n / "cpulist").read_text().strip()
                              for n in sysnodes},
                    "gpu_numa_node": gpu_node, "gpu_bus": bdf, "cpus_allowed": sorted(os.sched_getaffinity(0))})
    torch.cuda.set_stream(torch.cuda.Stream())
    clock, limits, rng = start(log)
    kb = KernelBackend()
    for kind in ("mla", "mha"):
        case = Case(kind, "layer_first", 1, TOKENS, "cuda", None)
        h, d = case.indices(True, rng)[:2]
        parts = case.host.transfer_parts()
        dev = torch.device("cuda")
        hg, dg = on_device(h, dev), on_device(d, dev)
        log(f"{kind}/host_pool_pages_per_node", nodes_of(case.host._buffers[0].tensor))
        for direction, to_host in (("backup", True), ("load", False)):
            steps = [None] if to_host else list(range(case.host.layer_num))

            def alone():
                for layer in steps:
                    for p in parts:
                        kb.copy_part(p, hg, dg, layer, 32)
            for _ in range(2):
                clock.once(alone)
            g = [case.nbytes / clock.once(alone) / 1e9 for _ in range(3)]
            log(f"{kind}/layer_first/p1/scattered/{direction}/kernel alone",
                {"gbps": round(statistics.median(g), 2), "ratio": round(statistics.median(g) / limits[direction], 3),
                 "samples": [round(x, 2) for x in g]})
        case.host.close()
        del case, parts, hg, dg
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
