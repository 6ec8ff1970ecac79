#!/bin/bash
# Usage: [REPO=CHECKOUT] [RUNS=FOLDER] [SEED=S] bash run_eq1.sh (RUNS as for run.sh, holding that seed's soft row).
# The Eq. 1 hybrid (hybrid_additive_kd_eq1) on the CPU, seed $SEED, teacher = the CPU soft row of that
# seed (default init, 1500 fp32 steps, AVX2 EPYC; run.sh), Multi30k cpu preset, fp32, 1500 steps, --threads 2.
# Ran for seed 0 at nice 10 beside other work: 28.5 min translating the 29k training sources,
# then 1500 steps (750 MLE at ~1.5 s, 750 Eq. 1 at ~4.2 s a step): its training minutes compare with no other row.
# Stored without the teacher's soft row (the same as multi30k-default-s0-soft's, so compare_rows reads each once).
cd "${REPO:-$(dirname "$0")/../../..}"  # the repository root (default: the checkout holding this script)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_HARDATTN_MULTI30K=$PWD/.devdata/multi30k TOKENIZERS_PARALLELISM=false
SEED=${SEED:-0}; RUNS=${RUNS:-outputs/cpu_rows}
d=$RUNS/multi30k-default-s$SEED-hybrid_additive_kd_eq1
[ -d $d ] || cp -r $RUNS/multi30k-default-s$SEED-soft $d
python benchmarks/reproduce.py --task multi30k --preset cpu --minutes 300 --max-steps 1500 --precision fp32 \
  --threads 2 --seed $SEED --rows hybrid_additive_kd_eq1 --output-dir $d > $RUNS/s$SEED-eq1.log 2>&1
