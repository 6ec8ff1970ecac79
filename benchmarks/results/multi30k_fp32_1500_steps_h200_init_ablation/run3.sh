#!/bin/bash
# call 3: init ablation of soft vs Marian at 1500 steps (seed 0), and Marian seed 1
cd "${REPO:-$(dirname "$0")/../../..}"  # the repository root (default: the checkout holding this script)
SCRATCH=${SCRATCH:-$(mktemp -d)}  # pip target, logs, runs and the packed results
START=$(date +%s)
if [ -z "$LOCAL" ]; then
  W=.whl; python3 -c "import pyarrow, sys; sys.exit(int(pyarrow.__version__.split('.')[0]) < 24)" || W=.whl/alt
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SCRATCH/site $W/*.whl || exit 1
  export PYTHONPATH=$SCRATCH/site:$PWD:$PWD/.devdata/site; PY=python3; CAP=${CAP:-5}
else
  export PYTHONPATH=$PWD:$PWD/.devdata/site; PY=python; CAP=1; OUT=${OUT:-$SCRATCH/out}
fi
mkdir -p $OUT; L=$SCRATCH/logs3; rm -rf $L; mkdir -p $L
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_HARDATTN_MULTI30K=$PWD/.devdata/multi30k TOKENIZERS_PARALLELISM=false
P=outputs/reproduce/ablate; [ -n "$LOCAL" ] && P=$SCRATCH/ablateP
R="$PY .devdata/ablate.py --task multi30k --preset cpu --minutes $CAP --max-steps 1500 --precision fp32 --threads 2 --quiet"
[ -n "$LOCAL" ] && R="$R --max-steps 2 --eval-size 8"
for row in soft_marian_init soft_marian_emb soft_marian_lin marian_our_init; do
  mkdir -p $P/$row; cp -r .devdata/tokenizer $P/$row/
  $R --seed 0 --rows $row --output-dir $P/$row > $L/$row.log 2>&1 &
done
mkdir -p $P/marian_seed1; cp -r .devdata/tokenizer $P/marian_seed1/
$R --seed 1 --rows marian --output-dir $P/marian_seed1 > $L/marian_seed1.log 2>&1 &
pack() { rm -rf $SCRATCH/res3; mkdir -p $SCRATCH/res3; cp $L/*.log $SCRATCH/res3/; for d in $P/*; do mkdir -p $SCRATCH/res3/$(basename $d); cp $d/reproduce_* $SCRATCH/res3/$(basename $d)/ 2>/dev/null; done
  tar czf $OUT/res.tgz.tmp -C $SCRATCH res3 && mv $OUT/res.tgz.tmp $OUT/res.tgz; }
while [ -n "$(jobs -r)" ]; do sleep 15; echo "t=$(( $(date +%s) - START ))s"; tail -qn1 $L/*.log | cut -c1-120; pack; done
pack; echo "end t=$(( $(date +%s) - START ))s"
