"""Probe (CPU): resident memory as host pools are made, moved through a backend's part
tables and dropped, four times over. Before the tables held parts weakly (code 391c897 and
earlier), each dropped pool of about 1 GB stayed resident (0.31 -> 1.38 -> 2.46 -> 3.53 ->
4.60 GB, and 0.58 once the tables were cleared); since, it stays at 0.58 GB.
Usage: KVTIER_HOST_RESERVE_GB=1 PYTHONPATH=. python bench/probes/part_tables_rss.py
"""

from __future__ import annotations

import gc

import torch

from kvtier.device_pool import pool_from_spec
from kvtier.host_pool import host_pool_for
from kvtier.spec import KVSpec
from kvtier.transfer.kernel import PartTables


def rss_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 1e9


def main():
    tables = PartTables()
    print("start: resident", round(rss_gb(), 2), "GB")
    spec = KVSpec("mha", 4, torch.bfloat16, head_num=8, head_dim=128)  # 16 KiB per token
    for i in range(4):
        dev = pool_from_spec(spec, 32768, 1, "cpu")  # 0.5 GB, and as much on the host
        host = host_pool_for(dev, "layer_first", host_size_tokens=32768)
        for c in host.component_tensors:
            host.raw_bytes(c).fill_(1)
        for st in dev.stacks.values():
            st.fill_(1)
        for p in host.transfer_parts():
            tables.gcd(p, torch.device("cpu"))
        del dev, host, p
        gc.collect()
        print(f"pool {i} dropped: resident", round(rss_gb(), 2), "GB, tables", len(tables._tables))
    tables._tables.clear()
    gc.collect()
    print("tables cleared: resident", round(rss_gb(), 2), "GB")


if __name__ == "__main__":
    main()
