#!/bin/bash
# Full-scale runs of chapter 6b's convergence study and deep depth sweep, on a 16-core machine (one torch thread per process).
# Usage, from the repository root: bash DEVICE_RUN.sh OUT_DIR [PYTHON]   (writes OUT_DIR/mechanism_converge.json, OUT_DIR/mechanism_depth_deep.json)
set -u
OUT=${1:?usage: bash DEVICE_RUN.sh OUT_DIR [PYTHON]}; PY=${2:-python3}
export PYTHONPATH=$PWD OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONUNBUFFERED=1
CACHE=${CACHE:-/tmp/ictd-mech-cache}; LOG=${LOG:-/tmp/ictd-mech-logs}   # outside $OUT: only the two JSON files and logs.txt come back
mkdir -p "$OUT" "$CACHE" "$LOG"
ictd() { "$PY" -c "import sys; from ictd.cli import main; main(sys.argv[1:])" "$@"; }
CONV="--lrs 0.003 0.01 0.03 --steps 16000 --eval-every 250 --window 2000"
# 1. train: 12 convergence workers (3 learning rates x 4 seed groups) and 4 deep workers (L = 12, 16 x 2 seed groups), in parallel
for lr in 0.003 0.01 0.03; do for s in 0-2 3-5 6-7 8-9; do
  ictd mechanism converge --seeds $s --lrs $lr --steps 16000 --eval-every 250 --window 2000 --cache-dir "$CACHE" --train-only --device cpu --out "$OUT" --no-progress > "$LOG/train-conv-$lr-$s.log" 2>&1 &
  sleep 1   # staggered: the workers of one configuration share its folder
done; done
for L in 12 16; do for s in 0-4 5-9; do
  ictd mechanism deep --seeds $s --depths $L --cache-dir "$CACHE" --train-only --device cpu --out "$OUT" --no-progress > "$LOG/train-deep-$L-$s.log" 2>&1 &
  sleep 1
done; done
wait
# 2. assemble the two files from the saved runs (nothing is retrained)
ictd mechanism converge --seeds 0-9 $CONV --cache-dir "$CACHE" --device cpu --out "$OUT" --no-progress > "$LOG/assemble-conv.log" 2>&1 &
ictd mechanism deep --seeds 0-9 --depths 12 16 --cache-dir "$CACHE" --device cpu --out "$OUT" --no-progress > "$LOG/assemble-deep.log" 2>&1 &
wait
tail -n 3 "$LOG"/*.log > "$OUT/logs.txt"; cat "$OUT/logs.txt"
ls -l "$OUT"/*.json
