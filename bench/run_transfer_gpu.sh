#!/usr/bin/env bash
# One device call: the transfer benchmark (rows saved as they come), then the GPU tests.
set -o pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 KVTIER_HOST_RESERVE_GB=4
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,pcie.link.gen.current,pcie.link.width.current --format=csv > "$OUT/gpu.txt"
timeout "${BENCH_S:-330}" python -m kvtier.cli bench transfer --verbose ${BENCH_ARGS:-} --json "$OUT/transfer_h200.json" > "$OUT/bench.log" 2> "$OUT/bench.err"
echo "bench rc=$?"; grep -v '^bench transfer\|%|' "$OUT/bench.err" | tail -5
timeout "${TEST_S:-200}" python -m pytest tests/test_transfer_gpu.py -q -p no:cacheprovider --maxfail 5 --timeout 100 > "$OUT/gpu_tests.log" 2>&1
echo "tests rc=$?"; tail -25 "$OUT/gpu_tests.log"
