#!/usr/bin/env bash
# Issue 26's CPU study: the default (sandwich) loop state against the residual-stream loop state at
# the paper's loop schedule (mean 12 loops, backprop depth 8), 3 seeds each, on the same prepared
# tokens and steps, one thread per run, one run at a time. Training only; the analysis follows
# (scripts/loop_state_study_analyze.sh). Usage: [BLOCK=64] scripts/loop_state_study.sh [OUT] [STEPS]
set -euo pipefail
OUT=${1:-runs/study26}
STEPS=${2:-300}
BLOCK=${BLOCK:-64}
DATA=${DATA:-data/wiki-bpe4096}
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
mkdir -p "$OUT"
for seed in 0 1 2; do
  for state in sandwich residual; do
    run="$OUT/$state-s$seed"
    if [ -f "$run/summary.json" ]; then echo "skip $run (done)"; continue; fi
    echo "$(date -u +%H:%M:%S) start $run"
    python -m rdepth train --preset tiny --data "$DATA" --out "$run" --seed "$seed" \
      --mean-loops 12 --backprop-depth 8 --loop-state "$state" \
      --batch-size 8 --block-size "$BLOCK" --max-steps "$STEPS" --warmup-steps 30 \
      --eval-every 100 --eval-batches 4 --checkpoint-every 100 --keep-last 0 \
      --log-every 10 --threads 1 > "$run.log" 2>&1
    echo "$(date -u +%H:%M:%S) done $run: $(tail -2 "$run.log" | head -1)"
  done
done
