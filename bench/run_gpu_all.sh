#!/usr/bin/env bash
# One device call for everything that needs the GPU: every `gpu` test, the transfer
# benchmark (all kinds), the TTFT benchmark, and optionally probes (PROBE=names of scripts
# in bench/probes, space-separated; PROBE_S the time box of each; PROBE_ARGS their options, quoted as on a
# command line, e.g. PROBE_ARGS='--case mla/page_first/1 --arm "dma + dma, give-way 20 ms"'; BACKENDS the bench's --backend options
# (default kernel, dma and auto); EXTRA_BACKENDS more --backend
# options for the bench, timed after auto, e.g. "--backend dma@32"; KINDS: --kind options, and any
# other filter, e.g. "--kind mla --layout page_first --slots allocator"; ROUNDS: --rounds; TTFT_BACKENDS: --io-backends of bench ttft; TTFT_ARGS: more options for it, e.g. "--inputs pinned"). Each step is time-boxed and writes
# under $OUT as it goes, so a step that runs long still leaves the others' results.
# At most 8 files come back from the device: gpu_tests.log (machine facts first),
# transfer.log, transfer_verbose.log, transfer_h200.json, probes.log and one JSON per probe
# (the plot is drawn here from the JSON: bench/acceptance.py --plot).
set -o pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 KVTIER_HOST_RESERVE_GB=4
# The lease machine's memory grows as it is used and goes back when freed: MemAvailable read
# ~12 GB of its 128 GiB, so the pools' check is told the machine's real size.
export KVTIER_HOST_LIMIT_GB=${KVTIER_HOST_LIMIT_GB:-110}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,pcie.link.gen.current,pcie.link.width.current --format=csv > "$OUT/gpu_tests.log"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$OUT/gpu_tests.log"
# The host's speed: lease machines differ up to 3x, and DMA's
# single-token pairs follow it. One DMA backup and load call alone, 32k scattered single
# page_first tokens (MHA), its host time (call_ms; ~10 s; the profiles go to /tmp).
PYTHONPATH=.:bench/probes timeout 90 python bench/probes/host_profile.py /tmp/host_speed.json \
  --case mha/page_first/1 --scattered 2>&1 | grep call_ms | sed 's/^/host speed: /' >> "$OUT/gpu_tests.log"

# TESTS: test files (split into words); TESTS_K: a -k expression, kept whole (in TESTS its
# spaces would split it).
timeout "${TEST_S:-150}" python -m pytest -m gpu -q -p no:cacheprovider --timeout 120 -p no:warnings ${TESTS:-} \
  ${TESTS_K:+-k "$TESTS_K"} >> "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -4 "$OUT/gpu_tests.log"

# 32,768 tokens per transfer (4 GiB for the Llama-3-8B shape), as in shared/ANCHORS.md.
[ "${BENCH_S:-420}" -gt 0 ] && {
timeout "${BENCH_S:-420}" python -m kvtier.cli bench transfer --tokens "${TOKENS:-32768}" --reps 3 --rounds "${ROUNDS:-1}" \
  --page-size 1 --page-size 64 ${KINDS:-} ${BACKENDS:---backend kernel --backend dma --backend auto} ${EXTRA_BACKENDS:-} --verbose \
  --json "$OUT/transfer_h200.json" > "$OUT/transfer.log" 2> "$OUT/transfer.err"
echo "bench transfer rc=$?"
# The bench's stderr as a log: each row and trial on its own line, the progress bar's
# redraws (carriage returns, "bench transfer: ..." up to the next row) dropped, anything
# else (a traceback) kept. Written as transfer_verbose.log in place of transfer.err.
python - "$OUT/transfer.err" "$OUT/transfer_verbose.log" <<'PY' && rm -f "$OUT/transfer.err"
import re, sys
text = open(sys.argv[1], errors="replace").read().replace("\r", "\n")
text = re.sub(r"bench transfer:.*?(?=\[\s*\d+\.\ds\]|$)", "", text, flags=re.M)
open(sys.argv[2], "w").write("".join(line + "\n" for line in text.splitlines() if line.strip()))
PY
tail -3 "$OUT/transfer_verbose.log" 2>/dev/null || tail -3 "$OUT/transfer.err"; }

[ "${TTFT_S:-90}" -gt 0 ] && {
timeout "${TTFT_S:-90}" python -m kvtier.cli bench ttft --io-backends "${TTFT_BACKENDS:-default,kernel}" ${TTFT_ARGS:-} \
  --json "$OUT/ttft_h200.json" > "$OUT/ttft.log" 2>&1
echo "bench ttft rc=$?"; tail -12 "$OUT/ttft.log"; }
for P in ${PROBE:-}; do  # PROBE may name several, each time-boxed by PROBE_S
echo "== $P" >> "$OUT/probes.log"
eval "ARGS=(${PROBE_ARGS:-})"  # PROBE_ARGS: the probes' options, quoted as on a command line
timeout "${PROBE_S:-150}" python "bench/probes/$P.py" "$OUT/probe_${P}_h200.json" "${ARGS[@]}" > /tmp/probe.log 2>&1
echo "probe $P rc=$?"; cat /tmp/probe.log >> "$OUT/probes.log"; tail -5 /tmp/probe.log; done
true
