#!/bin/bash
# Regenerate every saved result under nbs/data after the seed-discipline change, in two lanes on a 2-core machine.
cd /work/wt/regen
export PYTHONPATH=$PWD OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONUNBUFFERED=1
PY=.venv/bin/python; OUT=/work/regen_out; LOG=/work/regen_logs
ictd() { $PY -c "import sys, torch; torch.set_num_threads(1); from ictd.cli import main; main(sys.argv[1:])" "$@"; }
t() { local name=$1; shift; local s=$(date +%s); "$@" > $LOG/$name.log 2>&1; echo "$name rc=$? $(( $(date +%s) - s )) s" >> $LOG/times.txt; }
laneA() {
  for st in runs controls dynamics gap gamma depth jacobian shared; do t mech-$st ictd mechanism $st --seeds 0-9 --out $OUT --no-progress; done
}
laneB() {
  t causal $PY -c "
import dataclasses, json, time, torch; torch.set_num_threads(1)
from ictd.engine import EMERGENCE
from ictd.core import provenance
from ictd.causal import causal_pretrain_summary
t0 = time.time()
summary = causal_pretrain_summary(dataclasses.replace(EMERGENCE, attention='causal'), list(range(10)))
summary['provenance'] = provenance('the eval: false cell of nbs/04a_causal.ipynb, run from the repository root with OMP_NUM_THREADS=1', wall_s=round(time.time() - t0, 1), threads=1)
json.dump(summary, open('$OUT/causal_pretrain.json', 'w'), indent=1)"
  t h2h $PY -c "import torch; torch.set_num_threads(1); from ictd.experiments.linear import run_head_to_head; run_head_to_head('$OUT/head_to_head.json')"
  t iclr $PY -c "
import torch; torch.set_num_threads(1)
import ictd.experiments.linear as L
res = L.reproduce_iclr(seeds=range(30), out='$OUT/iclr_linear_30seeds.json', progress=False,
                       command=\"python -c 'from ictd.experiments.linear import reproduce_iclr; reproduce_iclr(seeds=range(30), out=\\\"nbs/data/iclr_linear_30seeds.json\\\")'\")
L.pretrain_many = lambda config, seeds, progress=True: res[:len(list(seeds))]   # the engine's run i equals seed i's own run: reuse seeds 0-9
L.reproduce_iclr(seeds=range(10), out='$OUT/iclr_linear_10seeds.json', progress=False,
                 command='seeds 0-9 of the 30-seed reproduce_iclr run above (the engine returns each seed its own run), summarised by reproduce_iclr(seeds=range(10))')"
  t converge ictd mechanism converge --seeds 0-9 --lrs 0.003 0.01 0.03 --steps 16000 --eval-every 250 --window 2000 --cache-dir /work/regen_cache --device cpu --out $OUT --no-progress
  t deep ictd mechanism deep --seeds 0-9 --depths 12 16 --cache-dir /work/regen_cache --device cpu --out $OUT --no-progress
}
laneA & laneB & wait
echo ALL DONE >> $LOG/times.txt
