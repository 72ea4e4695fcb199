#!/usr/bin/env bash
# Run 43: host-hit TTFT at 32k (dma, inputs by SMs), two rounds of three arms in turn: no drains,
# drains every 4 layers after a one-element kernel (the default), drains with no kernel; then the
# copy_priority probe. Usage: OUT=DIR bash bench/probes/ttft_drain_ab.sh
export PYTHONPATH=. PYTHONUNBUFFERED=1 KVTIER_HOST_RESERVE_GB=4
for R in 1 2; do for A in none copy event; do
python - "$A" "$R" <<'PY'
import sys
from dataclasses import replace
import kvtier.transfer.gpu as g
from kvtier.transfer.dma import DMABackend
a, r = sys.argv[1], sys.argv[2]
g.DMA.config = replace(g.DMA.config, load_drain=0 if a == "none" else 4)
DMABackend._drain_after = "copy" if a == "none" else a
import os
from kvtier.cli import main
sys.argv = ["kvtier", "bench", "ttft", "--io-backends", "dma", "--contexts", "32768", "--json", f"{os.environ['OUT']}/ttft_{a}_{r}.json"]
main()
PY
done; done 2>&1 | grep -E "^\| 32,768|Error|error" 
timeout 120 python bench/probes/copy_priority.py $OUT/probe_copy_priority_h200.json > $OUT/probe.log 2>&1; echo probe rc=$?
