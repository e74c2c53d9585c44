#!/usr/bin/env bash
# Run bench/sglang_gpu.py on a CUDA machine without a package index, and record what it ran on.
#
#   bench/sglang_gpu.sh OUTDIR [PAYLOAD]        (REPS=5, MODES=direct by default)
#
# PAYLOAD (default .sgl) holds whl/ and stubs/ as the shared sglang-gpu recipe's make_wheels.sh builds
# them (SGLang 0.5.17 with sglang-kernel 0.4.5 trimmed for sm_90 and the Triton attention backend, its
# missing dependencies, and flashinfer as an import-only stub), plus ww/: a wheel of weightwire
# (`pip wheel --no-deps .`) and the helper wheels the image lacks (grpcio-health-checking,
# grpcio-reflection, grpcio-status, googleapis-common-protos, prometheus-client, rich, markdown-it-py,
# mdurl). They go into a private folder put on PYTHONPATH, so the plugin loads by its entry point.
# Writes OUTDIR/hardware.txt, install.log, run.log and sglang_gpu.json.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: bench/sglang_gpu.sh OUTDIR [PAYLOAD]}"
payload="${2:-.sgl}"
mkdir -p "$out"
site="$(mktemp -d)/site"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
  "$payload"/whl/*.whl "$payload"/ww/*.whl >"$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
export PYTHONPATH="$site:$PWD/$payload/stubs" PYTHONUNBUFFERED=1
# flashinfer is an import-only stub; no NVLink multicast on these machines; no network.
export SGLANG_IS_FLASHINFER_AVAILABLE=false NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 DO_NOT_TRACK=1
{
  echo "date: $(date -u '+%Y-%m-%dT%H:%M:%SZ')"
  nvidia-smi --query-gpu=index,name,uuid,memory.total,driver_version --format=csv
  python3 -c 'import sys, torch, sglang, grpc, google.protobuf as pb, importlib.metadata as m; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "sglang", sglang.__version__, "weightwire", m.version("weightwire"), "grpcio", grpc.__version__, "protobuf", pb.__version__)'
} >"$out/hardware.txt" 2>&1
cat "$out/hardware.txt"
python3 bench/sglang_gpu.py --out "$out" --reps "${REPS:-5}" --modes "${MODES:-direct}" >"$out/run.log" 2>&1
rc=$?
grep -E '^\[sglang-gpu\]|Error|error:' "$out/run.log" | tail -n 40
exit "$rc"
