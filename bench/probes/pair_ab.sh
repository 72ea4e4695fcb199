#!/usr/bin/env bash
# A/B of whole code versions on the transfer bench, each version timed in turn in fresh
# processes, so a machine's drift between device calls (the duplex limit ranged 82-102 GB/s
# between calls of one session, runs 55-60) is not read as a code effect.
#
#   bash bench/probes/pair_ab.sh prepare REV...   # here: each REV's kvtier into _ab/REV
#   bash bench/probes/pair_ab.sh run [ROUNDS]     # on the device (run with carry=["_ab"])
#
# `run` times, for every _ab/REV in turn (reversed every other round) and ROUNDS times over (default 2), TOKENS (32768), the bench rows
# picked by AB_ARGS (default: MHA page_first page 1 on allocator slots, dma) and prints one
# line per row and version (pairs with their timeline: when backup() and load() returned,
# when the backup was queued, when each ended). Each process starts inside its own tree: `python -m` puts the
# working directory first on sys.path, so PYTHONPATH alone would import the same kvtier for
# every version (which voided run 56's A/B).
# Run 62 (bench/results/probe_pair_ab_h200_run62.log; 925dba1 before head-join, 9b8b45a head-join,
# b1973de with the backlog and the leak fix; three rounds): MHA page_first p1 allocator dma pairs
# 1.631-1.644x, 1.569-1.654x and 1.626-1.668x, no version lowest in every round: run 60's lower
# pairs were not the code.
set -euo pipefail
cmd=${1:-}; shift || true
case "$cmd" in
prepare)
  rm -rf _ab; mkdir -p _ab
  for rev in "$@"; do
    mkdir -p "_ab/$rev" && git archive "$rev" kvtier | tar -x -C "_ab/$rev"
    # The same harness for every version (it logs each pair's timeline, pair_ms=[...]):
    # only the engine under it differs.
    cp kvtier/bench/transfer.py "_ab/$rev/kvtier/bench/transfer.py"
    echo "_ab/$rev: $(git log -1 --format='%h %s' "$rev" | cut -c1-100)"
  done ;;
run)
  rounds=${1:-2}
  args=${AB_ARGS:---kind mha --layout page_first --slots allocator --page-size 1 --backend dma}
  export KVTIER_HOST_RESERVE_GB=4 PYTHONUNBUFFERED=1
  trees=(_ab/*/)
  for r in $(seq "$rounds"); do
    # Odd rounds in name order, even rounds reversed: run 70 ran the same version first in
    # every round, and a version's unchanged backups came out 0.2-0.55 GB/s faster there.
    order=("${trees[@]}")
    [ $((r % 2)) -eq 0 ] && order=($(printf '%s\n' "${trees[@]}" | sort -r))
    for tree in "${order[@]}"; do
      rev=$(basename "$tree")
      (cd "$tree" && PYTHONPATH=. python -c "import kvtier, os; assert os.path.dirname(kvtier.__file__).startswith(os.getcwd())" \
        && PYTHONPATH=. timeout 120 python -m kvtier.cli bench transfer --tokens ${TOKENS:-32768} --reps 3 --rounds 2 $args --verbose \
          2>&1 >/dev/null | tr '\r' '\n' | grep -oE '\[ *[0-9.]+s\] .*' | sed "s|^|round $r $rev |") || echo "round $r $rev failed"
    done
  done ;;
*)
  echo "usage: $0 prepare REV... | run [ROUNDS]" >&2; exit 2 ;;
esac
