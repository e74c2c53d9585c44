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
# shellcheck source=tests/gpu/payload.sh
source tests/gpu/payload.sh
payload_install "$out" "$payload" sglang || exit 1
payload_record "$out" torch sglang sglang-kernel triton transformers weightwire grpcio protobuf
python3 tests/gpu/sglang_moe_run.py --out "$out" "${@:3}" >"$out/run.log" 2>&1
rc=$?
grep -E '^\[sglang-moe\]|fused_moe|Error|error:' "$out/run.log" | tail -n 80
exit "$rc"
