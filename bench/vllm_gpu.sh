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
# shellcheck source=tests/gpu/payload.sh
source tests/gpu/payload.sh
payload_install "$out" "$payload" vllm || exit 1
payload_record "$out" torch vllm transformers weightwire grpcio protobuf
rc=0
for mode in compiled eager; do
  python3 bench/vllm_gpu.py --out "$out" --mode "$mode" --reps "${REPS:-5}" >"$out/run-$mode.log" 2>&1 || rc=$?
  grep -E '^\[vllm-gpu\]|Error|error:' "$out/run-$mode.log" | tail -n 40
done
exit "$rc"
