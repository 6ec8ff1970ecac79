#!/bin/bash
# Usage: [CODE=CHECKOUT] [RUNS=FOLDER] bash run_nouns.sh (RUNS default outputs/nouns_init of CODE; LOCK: a folder
# whose presence pauses the queue, default .timing_lock). The embeddings-only init on the nouns task (as run; 2-core AVX2 AMD EPYC, 2 rows at a time, 1 thread each): the
# embeddings-only init (embed 0.02: config embed_init_std 0.02, Xavier linears) against the default (xavier: Xavier
# linears, N(0, d^-1/2) embeddings), every model type, seeds 0 and 1, cpu preset, fp32, 2000 steps.
# code = a snapshot of the working tree (with embed_init_std); the Xavier seed-0 rows of soft,
# hard_self_cross, hybrid_dot and recurrent_concat_accumulated are those of ../init_nouns_epyc_avx2 (same CPU kind,
# same default init, code whose nouns path is unchanged for these types). Queue order: what decides most first.
cd "${CODE:-$(dirname "$0")/../../..}"; export PYTHONPATH=$PWD  # CODE: a snapshot of the code to run
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
P=${RUNS:-outputs/nouns_init}; mkdir -p $P
T="soft hard_self_cross hc_sa hybrid_dot recurrent_concat_accumulated beam_joint_rnn_k6 beam_joint_k6"
L=""; for r in $T; do L="$L 0:0.02:$r"; done
for r in hc_sa beam_joint_rnn_k6 beam_joint_k6; do L="$L 0:follow:$r"; done
for r in $T; do L="$L 1:0.02:$r 1:follow:$r"; done
for j in $L; do
  IFS=: read s e r <<< "$j"; d=$P/nouns-emb$e-s$s-$r
  [ -f $d/reproduce_nouns_cpu.json ] && continue
  while [ -d ${LOCK:-.timing_lock} ] || [ $(pgrep -f "reproduce.py --task nouns" | wc -l) -ge 2 ]; do sleep 10; done
  mkdir -p $d; [ -d $d/tokenizer ] || cp -r .devdata/tok_nouns_$s $d/tokenizer
  python benchmarks/reproduce.py --task nouns --preset cpu --minutes 60 --max-steps 2000 --precision fp32 --threads 1 \
    --quiet --seed $s --embed-init-std $e --rows $r --output-dir $d > $d.log 2>&1 &
  sleep 5
done
wait; echo all done
