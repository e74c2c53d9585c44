#!/usr/bin/env bash
# Build the vLLM 0.26 GPU payload for mixture-of-experts runs (tests/gpu/run_vllm_moe.sh) in .vllm-moe/.
#
#   VLLM_GPU_TOOLS=<the shared vllm-gpu recipe> [VLLM_WHL=<vllm-0.26.0 wheel>] tests/gpu/make_vllm_moe_payload.sh
#
# The shared recipe (its make_wheels.sh, README.md and fatbin_sm90.py; default: ../shared/tools/vllm-gpu
# beside this checkout) trims vLLM 0.26.0 for a dense model on sm_90 and drops _moe_C_stable_libtorch
# (47 MB: moe_align_block_size, topk_softmax, ... which every fused-MoE forward pass calls). This runs
# it unchanged in .vllm-moe/ and puts _moe_C back into the trimmed vllm wheel, stripped and with only
# its sm_90 device code (the recipe's fatbin_sm90.keep_sm90, as it does for _C), RECORD rewritten.
# Then .vllm-moe/ww/ gets weightwire's wheel and the wheels the GPU image lacks (taken from ./wheels/,
# downloaded there if absent): grpcio-health-checking/reflection/status 1.84.0, googleapis-common-protos,
# prometheus-client, rich, markdown-it-py, mdurl; compressed-tensors 0.17.0 and loguru 0.7.3 (vLLM's
# quantization-config lookup imports them, see run_vllm_fp8.sh). Fails if the whole is over 64 MiB.
# Add /.vllm-moe/ to .git/info/exclude.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
tools="$(cd "${VLLM_GPU_TOOLS:-$root/../shared/tools/vllm-gpu}" && pwd)"
out=.vllm-moe
mkdir -p "$out/dl" wheels
vw="$out/dl/vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl"
PL="--platform manylinux2014_x86_64"; for n in $(seq 17 39); do PL="$PL --platform manylinux_2_${n}_x86_64"; done
if [ -n "${VLLM_WHL:-}" ]; then cp "$VLLM_WHL" "$vw"; fi
# shellcheck disable=SC2086
[ -f "$vw" ] || python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp $PL -d "$out/dl" vllm==0.26.0
# The shared recipe, unchanged, with .vllm-moe/ as its working directory (it writes ./.vllm/).
(cd "$out" && VLLM_WHL="$root/$vw" bash "$tools/make_wheels.sh")
rm -rf "$out/whl" "$out/stubs"
mv "$out/.vllm/whl" "$out/whl"; mv "$out/.vllm/stubs" "$out/stubs"; rm -rf "$out/.vllm"
python3 - "$vw" "$out/whl" "$tools" <<'PY'
import base64, glob, hashlib, os, re, subprocess, sys, tempfile, zipfile
orig, whl_dir, tools = sys.argv[1:]
sys.path.insert(0, tools)
from fatbin_sm90 import keep_sm90
MOE = "vllm/_moe_C_stable_libtorch.abi3.so"
(trimmed,) = glob.glob(os.path.join(whl_dir, "vllm-0.26.0-*.whl"))
with zipfile.ZipFile(orig) as z:
    info, data = z.getinfo(MOE), z.read(MOE)
with tempfile.NamedTemporaryFile(delete=False, suffix=".so") as t:
    t.write(data)
subprocess.run(["strip", "--strip-unneeded", t.name], check=True)
stripped = open(t.name, "rb").read(); os.unlink(t.name)
pruned, before, after = keep_sm90(stripped, keep_ptx=os.environ.get("SM90_KEEP_PTX") == "1")
print(f"  {MOE}: {len(data)/2**20:.1f} MiB -> {len(stripped)/2**20:.1f} stripped; device code "
      f"{before/2**20:.1f} -> {after/2**20:.1f} MiB (sm_90 only)")
digest = base64.urlsafe_b64encode(hashlib.sha256(pruned).digest()).rstrip(b"=").decode()
# With _moe_C the payload, weightwire and this checkout come to just over 64 MiB; so the wheel is stored
# with LZMA (zip method 14, which pip reads through Python's zipfile) instead of deflate, and three parts
# nothing on this path imports are left out: vllm.benchmarks (the `vllm bench` CLI), third_party/tml_fa4
# (Blackwell attention, imported only by one model's ops, lazily) and a picture. (Not model packages:
# vllm.models.deepseek_v4 and minimax_m3 are imported at every engine start, by the quantization-config
# lookup and the kernel warm-up.)
SKIP = re.compile(r"^vllm/(third_party/tml_fa4/.*|benchmarks/.*|distributed/kv_transfer/disagg_prefill_workflow\.jpg)$")
tmp = trimmed + ".tmp"
with zipfile.ZipFile(trimmed) as zi, zipfile.ZipFile(tmp, "w", zipfile.ZIP_LZMA) as zo:
    for i in zi.infolist():
        if SKIP.match(i.filename):
            continue
        body = zi.read(i)
        if i.filename.endswith(".dist-info/RECORD"):
            assert MOE not in body.decode()
            body = b"".join(l for l in body.splitlines(True) if not SKIP.match(l.decode().split(",")[0]))
            body += f"{MOE},sha256={digest},{len(pruned)}\n".encode()
        i.compress_type = zipfile.ZIP_LZMA
        zo.writestr(i, body)
    info.compress_type = zipfile.ZIP_LZMA
    zo.writestr(info, pruned)
os.replace(tmp, trimmed)
print(f"  {os.path.basename(trimmed)}: {os.path.getsize(trimmed)/2**20:.1f} MiB with _moe_C")
PY
rm -rf "$out/ww"; mkdir -p "$out/ww"
python3 -m pip wheel -q --no-deps -w "$out/ww" . >/dev/null
EXTRA="grpcio-health-checking==1.84.0 grpcio-reflection==1.84.0 grpcio-status==1.84.0 googleapis-common-protos
 prometheus-client rich markdown-it-py mdurl compressed-tensors==0.17.0 loguru==0.7.3"
for p in $EXTRA; do
  n=$(echo "${p%%==*}" | tr - _)
  ls wheels/"$n"-* >/dev/null 2>&1 || python3 -m pip download -q --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp -d wheels "$p"
  cp wheels/"$n"-*.whl "$out/ww/"
done
total=$(du -cb "$out"/whl/*.whl "$out"/ww/*.whl "$out/stubs" | tail -1 | cut -f1)
echo "payload (whl + ww + stubs): $total bytes = $((total / 1048576)) MiB"
[ "$total" -le $((64 * 1048576)) ] || { echo "payload over 64 MiB" >&2; exit 1; }
