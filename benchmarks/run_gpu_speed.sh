#!/usr/bin/env bash
# The GPU run of benchmarks/gpu_speed.py, from the repository root on the GPU machine: the repository on
# PYTHONPATH (no install), offline. The JSON goes to benchmarks/results/gpu_speed_<gpu-name-slug>.json and is copied
# with the log to $OUT/ (the runner's output folder; default: benchmarks/results). Extra arguments go to the script.
#   bash benchmarks/run_gpu_speed.sh                       # <= 8 minutes on one H100/H200 (budget 420 s + start-up)
#   BUDGET=300 bash benchmarks/run_gpu_speed.sh --decode-rounds 5
#   BUDGET=470 HARD_STOP=560 bash benchmarks/run_gpu_speed.sh --compiled --sections decoding --profile
# HARD_STOP (default 540 s) ends the script from outside. A transformers newer than the machine's (the compiled rows:
# 5.24) travels as a wheel installed with `pip install --no-deps --target DIR` and DIR put on PYTHONPATH first.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/benchmarks/results}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi || echo "nvidia-smi not available"
$PY -c "import sys, torch, transformers; print('python', sys.version.split()[0], '| torch', torch.__version__, '| CUDA', torch.version.cuda, '| cudnn', torch.backends.cudnn.version(), '| transformers', transformers.__version__, '| GPU', torch.cuda.is_available() and torch.cuda.get_device_name(), '| tf32', torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)"
grep -m1 "model name" /proc/cpuinfo; nproc
git log -1 --format='commit %H %s' 2>/dev/null || true
STAMP=$(mktemp)
# HARD_STOP s hard stop (the script's own budget is BUDGET s from its start, model building included); the JSON is
# rewritten after every setting, so a stop keeps what was measured
timeout "${HARD_STOP:-540}" $PY benchmarks/gpu_speed.py --budget-seconds "${BUDGET:-420}" "$@" 2>&1 | tee "$OUT/gpu_speed.log"
RC=${PIPESTATUS[0]}
for f in $(find benchmarks/results -maxdepth 1 -name 'gpu_speed_*.json' -newer "$STAMP"); do
  [ "$(cd "$(dirname "$f")" && pwd)" = "$(cd "$OUT" && pwd)" ] || cp "$f" "$OUT/"
  echo "JSON: $f (copied to $OUT/)"
done
rm -f "$STAMP"
echo "exit status $RC"
exit $RC
