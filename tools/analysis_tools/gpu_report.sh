#!/usr/bin/env bash
# The GPU measurements of docs/benchmarks.md ("Measured on a GPU") in one go: each part
# under its own time limit, every output in one folder, so that a short time on a GPU
# machine (often without network access and without OpenMMLab) gives every figure.
#
#   bash tools/analysis_tools/gpu_report.sh wheels DIR
#       On a machine with network access: downloads into DIR what the measurements need
#       beyond torch, triton, timm, numpy, scipy, matplotlib, opencv and einops (which the
#       GPU machine is taken to have), for its Python
#       (GPU_PYTHON, default 3.12; the versions pinned in tools/install_env.sh): mmengine,
#       mmdet, mmsegmentation and their small dependencies, and builds mmcv as a pure
#       wheel without its compiled ops (MMCV_WITH_OPS=0; the backbones call none).
#   bash tools/analysis_tools/gpu_report.sh run OUT PART [PART ...]
#       On the GPU machine, from the repository root: runs the parts in order, PART.log
#       and the tools' result files in OUT, one line per part in OUT/summary.txt.
#       FLATTEN_MM_WHEELS=DIR first installs DIR's wheels into a folder of its own
#       (FLATTEN_MM_SITE, default $TMPDIR/flatten_mm_site) put on PYTHONPATH.
#       RELEASE_DIR: a checkout of LeapLabTHU/FLatten-Transformer (part timm).
#       PART_TIMEOUT: seconds per part (default 300; 540 for compile and bbc);
#       PYTHON (default python3). Exits 1 if a part failed or ran out of time.
#       FLATTEN_MM_REPORT_DEVICE=cpu runs every part on the CPU at tiny sizes, to find
#       a typo before a GPU is spent on it.
#
# Parts: env tests fuzz core bb kernels bound bbc prof timm compile sweep (see part_* below).
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${PYTHON:-python3}
TOOLS=$ROOT/tools/analysis_tools
PARTS=(env tests fuzz core bb kernels bound bbc prof timm compile sweep)
PAIRS=(flatten-swin-t swin-t flatten-pvt-t pvt-t flatten-pvtv2-b1 pvtv2-b1
       flatten-cswin-t cswin-t)

# the version pinned in tools/install_env.sh, e.g. pin MMDET -> 3.3.0
pin() { sed -n "s/^$1_VERSION=\([^ ]*\).*/\1/p" "$ROOT/tools/install_env.sh"; }

wheels() {
  local dir=$1 pyver=${GPU_PYTHON:-3.12} build
  mkdir -p "$dir" || return 1
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" \
    --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dir" "mmengine==$(pin MMENGINE)" \
    "mmdet==$(pin MMDET)" "mmsegmentation==$(pin MMSEG)" "pycocotools==$(pin PYCOCOTOOLS)" \
    addict yapf termcolor terminaltables platformdirs shapely ftfy regex wcwidth \
    rich markdown-it-py mdurl pygments pyyaml prettytable || return 1
  # mmcv is a source release; without compiled ops its wheel is pure, named mmcv-lite,
  # so pip cannot build it by the name mmcv: from the unpacked source instead (its
  # setup.py imports torch, which PYTHON must have)
  build=$(mktemp -d)
  "$PY" -m pip download -q --no-deps --no-build-isolation --no-binary :all: \
    "mmcv==$(pin MMCV)" -d "$build" &&
    tar -xzf "$build"/mmcv-*.tar.gz -C "$build" &&
    (cd "$build"/mmcv-*/ && MMCV_WITH_OPS=0 "$PY" -m pip wheel -q --no-build-isolation \
      --no-deps . -w "$dir") || { rm -rf "$build"; return 1; }
  rm -rf "$build"
  ls "$dir"
}

