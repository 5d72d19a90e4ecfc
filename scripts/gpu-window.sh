#!/usr/bin/env bash
# One GPU window, run on the lent machine (docs/gpu-study.md): the slice file $1 trained $2 fused groups at once
# for $3 seconds; the results file goes to $OUT. Needs only python with torch, numpy and pyyaml there.
set -u
slice=$1 workers=$2 seconds=$3
PY=$(command -v python || command -v python3)
scratch=$(mktemp -d) && chmod 700 "$scratch"
export TMPDIR=$scratch TORCHINDUCTOR_CACHE_DIR=$scratch/inductor TRITON_CACHE_DIR=$scratch/triton
export TORCHINDUCTOR_COMPILE_THREADS=2
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
"$PY" -c "import sys, torch, numpy, yaml; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.is_available(), numpy.__version__, yaml.__version__)" || exit 3
if [ ! -d data/tokens ]; then "$PY" -m tasks.gpu_study.carry unpack || exit 4; fi  # the carried tokens
name=$(basename "$slice" .json)
"$PY" -m tasks.gpu_study.window "$slice" --out "$OUT/$name.jsonl.gz" --workers "$workers" --window-s "$seconds" 2>&1 | tail -n 400
nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
