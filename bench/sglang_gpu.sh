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
# shellcheck source=tests/gpu/payload.sh
source tests/gpu/payload.sh
payload_install "$out" "$payload" sglang || exit 1
payload_record "$out" torch sglang sglang-kernel transformers weightwire grpcio protobuf
python3 bench/sglang_gpu.py --out "$out" --reps "${REPS:-5}" --modes "${MODES:-direct}" >"$out/run.log" 2>&1
rc=$?
grep -E '^\[sglang-gpu\]|Error|error:' "$out/run.log" | tail -n 40
exit "$rc"
