#!/bin/bash
# The initialisation comparison on one GPU (one call, run from the checkout with .devdata/ = the Multi30k files + the tokenizers
# trained here, and .whl/ = datasets and german-nouns wheels, carried). Every row is its own process (--threads 1):
#   A  Multi30k cpu preset, fp32, 1500 steps: soft, hard_cross x init {xavier, 0.02} x seed {0, 1}      (nice 0)
#   B  nouns cpu preset, fp32, 2000 steps: one row per model type x init {xavier, 0.02} x seed {0, 1}   (nice 5)
#   C  Multi30k as A with init 0.02: hard_self_cross, hc_sa, sh_x x seed {0, 1}                          (nice 10)
# Every Multi30k row scores BLEU + chrF on test_2016_flickr and val. Training minutes are NOT comparable between rows
# here (42 processes share 16 cores and one GPU). Results are packed into $OUT/res.tgz every 20 s; at DEADLINE
# seconds the rows still running are cut off (their absence is reported, nothing is guessed).
# LOCAL=1: smoke test on this CPU (tiny steps, eval 8 sentences, 4 rows).
cd "${REPO:-$(dirname "$0")/../../..}"  # the repository root (default: the checkout holding this script)
SCRATCH=${SCRATCH:-$(mktemp -d)}  # pip target, logs, runs and the packed results
START=$(date +%s); DEADLINE=${DEADLINE:-500}
if [ -z "$LOCAL" ]; then
  W=.whl; python3 -c "import pyarrow, sys; print('pyarrow', pyarrow.__version__); sys.exit(int(pyarrow.__version__.split('.')[0]) < 24)" || W=.whl/alt
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SCRATCH/site $W/*.whl || exit 1
  export PYTHONPATH=$SCRATCH/site:$PWD; PY=python3
  M_STEPS=1500; N_STEPS=2000; EXTRA=""
else
  export PYTHONPATH=$PWD; PY=python; OUT=${OUT:-$SCRATCH/out}; M_STEPS=2; N_STEPS=2; EXTRA="--eval-size 8"
fi
mkdir -p $OUT; L=$SCRATCH/logs; rm -rf $L; mkdir -p $L; P=${RUNS:-$SCRATCH/runs}; rm -rf $P; mkdir -p $P
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_HARDATTN_MULTI30K=$PWD/.devdata/multi30k TOKENIZERS_PARALLELISM=false
$PY -c "import torch, transformers, datasets, hf_hardattn; print(torch.__version__, transformers.__version__, datasets.__version__, torch.cuda.is_available() and torch.cuda.get_device_name())" || exit 1
grep -m1 "model name" /proc/cpuinfo; nproc
R="$PY benchmarks/reproduce.py --preset cpu --minutes 60 --precision fp32 --threads 1 --quiet $EXTRA"
launch() {  # nice task seed init row
  local d=$P/$2-$4-s$3-$5; mkdir -p $d; cp -r .devdata/tok_$2_$([ $2 = nouns ] && echo $3 || echo 0) $d/tokenizer
  local steps=$([ $2 = nouns ] && echo $N_STEPS || echo $M_STEPS)
  nice -n $1 $R --task $2 --seed $3 --init-std $4 --max-steps $steps --rows $5 --output-dir $d > $L/$2-$4-s$3-$5.log 2>&1 &
}
if [ -n "$LOCAL" ]; then
  launch 0 multi30k 0 0.02 soft; launch 0 multi30k 1 xavier hard_cross; launch 5 nouns 1 0.02 beam_joint_k6; launch 10 multi30k 0 0.02 sh_x
else
  ROWGROUPS=${ROWGROUPS:-ABC}  # the second call of 2026-11-26 ran ROWGROUPS=C (A finished in the first, B and C did not)
  [[ $ROWGROUPS == *A* ]] && for s in 0 1; do for i in xavier 0.02; do for r in soft hard_cross; do launch 0 multi30k $s $i $r; done; done; done
  [[ $ROWGROUPS == *B* ]] && for s in 0 1; do for i in xavier 0.02; do
    for r in soft hard_self_cross hc_sa hybrid_dot recurrent_concat_accumulated beam_joint_rnn_k6 beam_joint_k6; do
      launch 5 nouns $s $i $r; done; done; done
  [[ $ROWGROUPS == *C* ]] && for s in 0 1; do for r in hard_self_cross hc_sa sh_x; do launch 10 multi30k $s 0.02 $r; done; done
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
grep -l "BLEU\|accuracy" $L/*.log | wc -l; tail -qn1 $L/*.log | cut -c1-160
