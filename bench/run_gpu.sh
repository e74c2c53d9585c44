#!/usr/bin/env bash
# Run the GPU benchmark on a CUDA machine whose python3 already has torch, and record what it ran on.
#
#   bench/run_gpu.sh [OUTDIR] [extra bench_gpu.py args...]
#
# Installs weightwire into python3 without touching its torch (wheels of missing pure-Python
# dependencies may be placed in ./wheels for machines without a package index). checkpoint-engine
# and its dependencies, if their wheels are in ./wheels/bench, go into a private folder put on
# PYTHONPATH for this run only; without them that baseline is skipped. Writes OUTDIR/hardware.txt,
# OUTDIR/gpu_results.json, OUTDIR/bench_gpu.log and OUTDIR/workers.log (the tail of every worker's
# log). With BENCH_CPU_BUDGET_S=N (N > 0) it also runs bench_cpu.py for at most N seconds there
# (extra arguments in BENCH_CPU_ARGS).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench/results/gpu-run}"
shift || true
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
scratch="$(mktemp -d)"

if compgen -G "wheels/*.whl" >/dev/null; then
  python3 -m pip install -q --no-deps --no-index --no-compile wheels/*.whl >"$out/install.log" 2>&1 || {
    cat "$out/install.log"; exit 1; }
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >>"$out/install.log" 2>&1 || {
  cat "$out/install.log"; exit 1; }
if compgen -G "wheels/bench/*.whl" >/dev/null; then
  if python3 -m pip install -q --no-deps --no-index --no-compile --target "$scratch/site" wheels/bench/*.whl \
      >>"$out/install.log" 2>&1; then
    export PYTHONPATH="$scratch/site${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "checkpoint-engine wheels did not install (see install.log); that baseline will be skipped"
  fi
fi

{
  echo "date: $(date -u '+%Y-%m-%dT%H:%M:%SZ')"
  nvidia-smi --query-gpu=index,name,uuid,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv
  nvidia-smi topo -m 2>/dev/null || true
  lscpu 2>/dev/null | grep -E '^(Model name|CPU\(s\)|Thread|Socket)' || true
  python3 -c 'import sys, torch, grpc, google.protobuf as pb; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "grpcio", grpc.__version__, "protobuf", pb.__version__)'
} >"$out/hardware.txt" 2>&1
cat "$out/hardware.txt"

python3 bench/bench_gpu.py --out "$out" --log-dir "$scratch/logs" "$@"
rc=$?

if [ "${BENCH_CPU_BUDGET_S:-0}" -gt 0 ]; then
  timeout "$((BENCH_CPU_BUDGET_S + 60))" python3 bench/bench_cpu.py --out "$out" --log-dir "$scratch/logs" \
    --budget-s "$BENCH_CPU_BUDGET_S" ${BENCH_CPU_ARGS:-} || echo "bench_cpu.py exited with $?"
fi

for f in "$scratch"/logs/worker-*.log; do
  [ -s "$f" ] && { echo "=== $(basename "$f")"; tail -n 30 "$f"; }
done >"$out/workers.log" 2>/dev/null
exit "$rc"
