#!/bin/bash
# The two calls of 2026-11-26 on one H200 (run from .devdata/ of the checkout, with the Multi30k files, the wheels
# in .whl/ and the eq1fixed folder carried): `run_on_gpu.sh 1` trains the Multi30k beam-joint, hybrid-KD and int8 rows (fp32, the
# cpu preset's recipe, 1500 steps, seed 0) in parallel, then scores fp32/int8/bf16 of hard_cross and the converted
# Marian on that machine's CPU; `run_on_gpu.sh 2` trains soft (seeds 0 and 1) and seed 1 of the beam-joint rows.
# LOCAL=1: smoke test on a CPU (no wheels, tiny steps). (Call 2 ran on the still-warm machine of call 1; it copied the
# same tokenizer from .devdata/tokenizer.)
CALL=${1:?1 or 2}
cd "${REPO:-$(dirname "$0")/../../..}"  # the repository root (default: the checkout holding this script)
SCRATCH=${SCRATCH:-$(mktemp -d)}  # pip target, logs, runs and the packed results
START=$(date +%s)
if [ -z "$LOCAL" ]; then
  # datasets 5.2 needs pyarrow >= 24; an older pyarrow there gets datasets 4.4.2 (pyarrow >= 21)
  W=.whl; python3 -c "import pyarrow, sys; print('pyarrow', pyarrow.__version__); sys.exit(int(pyarrow.__version__.split('.')[0]) < 24)" || W=.whl/alt
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SCRATCH/site $W/*.whl || exit 1
  export PYTHONPATH=$SCRATCH/site:$PWD:$PWD/.devdata/site
  PY=python3; CAP=${CAP:-5.5}; QT=6
else
  export PYTHONPATH=$PWD:$PWD/.devdata/site
  PY=python; CAP=1; OUT=${OUT:-$SCRATCH/out}; QT=1
fi
mkdir -p $OUT; L=$SCRATCH/logs; rm -rf $L; mkdir -p $L
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_HARDATTN_MULTI30K=$PWD/.devdata/multi30k TOKENIZERS_PARALLELISM=false
$PY -c "import torch, transformers, datasets, pyarrow, hf_hardattn, platform; print(torch.__version__, transformers.__version__, datasets.__version__, pyarrow.__version__, torch.cuda.is_available() and torch.cuda.get_device_name(), torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, platform.processor())" || exit 1
grep -m1 "model name" /proc/cpuinfo; nproc
P=outputs/reproduce
if [ -n "$LOCAL" ]; then rm -rf $SCRATCH/smokeP; mkdir -p $SCRATCH/smokeP; cp -r $P/multi30k-cpu-fp32-1500steps-issue42-eq1fixed $SCRATCH/smokeP/; P=$SCRATCH/smokeP; fi
E1=$P/multi30k-cpu-fp32-1500steps-issue42-eq1fixed
if [ "$CALL" = 1 ]; then
  H=$P/multi30k-gpu-fp32-1500steps-hard; M=$P/multi30k-gpu-fp32-1500steps-marian
  B1=$P/multi30k-gpu-fp32-1500steps-rnnsoft; B2=$P/multi30k-gpu-fp32-1500steps-bjrnn; T=$P/multi30k-gpu-fp32-1500steps-bjtf
  KEEP="$E1 $H $M $B1 $B2 $T"
else
  H=$P/multi30k-gpu-fp32-1500steps-soft; M=$P/multi30k-gpu-fp32-1500steps-seed1-soft
  B1=$P/multi30k-gpu-fp32-1500steps-seed1-rnnsoft; B2=$P/multi30k-gpu-fp32-1500steps-seed1-bjrnn; T=$P/multi30k-gpu-fp32-1500steps-seed1-bjtf
  KEEP="$H $M $B1 $B2 $T"
fi
for d in $H $M $B1 $B2 $T; do mkdir -p $d; [ -d $d/tokenizer ] || cp -r $E1/tokenizer $d/; done
R="$PY benchmarks/reproduce.py --task multi30k --preset cpu --minutes $CAP --max-steps 1500 --precision fp32 --threads 2 --quiet"
[ -n "$LOCAL" ] && R="$R --max-steps 2 --eval-size 8"
if [ "$CALL" = 1 ]; then
  ($R --seed 0 --rows hard_cross --output-dir $H; $PY benchmarks/quantized_quality.py hard_cross --folder $H --threads $QT --output $L/qq_hard.json) > $L/hard.log 2>&1 &
  ($R --seed 0 --rows marian --output-dir $M; $PY benchmarks/quantized_quality.py --marian $M/models/marian --folder $M --threads $QT --output $L/qq_marian.json) > $L/marian.log 2>&1 &
  $R --seed 0 --rows hybrid_additive_kd_eq1 --output-dir $E1 > $L/eq1.log 2>&1 &
  $R --seed 0 --rows rnn_luong_soft --output-dir $B1 > $L/rnnsoft.log 2>&1 &
  $R --seed 0 --rows beam_joint_rnn_k6 beam_joint_rnn_k6_decoded_k1 --output-dir $B2 > $L/bjrnn.log 2>&1 &
  $R --seed 0 --rows beam_joint_k6 beam_joint_k6_decoded_k1 --output-dir $T > $L/bjtf.log 2>&1 &
else
  $R --rows soft --seed 0 --output-dir $H > $L/soft0.log 2>&1 &
  $R --rows soft --seed 1 --output-dir $M > $L/soft1.log 2>&1 &
  $R --rows rnn_luong_soft --seed 1 --output-dir $B1 > $L/rnnsoft1.log 2>&1 &
  $R --rows beam_joint_rnn_k6 beam_joint_rnn_k6_decoded_k1 --seed 1 --output-dir $B2 > $L/bjrnn1.log 2>&1 &
  $R --rows beam_joint_k6 beam_joint_k6_decoded_k1 --seed 1 --output-dir $T > $L/bjtf1.log 2>&1 &
fi
pack() {  # the results so far, small files only, into $OUT/res.tgz (refreshed while the rows run)
  rm -rf $SCRATCH/res; mkdir -p $SCRATCH/res; cp $L/*.log $L/qq_*.json $SCRATCH/res/ 2>/dev/null
  for d in $KEEP; do n=$(basename $d); mkdir -p $SCRATCH/res/$n; cp $d/reproduce_* $SCRATCH/res/$n/ 2>/dev/null
    for m in $d/models/*; do [ -d $m ] && mkdir -p $SCRATCH/res/$n/models/$(basename $m) && cp $(ls $m/* | grep -v safetensors) $SCRATCH/res/$n/models/$(basename $m)/; done; done
  tar czf $OUT/res.tgz.tmp -C $SCRATCH res && mv $OUT/res.tgz.tmp $OUT/res.tgz
}
while [ -n "$(jobs -r)" ]; do sleep 20; echo "t=$(( $(date +%s) - START ))s $(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader 2>/dev/null)"; tail -qn1 $L/*.log | cut -c1-150; pack; done
echo "all done t=$(( $(date +%s) - START ))s"
pack
[ "$CALL" = 1 ] && for pair in "hard:$H/models/hard_cross" "eq1:$E1/models/hybrid_additive_kd_eq1"; do
  n=${pair%%:*}; f=${pair#*:}/model.safetensors; [ -f $f ] && split -b 15M $f $OUT/$n.st. ; done
ls -la $OUT; echo "end t=$(( $(date +%s) - START ))s"
