#!/usr/bin/env bash
# Learning curves of the draft head that separate optimiser steps from training data, on the
# captured features of `python -m cascade.train_head` (the same corpus, seed and held-out chunks;
# capture happens once and is reused). Each run prints held-out top-1 agreement at depths 1-4
# after every epoch; its summary.json and log go to results/train_head/curves/NAME.{json,log}.
#   runs (name: training tokens x epochs ~ optimiser steps at batch_chunks=1):
#     57k_e3:      all ~57k tokens x 3 epochs (~960 steps: more steps on the same data)
#     15k_e4:      the first 15k tokens x 4 epochs (~320 steps: the 57k one-epoch run's step count)
#     30k_e2:      the first 30k tokens x 2 epochs (~320 steps)
#     15k_e4_bf16: 15k_e4 with bf16 autocast training steps (throughput and agreement against fp32)
#     57k_e3_bf16: 57k_e3 with bf16 autocast training steps
#     114k_e4_bf16: a 120k-token corpus (its first ~57k tokens' features copied from the 60k
#                  capture), 4 epochs (~2,600 steps), bf16 steps on float16 features (the defaults)
#     114k_e9_bf16: the same corpus, 9 epochs (~5,400 steps: where 114k_e4_bf16's fit puts held-out 0.5)
# A run stopped part-way continues from its last finished epoch when the same command is run again
# (train.resume=auto, the run directory being fixed here); a finished run is not repeated.
# fp32 runs use fp32 features too (the arithmetic of the one-epoch baseline in
# results/train_head/summary_normed.json), whatever the defaults.
# Usage: bash experiments/head_curves.sh [NAME ...]   (default: 57k_e3 15k_e4 15k_e4_bf16)
set -euo pipefail
cd "$(dirname "$0")/.."
out=results/train_head/curves
mkdir -p "$out"
fp32="train.precision=fp32 train.feature_storage=float32"
declare -A ARGS=(
  [57k_e3]="train.epochs=3 $fp32"
  [15k_e4]="train.train_tokens=15000 train.epochs=4 $fp32"
  [30k_e2]="train.train_tokens=30000 train.epochs=2 $fp32"
  [15k_e4_bf16]="train.train_tokens=15000 train.epochs=4 train.precision=bf16 train.feature_storage=float32"
  [57k_e3_bf16]="train.epochs=3 train.precision=bf16 train.feature_storage=float32"
  [114k_e4_bf16]="train.max_tokens=120000 train.epochs=4 train.precision=bf16"
  [114k_e9_bf16]="train.max_tokens=120000 train.epochs=9 train.precision=bf16"
)
names=("$@"); [ ${#names[@]} -eq 0 ] && names=(57k_e3 15k_e4 15k_e4_bf16)
for name in "${names[@]}"; do
  [ -n "${ARGS[$name]+x}" ] || { echo "unknown run $name (known: ${!ARGS[*]})" >&2; exit 2; }
  echo "== $name ($(date -u +%FT%TZ)): ${ARGS[$name]}" | tee -a "$out/$name.log"  # appended: a resumed run keeps the first part
  # shellcheck disable=SC2086
  python -m cascade.train_head ${ARGS[$name]} train.save_to=null progress=false \
    hydra.run.dir="outputs/head_curves/$name" 2>&1 | tee -a "$out/$name.log"
  cp "outputs/head_curves/$name/summary.json" "$out/$name.json"
done
