#!/usr/bin/env bash
# Issue 37 on one GPU: the fresh-tensor rows (and the rows they are measured against) in one run.
#
#   bench/run_issue37.sh OUTDIR [BUDGET_S]
#
# 1. the GPU tests of the fresh-tensor pool, of parameters exported where they live, and of storage
#    sets sent by name (tests/gpu/test_colocated.py);
# 2. bench_gpu.py on Qwen3-8B and Qwen3-1.7B shapes: the limit (per-tensor and flat copies in one
#    process), the README's push of kept parameters (named_parameters(), a kept list, and
#    named_parameters() with its storage set sent whole every push, as before storage_set_id),
#    every parameter in a new storage before each push (ww_fresh:new storages) and the producer
#    writing into tensor_buffers (ww_fresh:tensor_buffers), medians of 10 warm pushes;
# 3. fsdp_gpu.py: push(fsdp_model.state_dict()) from one FSDP2 rank against the plain push.
# Files: OUTDIR/{pytest.log,pytest-colocated.log,hardware.txt,gpu_results.json,bench_gpu.log,workers.log,fsdp.json,fsdp.log}.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:?OUTDIR}"
budget="${2:-150}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# Pure-Python dependencies the GPU image lacks, as wheels in ./wheels (grpcio-status and friends).
if compgen -G "wheels/*.whl" >/dev/null; then
  python3 -m pip install -q --no-deps --no-index --no-compile wheels/*.whl >/dev/null 2>&1 || exit 1
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1 || exit 1
timeout 200 python3 -m pytest -m gpu tests/gpu/test_fresh_pool_gpu.py tests/gpu/test_param_export.py -k "not expandable" \
  -p no:cacheprovider -q -rA -x >"$out/pytest.log" 2>&1
echo "pytest rc=$?"; tail -n 5 "$out/pytest.log"
timeout 300 python3 -m pytest -m gpu tests/gpu/test_colocated.py -k "storage_set or reuses_handles or no_leak or restarted" \
  -p no:cacheprovider -q -rA >"$out/pytest-colocated.log" 2>&1
echo "pytest colocated rc=$?"; tail -n 5 "$out/pytest-colocated.log"
timeout $((budget + 120)) bench/run_gpu.sh "$out" --models qwen3-8b,qwen3-1.7b \
  --cases "limit,ww_params:named_parameters,ww_params:kept list,ww_params:storages sent,ww_fresh" \
  --reps 10 --limit-reps 10 \
  --no-peer --inplace-buckets "" --packed-buckets 1GiB --budget-s "$budget" >/dev/null 2>&1
echo "bench rc=$?"; grep -E "done|ERROR" "$out/bench_gpu.log"
rm -f "$out/install.log"
timeout 200 python3 bench/fsdp_gpu.py --out "$out" --reps 8 >"$out/fsdp.log" 2>&1
echo "fsdp rc=$?"; tail -n 3 "$out/fsdp.log"
