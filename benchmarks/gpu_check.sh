#!/usr/bin/env bash
# make gpu-check: the GPU tests and a short decode benchmark, on a CUDA host,
# in under 8 minutes. Writes benchmarks/results/gpu_check.{txt,json}.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=benchmarks/results
mkdir -p "$OUT"
PY=${GPU_PYTHON:-.venv-gpu/bin/python}
if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu-check: no CUDA device here (torch.cuda.is_available() is False); nothing to check." >&2
  exit 1
fi
if [ ! -x "$PY" ]; then
  python3 -m venv .venv-gpu && .venv-gpu/bin/pip install -q -e '.[gpu,test]' || {
    echo "gpu-check: could not install the GPU extra (vllm==0.32.0, CUDA build); it needs PyPI." >&2
    echo "gpu-check: on a machine without network, see benchmarks/gpu_lent/run.sh." >&2; exit 2; }
fi
export VLLM_ENABLE_V1_MULTIPROCESSING=0 PYTHONUNBUFFERED=1
{
  echo "# gpu-check $(date -u +%FT%TZ) $(git rev-parse --short HEAD 2>/dev/null)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -c "import torch, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__)"
  timeout 260 "$PY" -m pytest -q -rs -m gpu tests
  echo "tests rc=$?"
  timeout 150 "$PY" benchmarks/gpu_decode.py --out "$OUT/gpu_check.json"
  echo "benchmark rc=$?"
  VLLM_ENABLE_V1_MULTIPROCESSING=1 timeout 60 "$PY" benchmarks/async_decode.py --repeats 2 --new-tokens 64 \
    --out "$OUT/gpu_check_async.json"
  echo "async benchmark rc=$?"
} 2>&1 | tee "$OUT/gpu_check.txt"
