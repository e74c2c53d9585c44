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
# shellcheck source=tests/gpu/payload.sh
source tests/gpu/payload.sh
payload_install "$out" "$payload" vllm || exit 1
payload_record "$out" torch vllm transformers weightwire grpcio protobuf
python3 tests/gpu/vllm_fp8_run.py --out "$out" >"$out/run.log" 2>&1
rc=$?
grep -E '^\[vllm-fp8\]|Selected .*Fp8|Error|error:' "$out/run.log" | tail -n 60
exit "$rc"
