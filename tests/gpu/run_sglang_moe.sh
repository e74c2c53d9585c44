#!/usr/bin/env bash
# Install the shared SGLang payload and run tests/gpu/sglang_moe_run.py (no package index needed).
#
#   tests/gpu/run_sglang_moe.sh OUTDIR [PAYLOAD [sglang_moe_run.py options: --only bf16|fp8|slices, --eager]]
#
# PAYLOAD (default .sgl) as for bench/sglang_gpu.sh: whl/ (the shared sglang-gpu recipe's wheels: SGLang
# 0.5.17 with sglang-kernel 0.4.5 trimmed for sm_90 and the Triton attention backend, flashinfer an
# import-only stub), stubs/, and ww/ (weightwire's wheel and the helper wheels the image lacks). They go
# into a private folder put on PYTHONPATH, so the plugin loads by its entry point; the trainer ranks of
# the slices half inherit it. Writes OUTDIR/hardware.txt, install.log, run.log and sglang_moe_gpu.json.
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${1:?usage: tests/gpu/run_sglang_moe.sh OUTDIR [PAYLOAD]}"
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
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  # versions from the installed metadata (importing sglang here would cost seconds of a short device lease)
  python3 -c 'import sys, importlib.metadata as m; print("python", sys.version.split()[0], *(f"{p} {m.version(p)}" for p in ("torch", "sglang", "sglang-kernel", "triton", "transformers", "weightwire", "grpcio", "protobuf")))'
} >"$out/hardware.txt" 2>&1
cat "$out/hardware.txt"
python3 tests/gpu/sglang_moe_run.py --out "$out" "${@:3}" >"$out/run.log" 2>&1
rc=$?
grep -E '^\[sglang-moe\]|fused_moe|Error|error:' "$out/run.log" | tail -n 80
exit "$rc"
