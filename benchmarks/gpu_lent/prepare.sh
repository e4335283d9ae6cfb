#!/usr/bin/env bash
# Builds, on this (networked) machine, what a lent GPU machine needs to run
# vLLM 0.32's CUDA build: that machine's image has torch 2.11 (cu130) and no
# network, and one call carries at most 64 MiB. Writes .gpu/ (git-ignored):
#   .gpu/c/C.so.xz      vllm/_C_stable_libtorch (torch's stable ABI: every
#                       libtorch symbol it needs is in torch 2.11), ~54 MB
#   .gpu/d/whl/         vLLM's pure dependencies the image lacks (py3.12)
#   .gpu/d/vllm-py.tar.xz  vLLM's Python files, without the flash-attention,
#                       MoE and DeepGEMM extensions (TRITON_ATTN serves fp32)
# Then (benchmarks/gpu_lent/run.sh says how) two device calls, back to back.
set -euo pipefail
cd "$(dirname "$0")/../.."
here=benchmarks/gpu_lent
exclude="$(git rev-parse --git-dir)/info/exclude"
mkdir -p "$(dirname "$exclude")"
grep -qx '/.gpu/' "$exclude" 2>/dev/null || printf '/.gpu/\n/.gpu-site/\n' >> "$exclude"
build=$(mktemp -d)
mkdir -p .gpu/c .gpu/d/whl
pip_dl() {
  PIP_CONSTRAINT=/dev/null python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_31_x86_64 --platform manylinux1_x86_64 "$@"
}
pip_dl -d "$build" vllm==0.32.0
pip_dl -d .gpu/d/whl -r "$here/requirements.txt"
python3 - "$build" <<'PY'
import glob, io, lzma, sys, tarfile, zipfile
from pathlib import Path
wheel = zipfile.ZipFile(glob.glob(sys.argv[1] + "/vllm-0.32.0-*.whl")[0])
skip = (".so", "vllm-rs", ".hpp", ".h", ".cuh", ".cu", ".cpp")
with tarfile.open(".gpu/d/vllm-py.tar.xz", "w:xz") as tar:
    for info in wheel.infolist():
        if info.is_dir() or info.filename.endswith(skip):
            continue
        data = wheel.read(info)
        if info.filename == "vllm/vllm_flash_attn/__init__.py":
            # Without the FA extensions vLLM 0.32 raises at import, and CUDA
            # imports this module unconditionally: let FLASH_ATTN report
            # itself unsupported instead (the selector then takes TRITON_ATTN).
            data = data.replace(b"if not (FA2_AVAILABLE or FA3_AVAILABLE):", b"if False:  # gpu_lent: no FA extensions")
            assert b"gpu_lent" in data
        ti = tarfile.TarInfo(info.filename); ti.size = len(data)
        tar.addfile(ti, io.BytesIO(data))
Path(".gpu/c/C.so.xz").write_bytes(lzma.compress(wheel.read("vllm/_C_stable_libtorch.abi3.so"), preset=9))
PY
rm -rf "$build"
du -sb .gpu/c .gpu/d
echo "tracked files without benchmarks/results: $(git ls-files -z | grep -zv '^benchmarks/results/' | xargs -0 du -cb | tail -1 | cut -f1) bytes"
