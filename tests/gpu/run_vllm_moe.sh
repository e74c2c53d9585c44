#!/usr/bin/env bash
# Install the vLLM 0.26 MoE payload and run tests/gpu/vllm_moe_run.py (no package index needed).
#
#   tests/gpu/run_vllm_moe.sh OUTDIR [PAYLOAD [vllm_moe_run.py options: --only bf16|fp8, --eager]]
#
# PAYLOAD (default .vllm-moe) as tests/gpu/make_vllm_moe_payload.sh builds it: whl/ (the shared vllm-gpu
# recipe's wheels, with _moe_C kept for sm_90), stubs/, and ww/ (weightwire's wheel and the wheels the
# image lacks). Writes OUTDIR/hardware.txt, install.log, run.log and vllm_moe_gpu.json.
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${1:?usage: tests/gpu/run_vllm_moe.sh OUTDIR [PAYLOAD]}"
payload="${2:-.vllm-moe}"
mkdir -p "$out"
site="$(mktemp -d)/site"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
  "$payload"/whl/*.whl "$payload"/ww/*.whl >"$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
export PYTHONPATH="$site:$PWD/$payload/stubs" PYTHONUNBUFFERED=1
CUDA_HOME="$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")"
export CUDA_HOME
# As run_vllm_fp8.sh: no NVLink multicast, no flashinfer (its sampler import would end the engine core),
# no network.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 VLLM_USE_FLASHINFER_SAMPLER=0 \
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
{
  echo "date: $(date -u '+%Y-%m-%dT%H:%M:%SZ')"
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  # versions from the installed metadata (importing vllm here would cost ~10 s of a short device lease)
  python3 -c 'import sys, importlib.metadata as m; print("python", sys.version.split()[0], *(f"{p} {m.version(p)}" for p in ("torch", "vllm", "transformers", "weightwire", "grpcio", "protobuf")))'
  ls "$site"/vllm/_moe_C_stable_libtorch.abi3.so
} >"$out/hardware.txt" 2>&1
cat "$out/hardware.txt"
python3 tests/gpu/vllm_moe_run.py --out "$out" "${@:3}" >"$out/run.log" 2>&1
rc=$?
grep -E '^\[vllm-moe\]|MoE backend|Fp8 MoE|Error|error:' "$out/run.log" | tail -n 80
exit "$rc"
