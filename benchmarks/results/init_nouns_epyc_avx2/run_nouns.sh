#!/bin/bash
# Usage: [CODE=CHECKOUT] [RUNS=FOLDER] bash run_nouns.sh (as run on the AVX2 EPYC with CODE a snapshot of commit
# 286e73e; RUNS default outputs/nouns_init of CODE; LOCK as in ../init_emb_nouns_epyc_avx2/run_nouns.sh); soft_marian_emb ran
# benchmarks/results/multi30k_fp32_1500_steps_h200_init_ablation/ablate.py (copied as ablate_init.py) with --task nouns.
# Queue order chosen after soft seed 0 (0.02: 0.0 against 79.95); the rows left in the list did not run (time).
# the rest of the nouns init rows, in the order that decides most (after soft s0: 0.02 scored 0.0 against 79.95)
cd "${CODE:-$(dirname "$0")/../../..}"; export PYTHONPATH=$PWD  # CODE: a snapshot of the code to run
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
P=${RUNS:-outputs/nouns_init}
L="0:xavier:soft_marian_emb 0:xavier:recurrent_concat_accumulated 0:0.02:recurrent_concat_accumulated 0:xavier:hard_self_cross 0:0.02:hard_self_cross 1:0.02:soft 1:xavier:soft 0:xavier:beam_joint_k6 0:0.02:beam_joint_k6 0:xavier:beam_joint_rnn_k6 0:0.02:beam_joint_rnn_k6 0:xavier:hc_sa 0:0.02:hc_sa"
for j in $L; do
  IFS=: read s i r <<< "$j"; d=$P/nouns-$i-s$s-$r
  [ -f $d/reproduce_nouns_cpu.json ] && continue
  while [ -d ${LOCK:-.timing_lock} ] || [ $(pgrep -f "reproduce.py --task nouns|ablate_init.py --task nouns" | wc -l) -ge 2 ]; do sleep 10; done
  mkdir -p $d; [ -d $d/tokenizer ] || cp -r .devdata/tok_nouns_$s $d/tokenizer
  S=benchmarks/reproduce.py; [ $r = soft_marian_emb ] && S=benchmarks/ablate_init.py
  python $S --task nouns --preset cpu --minutes 60 --max-steps 2000 --precision fp32 --threads 1 --quiet \
    --seed $s --init-std $i --rows $r --output-dir $d > $d.log 2>&1 &
  sleep 5
done
wait; echo all done
