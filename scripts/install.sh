#!/usr/bin/env bash
# Install kvtier into the active Python environment.
#   bash scripts/install.sh          the library and the `kvtier` command
#   bash scripts/install.sh test     ... plus what the test suite needs
# An installed torch (CPU or CUDA) is kept. Where none is installed, torch
# 2.13.0 is installed first: on machines that keep its CPU wheel on disk pip
# takes that file instead of downloading a multi-GB CUDA build.
set -euo pipefail
PY=${PYTHON:-python3}
cd "$(dirname "$0")/.."
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "kvtier: no torch found, installing torch==2.13.0" >&2
  "$PY" -m pip install -q "torch==2.13.0"
fi
extra=${1:-}
"$PY" -m pip install -q -e ".${extra:+[$extra]}"
"$PY" -c "import kvtier, torch; print(f'kvtier {kvtier.__version__} installed (torch {torch.__version__}, CUDA {torch.cuda.is_available()})')"
