#!/usr/bin/env bash
# make gpu-check on a lent GPU machine that has no network (the `device`
# tool), with what benchmarks/gpu_lent/prepare.sh built here. Each call carries
# at most 64 MiB with the tracked tree, so move benchmarks/results (~44 MB)
# out of the checkout first and back after; then two calls, the second
# within the 30 s the machine stays warm (the first one's files live in /tmp):
#   run(command="bash benchmarks/gpu_lent/run.sh stash", carry=[".gpu/c"], timeout_s=60)
#   run(command="bash benchmarks/gpu_lent/run.sh check", carry=[".gpu/d"], timeout_s=540)
# `check decode-only` skips the tests (a second try at the timings on the same warm machine).
# Outputs come back under $OUT: gpu_tests.txt, gpu_decode.txt, gpu_check.json.
set -u
export PYTHONUNBUFFERED=1 VLLM_ENABLE_V1_MULTIPROCESSING=0
# flashinfer is not carried (34 MB); without this vLLM imports it to probe it.
export VLLM_USE_FLASHINFER_SAMPLER=0
stash=/tmp/gpu-stash
if [ "${1:-}" = stash ]; then
  mkdir -p $stash && xz -dc .gpu/c/C.so.xz > $stash/_C_stable_libtorch.abi3.so && ls -la $stash
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  exit
fi
site=/tmp/gpu-site
rm -rf $site && mkdir -p $site
python3 -m pip install -q --no-index --no-deps --no-compile --target $site .gpu/d/whl/*.whl 2>&1 | grep -v WARN | tail -3
tar -xJf .gpu/d/vllm-py.tar.xz -C $site
cp $stash/_C_stable_libtorch.abi3.so $site/vllm/ || { echo "no _C: run the stash call first, on the same (warm) machine"; exit 2; }
export PYTHONPATH=$site:$PWD
{
  echo "# gpu-check (lent machine) $(date -u +%FT%TZ) $(git rev-parse --short HEAD 2>/dev/null)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__)"
} | tee "$OUT/gpu_tests.txt"
# smoke.py (native and loopspec greedy equal) is left out: the GPU tests check the same.
# As make gpu-check: the tests marked gpu, the whole suite collected.
if [ "${2:-}" != decode-only ]; then
  timeout 200 python3 -m pytest -q -rA -m gpu tests -p no:cacheprovider 2>&1 | grep -v WARNING | tail -150 >> "$OUT/gpu_tests.txt"
  echo "tests rc=${PIPESTATUS[0]}" | tee -a "$OUT/gpu_tests.txt"
fi
# FlashAttention is not carried, but vLLM's selector still picks it for bf16 (then fails: "FlashAttention
# version not detected"); VLLM_ATTENTION_BACKEND is not read by 0.32, hence the argument.
# Each arm's line is printed as it ends, so a run cut off by the lease still says what it measured.
timeout 270 python3 benchmarks/gpu_decode.py --large-first --attention-backend TRITON_ATTN --repeats 2 --out "$OUT/gpu_check.json" 2>&1 \
  | grep -v WARNING | tee "$OUT/gpu_decode.txt" | tail -30
