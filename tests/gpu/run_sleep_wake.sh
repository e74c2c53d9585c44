#!/usr/bin/env bash
# Install one engine's GPU payload and run tests/gpu/sleep_wake.py for it (no package index needed).
#
#   tests/gpu/run_sleep_wake.sh sglang|vllm OUTDIR
#
# Payloads, made on a machine with an index: SGLang 0.5.17 in .sgl/ (shared/tools/sglang-gpu/make_wheels.sh:
# whl/, stubs/), vLLM 0.26.0 in .vllm/ (shared/tools/vllm-gpu/make_wheels.sh), and .wwgpu/: a wheel of
# weightwire (`pip wheel --no-deps .`), the grpc helper wheels the image lacks (grpcio-health-checking,
# grpcio-reflection, grpcio-status 1.84.0, googleapis-common-protos) and, for SGLang, torch_memory_saver
# 0.0.10 (its CUDA 12 libraries dropped). Writes OUTDIR/install-<engine>.log, run-<engine>.log and
# sleep_wake-<engine>.json.
set -uo pipefail
cd "$(dirname "$0")/../.."
engine="${1:?usage: tests/gpu/run_sleep_wake.sh sglang|vllm OUTDIR}"
out="${2:?usage: tests/gpu/run_sleep_wake.sh sglang|vllm OUTDIR}"
payload=$([ "$engine" = sglang ] && echo .sgl || echo .vllm)
mkdir -p "$out"
site="$(mktemp -d)/site"
wheels=("$payload"/whl/*.whl .wwgpu/weightwire-*.whl .wwgpu/grpcio_*.whl .wwgpu/googleapis_*.whl)
[ "$engine" = sglang ] && wheels+=(.wwgpu/torch_memory_saver-*.whl)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "${wheels[@]}" \
  >"$out/install-$engine.log" 2>&1 || { cat "$out/install-$engine.log"; exit 1; }
export PYTHONPATH="$site:$PWD/$payload/stubs" PYTHONUNBUFFERED=1
CUDA_HOME="$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")"
export CUDA_HOME TVM_FFI_CACHE_DIR=/tmp/tvmffi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 VLLM_USE_FLASHINFER_SAMPLER=0 \
  SGLANG_IS_FLASHINFER_AVAILABLE=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
{
  echo "date: $(date -u '+%Y-%m-%dT%H:%M:%SZ')"
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  python3 -c "import sys, torch, grpc, google.protobuf as pb, importlib.metadata as m; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'grpcio', grpc.__version__, 'protobuf', pb.__version__, *[f'{d} {m.version(d)}' for d in ('$engine', 'weightwire', 'torch_memory_saver') if d != 'torch_memory_saver' or '$engine' == 'sglang'])"
} >"$out/hardware-$engine.txt" 2>&1
cat "$out/hardware-$engine.txt"
python3 tests/gpu/sleep_wake.py --engine "$engine" --out "$out" >"$out/run-$engine.log" 2>&1
rc=$?
grep -E '^\[sleep-wake\]|Error|error:' "$out/run-$engine.log" | tail -n 60
exit "$rc"
