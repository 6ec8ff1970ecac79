#!/usr/bin/env bash
# A paper's recipe group on one lent GPU in one call: every seed's rows side by side, one process per chain of rows
# (benchmarks/reproduce_group.py), to convergence, within DEADLINE seconds; the results so far are packed into
# $OUT/results.tgz every 20 s, so a stop keeps every finished row.
#
#   bash benchmarks/run_gpu_reproduce.sh prepare     # here, once (network to the package index): wheels for .whl/,
#                                                    # Multi30k for .devdata/ (both git-ignored; carry both)
#   bash benchmarks/run_gpu_reproduce.sh             # there: hard retrieval's recipe, its claims' rows, seeds 0 1 2
#   RECIPE=beam_joint TASK=nouns ROWS="rnn_luong_soft beam_joint_rnn_k6" SEEDS="0 1" bash benchmarks/run_gpu_reproduce.sh
#
# Env: RECIPE (hard_retrieval), TASK (multi30k), PRESET (cpu: the CPU rows' sizes, batch and cap, so that the
# recipe matches theirs), ROWS (default: the recipe's claimed rows, below), SEEDS ("0 1 2"), DEADLINE (530 s),
# THREADS (1 per process), EXTRA (more reproduce.py arguments), DATA (reproduce.py --data). Unpack the rows with
# `tar xzf results.tgz` (one folder per seed and chain; each folder's reproduce_*.json records the GPU as its machine).
# The H200 image has torch and transformers but not datasets, evaluate or german-nouns: they travel as wheels
# (datasets 5.x needs pyarrow >= 24; an older image's pyarrow takes the datasets 3.6 set in .whl/alt), installed only
# where missing (so the same script runs here: PRESET=tiny DATA=FOLDER for a smoke test).
set -u
cd "$(dirname "$0")/.."
if [ "${1:-}" = prepare ]; then
  P="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux2014_x86_64 --platform any"
  python3 -m pip download -q $P -d .whl datasets==5.2.0 evaluate==0.4.6 dill==0.4.1 multiprocess==0.70.19 \
    fsspec==2026.9.0 german-nouns==1.2.5 || exit 1
  python3 -m pip download -q $P -d .whl/alt datasets==3.6.0 dill==0.3.8 multiprocess==0.70.16 fsspec==2025.3.0 || exit 1
  mkdir -p .devdata && cp -r "${MULTI30K:-../shared/data/multi30k}" .devdata/ || exit 1
  du -sh .whl .devdata; echo "carry: [\".whl\", \".devdata\"]"
  exit 0
fi
OUT=${OUT:-$PWD/outputs/gpu_reproduce}
SCRATCH=$(mktemp -d)
mkdir -p "$OUT"
if ! python3 -c "import datasets, evaluate, german_nouns" 2>/dev/null; then  # the carried wheels, where missing
  W=.whl
  python3 -c "import pyarrow, sys; sys.exit(int(pyarrow.__version__.split('.')[0]) < 24)" 2>/dev/null || W=.whl/alt
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SCRATCH/site" "$W"/*.whl \
    .whl/evaluate-*.whl .whl/german_nouns-*.whl || exit 1
fi
export PYTHONPATH=$SCRATCH/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HARDATTN_MULTI30K=$PWD/.devdata/multi30k \
  TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
python3 -c "import torch, transformers, datasets, hf_hardattn; print('torch', torch.__version__, '| transformers', transformers.__version__, '| datasets', datasets.__version__, '| GPU', torch.cuda.is_available() and torch.cuda.get_device_name())" || exit 1
grep -m1 "model name" /proc/cpuinfo; nproc
git log -1 --format='commit %H %s' 2>/dev/null || true
RECIPE=${RECIPE:-hard_retrieval}
case "$RECIPE" in  # the rows of the recipe's claims in benchmarks/tables.py
  hard_retrieval) DEFAULT_ROWS="soft hard_cross hard_self_cross soft_decoded_hard hard_decoded_soft" ;;
  hybrid) DEFAULT_ROWS="soft hybrid_additive hybrid_additive_kd_eq1" ;;
  *) DEFAULT_ROWS="" ;;
esac
ROWS=${ROWS:-$DEFAULT_ROWS}
python3 benchmarks/reproduce_group.py --task "${TASK:-multi30k}" --preset "${PRESET:-cpu}" --recipe "$RECIPE" \
  ${ROWS:+--rows $ROWS} --seeds ${SEEDS:-0 1 2} ${DATA:+--data "$DATA"} --runs "$SCRATCH/runs" \
  --deadline "${DEADLINE:-530}" --pack "$OUT/results.tgz" -- --threads "${THREADS:-1}" --quiet ${EXTRA:-} 2>&1 \
  | tee "$OUT/group.log"
RC=${PIPESTATUS[0]}
for f in $(find "$SCRATCH/runs" -name run.log | sort); do echo "== $f"; tail -c 600 "$f" | tr '\r' '\n' | tail -n 4; done
echo "exit status $RC"
exit "$RC"
