#!/usr/bin/env bash
# Install the shared vLLM 0.26 GPU payload and run tests/gpu/vllm_fp8_run.py (no package index needed).
#
#   tests/gpu/run_vllm_fp8.sh OUTDIR [PAYLOAD]
#
# PAYLOAD (default .vllm) holds whl/ and stubs/ as the shared vllm-gpu recipe's make_wheels.sh builds them
# (vLLM 0.26.0 trimmed for sm_90 with the Triton attention backend; DeepGEMM dropped, so vLLM's block-FP8
# GEMM is its CUTLASS sm_90 kernel, kept in _C) plus ww/: a wheel of weightwire (`pip wheel --no-deps .`)
# and the wheels the image lacks (grpcio-health-checking, grpcio-reflection, grpcio-status 1.84.0,
# googleapis-common-protos, prometheus-client) and, for FP8, compressed-tensors 0.17.0 and loguru 0.7.3:
# the shared payload leaves them out (a dense model never imports them), but vLLM's lookup of any
# quantization config imports every method's module, and some import compressed_tensors.
# Writes OUTDIR/hardware.txt, install.log, run.log and vllm_fp8_gpu.json.
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${1:?usage: tests/gpu/run_vllm_fp8.sh OUTDIR [PAYLOAD]}"
payload="${2:-.vllm}"
mkdir -p "$out"
site="$(mktemp -d)/site"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
  "$payload"/whl/*.whl "$payload"/ww/*.whl >"$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
export PYTHONPATH="$site:$PWD/$payload/stubs" PYTHONUNBUFFERED=1
CUDA_HOME="$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")"
export CUDA_HOME
# No NVLink multicast on these machines; flashinfer is not in the payload (its sampler import would
# end the engine core); no network.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 VLLM_USE_FLASHINFER_SAMPLER=0 \
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
{
  echo "date: $(date -u '+%Y-%m-%dT%H:%M:%SZ')"
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  python3 -c 'import sys, torch, vllm, grpc, google.protobuf as pb, importlib.metadata as m; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "vllm", vllm.__version__, "weightwire", m.version("weightwire"), "grpcio", grpc.__version__, "protobuf", pb.__version__)'
} >"$out/hardware.txt" 2>&1
cat "$out/hardware.txt"
python3 tests/gpu/vllm_fp8_run.py --out "$out" >"$out/run.log" 2>&1
rc=$?
grep -E '^\[vllm-fp8\]|Selected .*Fp8|Error|error:' "$out/run.log" | tail -n 60
exit "$rc"
