#!/usr/bin/env bash
# Run bench/vllm_gpu.py on a CUDA machine without a package index: both modes (compiled + CUDA graphs,
# then enforce_eager), each in a fresh process, and record what it ran on.
#
#   bench/vllm_gpu.sh OUTDIR [PAYLOAD]        (REPS=5 by default)
#
# PAYLOAD (default .vllm) holds whl/ and stubs/ as the shared vllm-gpu recipe's make_wheels.sh builds
# them (vLLM 0.26.0 trimmed for sm_90 with the Triton attention backend, its missing dependencies, and
# import-only stubs), plus ww/: a wheel of weightwire (`pip wheel --no-deps .`) and the grpc helper wheels
# the image lacks (grpcio-health-checking, grpcio-reflection, grpcio-status, googleapis-common-protos).
# They go into a private folder put on PYTHONPATH, so weightwire's backend registers by its entry point.
# Writes OUTDIR/hardware.txt, install.log, run-<mode>.log and vllm_gpu-<mode>.json.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: bench/vllm_gpu.sh OUTDIR [PAYLOAD]}"
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
  nvidia-smi --query-gpu=index,name,uuid,memory.total,driver_version --format=csv
  python3 -c 'import sys, torch, vllm, grpc, google.protobuf as pb, weightwire, importlib.metadata as m; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "vllm", vllm.__version__, "weightwire", m.version("weightwire"), "grpcio", grpc.__version__, "protobuf", pb.__version__)'
} >"$out/hardware.txt" 2>&1
cat "$out/hardware.txt"
rc=0
for mode in compiled eager; do
  python3 bench/vllm_gpu.py --out "$out" --mode "$mode" --reps "${REPS:-5}" >"$out/run-$mode.log" 2>&1 || rc=$?
  grep -E '^\[vllm-gpu\]|Error|error:' "$out/run-$mode.log" | tail -n 40
done
exit "$rc"
