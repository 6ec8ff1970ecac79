#!/bin/bash
# As run on 2026-11-27: seed 0 (stop 58) and SEED=1 (stop 59), from /work/cpu_rows; outputs and logs there (not kept). Seed 1: SEED=1 ./run.sh.
# #53 item 2: the CPU rows of soft and hard_cross with the new default init (embed_init_std per type = 0.02),
# Multi30k cpu preset, fp32, 1500 steps, seed $SEED, --threads 1, the two rows side by side on this 2-core CPU.
cd /work/main
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_HARDATTN_MULTI30K=$PWD/.devdata/multi30k TOKENIZERS_PARALLELISM=false
SEED=${SEED:-0}
for r in soft hard_cross; do
  d=/work/cpu_rows/multi30k-default-s$SEED-$r; mkdir -p $d; [ -d $d/tokenizer ] || cp -r .devdata/tok_multi30k_0 $d/tokenizer
  python benchmarks/reproduce.py --task multi30k --preset cpu --minutes 300 --max-steps 1500 --precision fp32 \
    --threads 1 --seed $SEED --rows $r --output-dir $d > /work/cpu_rows/s$SEED-$r.log 2>&1 &
done
wait
