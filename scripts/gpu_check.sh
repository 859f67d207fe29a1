#!/usr/bin/env bash
# One-command device check (experiments/gpu_check.py): greedy equality against transformers'
# generate in bf16 on CUDA (chain, vertical cascade, DyTC tree), the deep chi-square on the
# device, an NF4 drafter through bitsandbytes, forward cost, the main job; one markdown report
# (docs/gpu_check.md). `--tiny`: the same steps with tiny models on the CPU (~1 min; the default
# test suite runs it). Run from anywhere; uses the active Python environment (or $PYTHON).
#   bash scripts/gpu_check.sh [--tiny] [--out REPORT.md]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
if [ "${1:-}" != "--tiny" ] && "$PYTHON" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  "$PYTHON" -c "import bitsandbytes" 2>/dev/null || "$PYTHON" -m pip install -q bitsandbytes   # NF4 drafters on CUDA
fi
exec "$PYTHON" experiments/gpu_check.py "$@"
