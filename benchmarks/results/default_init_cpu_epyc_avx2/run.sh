#!/bin/bash
# Usage: [REPO=CHECKOUT] [RUNS=FOLDER] [SEED=S] bash run.sh   (RUNS: the models and logs, default outputs/cpu_rows of
# the checkout; not kept here). Seeds 0 and 1 ran: SEED=1 bash run.sh for seed 1.
# The CPU rows of soft and hard_cross with the new default init (embed_init_std per type = 0.02),
# Multi30k cpu preset, fp32, 1500 steps, seed $SEED, --threads 1, the two rows side by side on this 2-core CPU.
cd "${REPO:-$(dirname "$0")/../../..}"  # the repository root (default: the checkout holding this script)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_HARDATTN_MULTI30K=$PWD/.devdata/multi30k TOKENIZERS_PARALLELISM=false
SEED=${SEED:-0}; RUNS=${RUNS:-outputs/cpu_rows}; mkdir -p $RUNS
for r in soft hard_cross; do
  d=$RUNS/multi30k-default-s$SEED-$r; mkdir -p $d; [ -d $d/tokenizer ] || cp -r .devdata/tok_multi30k_0 $d/tokenizer
  python benchmarks/reproduce.py --task multi30k --preset cpu --minutes 300 --max-steps 1500 --precision fp32 \
    --threads 1 --seed $SEED --rows $r --output-dir $d > $RUNS/s$SEED-$r.log 2>&1 &
done
wait
