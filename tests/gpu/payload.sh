# Sourced by the GPU run scripts (tests/gpu/run_*.sh, bench/*_gpu.sh), from the repository root, on a
# CUDA machine without a package index.
#
#   payload_install OUTDIR PAYLOAD sglang|vllm
#       installs PAYLOAD/whl/*.whl and PAYLOAD/ww/*.whl into a private folder put on PYTHONPATH (with
#       PAYLOAD/stubs), so weightwire's plugin or backend loads by its entry point in every process the
#       script starts; sets the engine's environment; the pip log goes to OUTDIR/install.log.
#   payload_record OUTDIR PACKAGE...
#       writes and prints OUTDIR/hardware.txt: the date, the GPUs, Python and the packages' versions
#       from their installed metadata (importing an engine here would cost seconds of a short lease).
payload_install() {
  local out="$1" payload="$2" engine="$3" site
  site="$(mktemp -d)/site"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
    "$payload"/whl/*.whl "$payload"/ww/*.whl >"$out/install.log" 2>&1 || { cat "$out/install.log"; return 1; }
  export PAYLOAD_SITE="$site" PYTHONPATH="$site:$PWD/$payload/stubs" PYTHONUNBUFFERED=1
  # No NVLink multicast on these machines; no network.
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 DO_NOT_TRACK=1
  case "$engine" in
    # flashinfer is an import-only stub in the SGLang payload.
    sglang) export SGLANG_IS_FLASHINFER_AVAILABLE=false ;;
    # flashinfer is not in the vLLM payload (its sampler import would end the engine core); vLLM's
    # compiles look for the CUDA toolkit beside nvcc.
    vllm)
      CUDA_HOME="$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")"
      export CUDA_HOME VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1
      ;;
    *) echo "payload_install: engine must be sglang or vllm, not '$engine'" >&2; return 2 ;;
  esac
}

payload_record() {
  local out="$1"
  shift
  {
    echo "date: $(date -u '+%Y-%m-%dT%H:%M:%SZ')"
    nvidia-smi --query-gpu=index,name,uuid,memory.total,driver_version --format=csv
    python3 -c 'import sys, importlib.metadata as m; print("python", sys.version.split()[0], *(f"{p} {m.version(p)}" for p in sys.argv[1:]))' "$@"
  } >"$out/hardware.txt" 2>&1
  cat "$out/hardware.txt"
}
