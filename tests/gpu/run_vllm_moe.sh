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
# shellcheck source=tests/gpu/payload.sh
source tests/gpu/payload.sh
payload_install "$out" "$payload" vllm || exit 1
payload_record "$out" torch vllm transformers weightwire grpcio protobuf
ls "$PAYLOAD_SITE"/vllm/_moe_C_stable_libtorch.abi3.so | tee -a "$out/hardware.txt"
python3 tests/gpu/vllm_moe_run.py --out "$out" "${@:3}" >"$out/run.log" 2>&1
rc=$?
grep -E '^\[vllm-moe\]|MoE backend|Fp8 MoE|Error|error:' "$out/run.log" | tail -n 80
exit "$rc"
