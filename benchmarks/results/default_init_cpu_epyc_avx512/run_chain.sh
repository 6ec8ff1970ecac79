#!/bin/bash
# Usage: [REPO=CHECKOUT] [RUNS=FOLDER] bash run_chain.sh (RUNS: models and results, default outputs/cpu_rows).
# The Eq. 1 hybrid of seed 1 with its teacher (the soft row of seed 1, default init) trained first, one
# process, Multi30k cpu preset, fp32, 1500 steps each, --threads 2, AVX512 EPYC, nice 19 beside other work.
cd "${REPO:-$(dirname "$0")/../../..}"  # the repository root (default: the checkout holding this script)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
d=${RUNS:-outputs/cpu_rows}/multi30k-default-s1-soft-eq1
mkdir -p $d
exec python benchmarks/reproduce.py --task multi30k --preset cpu --minutes 300 --max-steps 1500 --precision fp32 \
  --threads 2 --seed 1 --rows soft hybrid_additive_kd_eq1 --output-dir $d --quiet
