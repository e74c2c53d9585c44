#!/usr/bin/env bash
# Run the GPU suite on a CUDA machine whose Python already has torch, and record what it ran on.
#
#   tests/gpu/run_suite.sh [OUTDIR] [extra pytest args...]
#
# Installs weightwire into the current python3 without touching its torch (wheels of missing pure-
# Python dependencies may be placed in ./wheels for machines without a package index), then writes
# OUTDIR/hardware.txt (date, nvidia-smi, versions), OUTDIR/junit.xml and OUTDIR/pytest.log.
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${1:-gpu-results}"
shift || true
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

if compgen -G "wheels/*.whl" >/dev/null; then
  python3 -m pip install -q --no-deps --no-index --no-compile wheels/*.whl || exit 1
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$out/install.log" 2>&1 || {
  cat "$out/install.log"; exit 1; }

{
  echo "date: $(date -u '+%Y-%m-%dT%H:%M:%SZ')"
  nvidia-smi --query-gpu=index,name,uuid,memory.total,driver_version --format=csv
  nvidia-smi topo -m 2>/dev/null || true
  python3 -c 'import sys, torch, grpc, google.protobuf as pb; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "grpcio", grpc.__version__, "protobuf", pb.__version__)'
} >"$out/hardware.txt" 2>&1
cat "$out/hardware.txt"

python3 -m pytest -m "gpu or gpu2 or gpu4 or gpu8" tests/gpu -p no:cacheprovider -v -rA \
  --junitxml="$out/junit.xml" "$@" 2>&1 | tee "$out/pytest.log"
exit "${PIPESTATUS[0]}"