# Installs FLATTEN_MM_WHEELS into FLATTEN_MM_SITE once, and puts it on PYTHONPATH.
use_wheels() {
  local site=${FLATTEN_MM_SITE:-${TMPDIR:-/tmp}/flatten_mm_site}
  if [ ! -f "$site/.installed" ]; then
    "$PY" -m pip install -q --no-index --no-deps --target "$site" \
      "$FLATTEN_MM_WHEELS"/*.whl || return 1
    # mmdet imports names from mmcv's compiled module when it is imported; without the
    # ops they exist and raise when called (no backbone calls one)
    [ -e "$site/mmcv/_ext.py" ] || cat > "$site/mmcv/_ext.py" <<'PYEOF'
def __getattr__(name):
    def missing(*args, **kwargs):
        raise RuntimeError(f'mmcv was built without its compiled ops: {name} is not there')
    return missing
PYEOF
    touch "$site/.installed"
  fi
  export PYTHONPATH=$site:$ROOT${PYTHONPATH:+:$PYTHONPATH}
  "$PY" -c 'import mmengine, mmcv, mmdet.models.backbones, flatten_mm' ||
    { echo "mmdet's backbones do not import with $site on PYTHONPATH" >&2; return 1; }
}

# Sizes and step counts: real ones on a GPU, tiny ones for FLATTEN_MM_REPORT_DEVICE=cpu.
settings() {
  DEV=${FLATTEN_MM_REPORT_DEVICE:-cuda}
  if [ "$DEV" = cpu ]; then
    SIZE=64x96 SIZE2=64x80 BATCH=1 CORE_BATCH=1 ITERS=1 WARMUP=1 TIMM_BATCH=2
    CASES=(16x20x32x1 8x10x64x2) THREADS=(--threads 2) COMPILED=(flatten-pvt-t pvt-t)
    TILINGS=('' warps=4,bwd_block=32) FUZZ_SECONDS=10
    export TRITON_INTERPRET=1  # the Triton kernels on the CPU
  else
    SIZE=800x1333 SIZE2=800x1216 BATCH=8 CORE_BATCH=16 ITERS=8 WARMUP=3 TIMM_BATCH=64
    CASES=(200x334x96x3 100x167x192x6) THREADS=() COMPILED=("${PAIRS[@]}")
    TILINGS=('' warps=4,bwd_block=32 block=64,bwd_block=32 per_sm=8 warps=8) FUZZ_SECONDS=120
  fi
}

bench() {  # benchmark_backbone.py with this device's settings, then the given arguments
  "$PY" "$TOOLS/benchmark_backbone.py" --device "$DEV" --batch "$BATCH" "${THREADS[@]}" \
    --rounds 1 --iters "$ITERS" --warmup "$WARMUP" --paired "$@"
}

core() {  # benchmark_attention.py, training step; $1: dtype, then more arguments
  local dtype=$1
  shift
  "$PY" "$TOOLS/benchmark_attention.py" --device "$DEV" --dtype "$dtype" \
    --batch "$CORE_BATCH" --repeats "$((ITERS + 2))" --warmup "$WARMUP" --mode fwdbwd \
    --cases "${CASES[@]}" "$@"
}

part_env() {
  command -v nvidia-smi >/dev/null && nvidia-smi
  "$PY" -c 'import sys, torch, triton, timm, mmdet.models.backbones, mmengine, flatten_mm
print(sys.version)
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__,
      "timm", timm.__version__, "mmdet", mmdet.__version__, "mmengine", mmengine.__version__)
print("device", torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
if torch.cuda.is_available():  # the path the kernels take on this GPU
    from flatten_mm.models.ops import triton_backend as tb
    cap = torch.cuda.get_device_capability()
    print("capability", cap, "auto takes the Triton ops", tb.gpu_supported(None),
          "one-head query backward fused", tb.kernels().fuses_query_passes(cap))'
}

part_tests() {  # the CUDA tests (they skip without CUDA) and the Triton kernels' tests
  (cd "$ROOT" && "$PY" -m pytest -q -p no:cacheprovider tests/models/ops \
    tests/models/test_tooling.py tests/models/test_designs.py \
    tests/models/backbones/test_stale_caches.py -k "cuda or triton" \
    --junitxml "$OUT/tests.xml")
}

part_fuzz() {  # random backbones, sizes and modes on this device against float64 on the CPU;
  # then FLatten-Swin-T and -PVT-T trained at the benchmarks' size (bf16 autocast, fp32)
  local rc=0
  "$PY" "$TOOLS/fuzz_backbones.py" --device "$DEV" --seconds "$FUZZ_SECONDS" --seed 1 || rc=1
  "$PY" "$TOOLS/fuzz_backbones.py" --device "$DEV" --arch swin:tiny --size "$SIZE" \
    --precision bf16 || rc=1
  "$PY" "$TOOLS/fuzz_backbones.py" --device "$DEV" --arch pvt:tiny --size "$SIZE" \
    --precision fp32 || rc=1
  return $rc
}

part_core() {  # the core against the reference; the fused DWC against cuDNN's conv; the
  # attention and its DWC as one op against two
  core bf16 --variants reference fast-torch fast-triton fast-conv2d two-ops \
    --out "$OUT/core_bf16.json" &&
    core fp32 --variants reference fast-torch fast-triton --out "$OUT/core_fp32.json"
}

# bench for each group of N models in turn ($1: N, $2: the results' folder, then the
# models, then -- and bench's other arguments): a paired run keeps every model's worker
# and its memory alive, and eight backbones' peaks at batch 8, 800x1333 exceed one GPU's
groups() {
  local n=$1 out=$2 models=() rc=0 i
  shift 2
  while [ "$1" != -- ]; do models+=("$1"); shift; done
  shift
  for ((i = 0; i < ${#models[@]}; i += n)); do
    bench --models "${models[@]:i:n}" "$@" --out-dir "$out/${models[i]}" || rc=1
  done
  return $rc
}

part_bb() {  # every family against its softmax form, eager
  groups 2 "$OUT/bb" "${PAIRS[@]}" -- --sizes "$SIZE" --modes fwd fwdbwd --dtypes bf16 fp32
}

part_kernels() {  # what the Triton kernels give each whole step: against the torch backend
  groups 2 "$OUT/kernels" flatten-swin-t flatten-swin-t@torch flatten-pvt-t flatten-pvt-t@torch \
    flatten-pvtv2-b1 flatten-pvtv2-b1@torch flatten-cswin-t flatten-cswin-t@torch \
    -- --sizes "$SIZE" --modes fwd fwdbwd --dtypes bf16
}

part_bound() {  # a free attention core, what no faster core can beat, beside softmax
  groups 3 "$OUT/bound" flatten-swin-t flatten-swin-t@identity swin-t flatten-pvt-t \
    flatten-pvt-t@identity pvt-t flatten-cswin-t flatten-cswin-t@identity cswin-t \
    -- --sizes "$SIZE" --modes fwdbwd --dtypes bf16
}

part_bbc() {  # compiled against compiled
  groups 2 "$OUT/bbc" "${COMPILED[@]}" -- --compile --sizes "$SIZE" --modes fwdbwd \
    --dtypes bf16
}

part_prof() {
  "$PY" "$TOOLS/profile_backbone.py" --device "$DEV" --dtype bf16 --batch "$BATCH" \
    --models flatten-swin-t swin-t flatten-pvt-t pvt-t --size "$SIZE" --mode fwdbwd \
    --iters 3 --out "$OUT/profile.json"
}

part_timm() {  # ImageNet size, against timm's softmax models and the authors' release
  local models=(timm:flatten_swin_tiny timm:swin_tiny_patch4_window7_224 timm:flatten_pvt_tiny
                timm:flatten_pvt_v2_b1 timm:pvt_v2_b1) release=()
  if [ -n "${RELEASE_DIR:-}" ]; then
    release=(--release-dir "$RELEASE_DIR")
    models+=(release:flatten_swin_tiny release:flatten_pvt_tiny release:flatten_pvt_v2_b1)
  fi
  BATCH=$TIMM_BATCH bench "${release[@]}" --models "${models[@]}" --sizes 224 \
    --modes fwd fwdbwd --dtypes bf16 --out-dir "$OUT/timm"
}

part_compile() {  # graphs, breaks and recompiles at two sizes, and errors against eager
  "$PY" "$TOOLS/check_compile.py" --device "$DEV" --dtype bf16 --batch 2 --iters 3 \
    --models $(printf '%s\n' "${COMPILED[@]}" | grep flatten) --sizes "$SIZE" "$SIZE2" \
    --out "$OUT/compile.json"
}

part_sweep() {  # other tilings of the Triton kernels (docs/design.md, "Tiling sweeps")
  local tiling
  for tiling in "${TILINGS[@]}"; do
    echo "== tiling '${tiling:-default}'"
    FLATTEN_MM_TRITON_TILING=$tiling core bf16 --variants fast-triton \
      --out "$OUT/sweep_${tiling:-default}.json" || return 1
  done
}

run() {
  OUT=$(mkdir -p "$1" && CDPATH='' cd "$1" && pwd) || exit 1
  shift
  [ $# -gt 0 ] || set -- "${PARTS[@]}"
  for part in "$@"; do
    [[ " ${PARTS[*]} " == *" $part "* ]] ||
      { echo "unknown part '$part'; the parts are: ${PARTS[*]}" >&2; exit 2; }
  done
  if [ -n "${FLATTEN_MM_WHEELS:-}" ]; then
    use_wheels || { echo "installing $FLATTEN_MM_WHEELS failed" >&2; exit 1; }
  else
    export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
  fi
  settings
  export OUT DEV SIZE SIZE2 BATCH CORE_BATCH ITERS WARMUP TIMM_BATCH FUZZ_SECONDS
  local start rc limit failed=0
  echo "# $(date -u '+%F %T') on $DEV: $*" >> "$OUT/summary.txt"
  for part in "$@"; do
    start=$SECONDS
    limit=${PART_TIMEOUT:-300}
    [[ -z ${PART_TIMEOUT:-} && $part =~ ^(compile|bbc)$ ]] && limit=540
    # a function in a child bash, so that timeout can stop it with all it started
    timeout -k 10 "$limit" bash -uo pipefail -c "$(declare -f; declare -p CASES THREADS \
      COMPILED TILINGS PAIRS TOOLS PY ROOT); part_$part" > "$OUT/$part.log" 2>&1
    rc=$?
    [ $rc = 0 ] || failed=1
    [[ $rc =~ ^(124|137)$ ]] && rc="$rc (over ${limit} s)"
    printf '%-8s rc=%-3s %4d s\n' "$part" "$rc" "$((SECONDS - start))" | tee -a "$OUT/summary.txt"
  done
  return $failed
}

case "${1:-}" in
  wheels) [ $# -eq 2 ] || { echo "usage: $0 wheels DIR" >&2; exit 2; }; wheels "$2" ;;
  run) [ $# -ge 2 ] || { echo "usage: $0 run OUT [PART ...]" >&2; exit 2; }; shift; run "$@" ;;
  *) sed -n '2,/^set /{/^#/p}' "$0" >&2; exit 2 ;;  # the header comment: the usage
esac
