#!/bin/bash
# The initialisation comparison, second GPU call (2026-11-27): the embeddings-only init (config embed_init_std 0.02, Xavier
# linears) on Multi30k, cpu preset, fp32, 1500 steps; every row scores BLEU + chrF on test_2016_flickr and val.
# One process per row (--threads 1), run from the checkout with .devdata/ (the Multi30k files + the tokenizer trained
# here) and .whl/ (datasets wheels) carried:
#   A  soft, hard_cross (embed 0.02) and marian (its own init; scored on val for the first time) x seed {0, 1}  nice 0
#   B  hard_self_cross, hc_sa, sh_x (embed 0.02) x seed {0, 1}                                                   nice 5
#   C  seed 0 (embed 0.02): rnn_luong_soft + beam_joint_rnn_k6 (the beam-joint paper's setting), beam_joint_k6,
#      recurrent_concat_weight / recurrent_expand_1 (best / worst of the recurrent variants at 1500 EPYC steps)   nice 10
# Training minutes are NOT comparable between rows (17 processes share 16 cores and one GPU). Results are packed into
# $OUT/res.tgz every 20 s; at DEADLINE seconds the rows still running are cut off (reported, nothing guessed).
# LOCAL=1: smoke test on this CPU (2 steps, eval 8 sentences, 3 rows).
cd "${REPO:-$(dirname "$0")/../../..}"  # the repository root (default: the checkout holding this script)
SCRATCH=${SCRATCH:-$(mktemp -d)}  # pip target, logs, runs and the packed results
START=$(date +%s); DEADLINE=${DEADLINE:-530}
if [ -z "$LOCAL" ]; then
  W=.whl; python3 -c "import pyarrow, sys; print('pyarrow', pyarrow.__version__); sys.exit(int(pyarrow.__version__.split('.')[0]) < 24)" || W=.whl/alt
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SCRATCH/site $W/*.whl || exit 1
  export PYTHONPATH=$SCRATCH/site:$PWD; PY=python3; M_STEPS=1500; EXTRA=""
else
  export PYTHONPATH=$PWD; PY=python; OUT=${OUT:-$SCRATCH/out}; M_STEPS=2; EXTRA="--eval-size 8"
fi
mkdir -p $OUT; L=$SCRATCH/logs; rm -rf $L; mkdir -p $L; P=${RUNS:-$SCRATCH/runs}; rm -rf $P; mkdir -p $P
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_HARDATTN_MULTI30K=$PWD/.devdata/multi30k TOKENIZERS_PARALLELISM=false
$PY -c "import torch, transformers, datasets, hf_hardattn; print(torch.__version__, transformers.__version__, datasets.__version__, torch.cuda.is_available() and torch.cuda.get_device_name())" || exit 1
grep -m1 "model name" /proc/cpuinfo; nproc
R="$PY benchmarks/reproduce.py --task multi30k --preset cpu --minutes 60 --precision fp32 --threads 1 --quiet --max-steps $M_STEPS $EXTRA"
launch() {  # nice seed embed row
  local d=$P/multi30k-emb$3-s$2-$4; mkdir -p $d; cp -r .devdata/tok_multi30k_0 $d/tokenizer
  local e=$([ $4 = marian ] && echo "" || echo "--embed-init-std $3")
  nice -n $1 $R --seed $2 $e --rows $4 --output-dir $d > $L/multi30k-emb$3-s$2-$4.log 2>&1 &
}
if [ -n "$LOCAL" ]; then
  launch 0 0 0.02 soft; launch 5 1 0.02 marian; launch 10 0 0.02 beam_joint_rnn_k6
elif [ -n "$C_SEED1" ]; then  # the second call: group C, seed 1
  for r in rnn_luong_soft beam_joint_rnn_k6 beam_joint_k6 recurrent_concat_weight recurrent_expand_1; do launch 0 1 0.02 $r; done
else
  for s in 0 1; do for r in soft hard_cross marian; do launch 0 $s 0.02 $r; done; done
  for s in 0 1; do for r in hard_self_cross hc_sa sh_x; do launch 5 $s 0.02 $r; done; done
  for r in rnn_luong_soft beam_joint_rnn_k6 beam_joint_k6 recurrent_concat_weight recurrent_expand_1; do launch 10 0 0.02 $r; done
fi
pack() {  # row JSON + logs (small files) into $OUT/res.tgz
  rm -rf $SCRATCH/res; mkdir -p $SCRATCH/res; cp $L/*.log $SCRATCH/res/
  for d in $P/*; do mkdir -p $SCRATCH/res/$(basename $d); cp $d/reproduce_* $SCRATCH/res/$(basename $d)/ 2>/dev/null; done
  tar czf $OUT/res.tgz.tmp -C $SCRATCH res && mv $OUT/res.tgz.tmp $OUT/res.tgz
}
while [ -n "$(jobs -r)" ] && [ $(( $(date +%s) - START )) -lt $DEADLINE ]; do
  sleep 20; echo "t=$(( $(date +%s) - START ))s running=$(jobs -r | wc -l) $(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader 2>/dev/null) load=$(cut -d' ' -f1 /proc/loadavg)"
  pack
done
pack; echo "end t=$(( $(date +%s) - START ))s, still running (cut off): $(jobs -r | wc -l)"
grep -l "BLEU" $L/*.log | wc -l; tail -qn1 $L/*.log | cut -c1-160
