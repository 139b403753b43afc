#!/usr/bin/env bash
# Creates .venv in the repository root with the OpenMMLab stack flatten_mm supports.
# Idempotent: a second run only checks a stamp and returns.
# All version pins live here.
set -euo pipefail

PYTHON=${PYTHON:-python3}
TORCH_VERSION=2.14.1
TORCHVISION_VERSION=0.29.1
MMENGINE_VERSION=0.10.7
MMCV_VERSION=2.1.0
MMDET_VERSION=3.3.0
MMSEG_VERSION=1.2.2
MMPRETRAIN_VERSION=1.2.0  # ImageNet pretraining configs
TIMM_VERSION=1.0.31
NUMPY_VERSION=2.4.6
PYCOCOTOOLS_VERSION=2.0.11
OPENMIM_VERSION=0.3.9
ONNX_VERSION=1.23.2  # ONNX export tests: onnx, onnxscript (torch's exporter), onnxruntime
ONNXSCRIPT_VERSION=0.7.2
ONNXRUNTIME_VERSION=1.32.0
PYTEST_XDIST_VERSION=3.8.0  # make test runs the suite in parallel workers
# torch 2.14 requires setuptools >= 77.0.3; mmcv's build needs pkg_resources and
# `setup.py develop` must stay an egg-link install for mim (setuptools 80 turned it
# into a PEP 660 one): 79.0.1 meets all three. With setuptools < 77 beside it pip
# quietly swaps torch for 2.12.1.
SETUPTOOLS_VERSION=79.0.1

ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=$ROOT/.venv
PIP="pip_quiet"
# pip, without the notes about this machine's local indexes, setuptools' banners
# and the complaint about openmim's dependency left out on purpose (below)
pip_quiet() {
  "$VENV/bin/python" -m pip "$@" 2> >(grep -v -e 'is ignored: it is neither' -e 'BuildBackendWarning' \
    -e 'dependency resolver does not currently take' -e 'source of the following dependency conflicts' \
    -e 'openmim 0.3.9 requires opendatalab' >&2)
}
export PIP_NO_WARN_SCRIPT_LOCATION=1
STAMP=$VENV/.flatten_mm-install
MMCV_STAMP=$VENV/.flatten_mm-mmcv  # the wheel folder mmcv was installed from
CACHE=${FLATTEN_MM_CACHE:-$HOME/.cache/flatten_mm}

log() { printf '[install] %s\n' "$*"; }

# package -> pinned version; every pip call below is constrained by these, and the
# installed versions are checked against them at the end and on every later run
PINS=(torch=$TORCH_VERSION torchvision=$TORCHVISION_VERSION numpy=$NUMPY_VERSION
      setuptools=$SETUPTOOLS_VERSION mmengine=$MMENGINE_VERSION mmcv=$MMCV_VERSION
      mmdet=$MMDET_VERSION mmsegmentation=$MMSEG_VERSION mmpretrain=$MMPRETRAIN_VERSION
      timm=$TIMM_VERSION
      pycocotools=$PYCOCOTOOLS_VERSION openmim=$OPENMIM_VERSION onnx=$ONNX_VERSION
      onnxscript=$ONNXSCRIPT_VERSION onnxruntime=$ONNXRUNTIME_VERSION
      pytest-xdist=$PYTEST_XDIST_VERSION)

# Prints "name installed-version" for every pin that does not hold; silent when all hold.
check_pins() {
  "$VENV/bin/python" - "${PINS[@]}" <<'PYEOF'
import sys
from importlib.metadata import PackageNotFoundError, version
for pin in sys.argv[1:]:
    name, want = pin.split('=')
    try:
        have = version(name)
    except PackageNotFoundError:
        have = 'missing'
    if have.split('+')[0] != want:  # a local tag (+cu130, +cpu) is the same release
        print(name, have, want)
PYEOF
}

# Logs each pin that does not hold; fails if any does not.
report_pins() {
  local bad
  bad=$(check_pins)
  [ -z "$bad" ] && return 0
  while read -r name have want; do
    log "ERROR: $name is $have, but $want is pinned"
  done <<< "$bad"
  log "something replaced a pinned package; start over with: make clean-venv && make install"
  return 1
}

# Prints "version cuda" of the torch in .venv (cuda is "none" for a CPU-only build),
# read from torch/version.py: importing torch takes seconds, and the up-to-date check
# below must stay fast.
torch_info() {
  "$VENV/bin/python" - <<'PYEOF'
import importlib.util, os.path
spec = importlib.util.find_spec('torch')
ns = {}
exec(open(os.path.join(spec.submodule_search_locations[0], 'version.py')).read(), ns)
print(ns['__version__'], ns.get('cuda') or 'none')
PYEOF
}

# Decides how mmcv's compiled ops are built. CUDA ops (RoIAlign, NMS, ... on CUDA
# tensors) need a CUDA-enabled torch, a CUDA toolkit (nvcc) of torch's major CUDA
# version (torch's extension builder refuses another), and the architectures to
# compile for: the local GPUs' (nvidia-smi), or TORCH_CUDA_ARCH_LIST when set (which
# also builds them on a machine without a GPU). Otherwise mmcv gets its CPU ops only.
# $1: torch's CUDA version ("none" for a CPU-only torch, "unknown" before torch is
# installed: taken to match nvcc's).
# Environment: CUDA_HOME (its bin/nvcc comes before PATH's), TORCH_CUDA_ARCH_LIST,
# FLATTEN_MM_CUDA_OPS=0 (CPU ops only, whatever is present), MAX_JOBS (default: all CPUs).
# Sets MMCV_CUDA (1/0), MMCV_ARCH (the TORCH_CUDA_ARCH_LIST to build with), MMCV_LABEL
# ("with CUDA ops for sm_90" / "with CPU ops only"), MMCV_WHY, MMCV_FIX (what would
# give CUDA ops where a GPU is left without them), NVCC, NVCC_VERSION, GPU_CAPS,
# BUILD_JOBS.
plan_mmcv() {
  local torch_cuda=$1 arch toolkit="the CUDA toolkit $1 (torch's CUDA)"
  [ "$torch_cuda" = unknown ] && toolkit="the CUDA toolkit of torch's CUDA version"
  MMCV_CUDA=0 MMCV_ARCH='' MMCV_FIX='' NVCC='' NVCC_VERSION='' GPU_CAPS=''
  # the CPUs this process may use (nproc would also heed OMP_NUM_THREADS)
  BUILD_JOBS=${MAX_JOBS:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}
  if [ -n "${CUDA_HOME:-}" ] && [ -x "$CUDA_HOME/bin/nvcc" ]; then
    NVCC=$CUDA_HOME/bin/nvcc
  else
    NVCC=$(command -v nvcc || true)
  fi
  if [ -n "$NVCC" ]; then
    NVCC_VERSION=$("$NVCC" --version 2>/dev/null |
      sed -n 's/.*release \([0-9][0-9.]*\),.*/\1/p' | head -n 1)
  fi
  if command -v nvidia-smi >/dev/null; then  # one line per GPU, e.g. "9.0"
    GPU_CAPS=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null |
      tr -d ' ' | grep -E '^[0-9]+\.[0-9]+$' | sort -u -V | paste -sd ';' || true)
  fi
  if [ "${FLATTEN_MM_CUDA_OPS:-}" = 0 ]; then
    MMCV_WHY="FLATTEN_MM_CUDA_OPS=0"
  elif [ "$torch_cuda" = none ]; then
    MMCV_WHY="torch is a CPU-only build"
    MMCV_FIX="a CUDA build of torch $TORCH_VERSION"
  elif [ -z "$NVCC_VERSION" ]; then
    MMCV_WHY="no CUDA toolkit: no nvcc in \$CUDA_HOME/bin or on PATH"
    MMCV_FIX="$toolkit, with nvcc on PATH or CUDA_HOME set"
  elif [ "$torch_cuda" != unknown ] && [ "${NVCC_VERSION%%.*}" != "${torch_cuda%%.*}" ]; then
    MMCV_WHY="nvcc is CUDA $NVCC_VERSION, torch is built for CUDA $torch_cuda"
    MMCV_WHY+=" (the major versions must match)"
    MMCV_FIX="$toolkit, first on PATH or as CUDA_HOME"
  elif [ -n "${TORCH_CUDA_ARCH_LIST:-}" ]; then
    MMCV_CUDA=1 MMCV_ARCH=$TORCH_CUDA_ARCH_LIST
    MMCV_WHY="TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, nvcc $NVCC_VERSION"
  elif [ -n "$GPU_CAPS" ]; then
    MMCV_CUDA=1 MMCV_ARCH=$GPU_CAPS
    MMCV_WHY="the local GPUs (compute capability $GPU_CAPS), nvcc $NVCC_VERSION"
  else
    MMCV_WHY="no GPU visible to nvidia-smi (TORCH_CUDA_ARCH_LIST builds CUDA ops without one)"
  fi
  if [ "$MMCV_CUDA" = 1 ]; then
    # "8.0;9.0+PTX" -> "sm_80, sm_90+PTX" (TORCH_CUDA_ARCH_LIST takes ';' or spaces)
    MMCV_LABEL="with CUDA ops for"
    for arch in ${MMCV_ARCH//;/ }; do
      [[ $arch == [0-9]* ]] && arch=sm_${arch/./}
      MMCV_LABEL+=" $arch,"
    done
    MMCV_LABEL=${MMCV_LABEL%,}
  else
    MMCV_LABEL="with CPU ops only"
  fi
}

# Sets TORCH_BUILT, TORCH_CUDA and PYTAG from .venv (or, before torch is installed,
# from the pins and $PYTHON), the mmcv plan (plan_mmcv) and WHEEL_DIR, the cache
# folder of that mmcv wheel: keyed by mmcv, the torch it is compiled against (the
# installed one) and the Python version; a CUDA build also by torch's CUDA version,
# nvcc's version and the architectures. The CPU build's folder name is the one CI's
# cached wheel has always had. $1, if given, replaces torch's CUDA version (--plan).
decide() {
  local py=$VENV/bin/python
  [ -x "$py" ] || py=$PYTHON
  PYTAG=$("$py" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  if [ -x "$VENV/bin/python" ] && read -r TORCH_BUILT TORCH_CUDA < <(torch_info 2>/dev/null); then
    TORCH_KNOWN=1
  else
    TORCH_KNOWN=0 TORCH_BUILT=$TORCH_VERSION TORCH_CUDA=unknown
  fi
  TORCH_CUDA=${1:-$TORCH_CUDA}
  plan_mmcv "$TORCH_CUDA"
  WHEEL_DIR=$CACHE/wheels/mmcv-$MMCV_VERSION-torch$TORCH_BUILT-$PYTAG
  if [ "$MMCV_CUDA" = 1 ]; then
    local tag=${MMCV_LABEL#with CUDA ops for } cuda=${TORCH_CUDA/unknown/$NVCC_VERSION}
    WHEEL_DIR=$CACHE/wheels/mmcv-$MMCV_VERSION-torch$TORCH_BUILT-cuda$cuda-nvcc$NVCC_VERSION-${tag//, /_}-$PYTAG
  fi
}

# Says when a GPU is here but mmcv gets CPU ops only for want of something installable
warn_no_cuda_ops() {
  if [ -n "$GPU_CAPS" ] && [ "$MMCV_CUDA" = 0 ] && [ -n "$MMCV_FIX" ]; then
    log "WARNING: a GPU is here but mmcv gets no CUDA ops (RoIAlign, NMS on GPU tensors" \
      "fail); for them install $MMCV_FIX, then run make install again"
  fi
}

# The stamp: this script, setup.py and the mmcv wheel wanted (so a new toolkit, GPU
# or TORCH_CUDA_ARCH_LIST is noticed on the next run)
want() {
  { cat "$ROOT/tools/install_env.sh" "$ROOT/setup.py"; echo "$WHEEL_DIR"; } | sha256sum | cut -c1-16
}

# Runs mmcv's nms and roi_align on a few boxes on the CPU and, where mmcv has CUDA ops
# and torch sees a GPU, on the GPU (the results must equal the CPU's); says which ran.
check_ops() {
  PYTHONWARNINGS=ignore "$VENV/bin/python" - <<'PYEOF'
import torch
from mmcv.ops import get_compiling_cuda_version, nms, roi_align

boxes = torch.tensor([[0., 0., 10., 10.], [1., 1., 11., 11.], [20., 20., 30., 30.]])
scores = torch.tensor([0.9, 0.8, 0.7])
feats = torch.arange(2 * 8 * 8, dtype=torch.float32).view(1, 2, 8, 8)
rois = torch.tensor([[0., 1., 1., 6., 5.]])


def run(device):
    _, keep = nms(boxes.to(device), scores.to(device), 0.5)
    pooled = roi_align(feats.to(device), rois.to(device), (2, 2), 1.0, 2, 'avg', True)
    return keep.cpu(), pooled.cpu()


keep, pooled = run('cpu')
assert keep.tolist() == [0, 2], keep
built = get_compiling_cuda_version()  # 'not available' without CUDA ops
if built == 'not available':
    print('[install] mmcv ops run on the CPU (nms, roi_align); mmcv has no CUDA ops')
elif not torch.cuda.is_available():
    print(f'[install] mmcv ops run on the CPU (nms, roi_align); its CUDA ops '
          f'(CUDA {built}) are not run: no GPU visible')
else:
    keep_gpu, pooled_gpu = run('cuda')
    assert keep_gpu.tolist() == [0, 2], keep_gpu
    torch.testing.assert_close(pooled_gpu, pooled)
    print(f'[install] mmcv ops run on the CPU and on {torch.cuda.get_device_name()} '
          f'(nms, roi_align; CUDA {built}), with equal results')
PYEOF
}

# Only check an existing .venv: its pins, then (if they hold) that mmcv's ops run
if [ "${1:-}" = --check ]; then
  [ -x "$VENV/bin/python" ] || { log "ERROR: no $VENV; run make install"; exit 1; }
  report_pins || exit 1
  log "every pinned package has its pinned version"
  check_ops || { log "ERROR: mmcv's ops do not run"; exit 1; }
  exit 0
fi

# What an install would do about mmcv, and why; installs nothing. FLATTEN_MM_TORCH_CUDA
# (e.g. 13.0, or none for a CPU-only torch) stands for the CUDA version of torch;
# without it, that of the torch in .venv, or before torch is installed, nvcc's.
if [ "${1:-}" = --plan ]; then
  decide "${FLATTEN_MM_TORCH_CUDA:-}"
  torch_cuda=$TORCH_CUDA
  [ "$torch_cuda" = unknown ] && torch_cuda="unknown, taken to match nvcc"
  [ "$TORCH_KNOWN" = 1 ] || TORCH_BUILT="$TORCH_BUILT (pinned, not installed yet)"
  log "torch $TORCH_BUILT, CUDA $torch_cuda; nvcc ${NVCC_VERSION:-none}${NVCC:+ ($NVCC)};" \
    "GPU compute capability ${GPU_CAPS:-none}"
  log "mmcv $MMCV_VERSION $MMCV_LABEL: $MMCV_WHY"
  if [ "$MMCV_CUDA" = 1 ]; then
    log "build: MMCV_WITH_OPS=1 FORCE_CUDA=1 TORCH_CUDA_ARCH_LIST='$MMCV_ARCH' MAX_JOBS=$BUILD_JOBS"
  else
    log "build: MMCV_WITH_OPS=1 FORCE_CUDA=0 CUDA_VISIBLE_DEVICES= MAX_JOBS=$BUILD_JOBS"
  fi
  if [ "$TORCH_KNOWN" = 1 ]; then
    log "wheel cache: $WHEEL_DIR"
  else  # named after the torch installed, whose version may carry a tag (+cu130)
    log "wheel cache: $WHEEL_DIR (torch's version as installed, with its tag if any)"
  fi
  warn_no_cuda_ops
  exit 0
fi

if [ -f "$STAMP" ] && decide && [ "$(cat "$STAMP")" = "$(want)" ] && [ -z "$(check_pins 2>&1)" ]; then
  log ".venv is up to date ($VENV)"
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
$PIP install -q --upgrade pip
CONSTRAINTS=$VENV/constraints.txt
printf '%s\n' "${PINS[@]/=/==}" > "$CONSTRAINTS"
export PIP_CONSTRAINT=$CONSTRAINTS

log "torch $TORCH_VERSION, torchvision $TORCHVISION_VERSION"
$PIP install -q "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION" \
  "setuptools==$SETUPTOOLS_VERSION"
# what pip installed and where it runs: a CUDA build of torch also runs on the CPU
log "torch $("$VENV/bin/python" -c '
import warnings; warnings.simplefilter("ignore")
import torch
if torch.version.cuda is None:
    print(torch.__version__, "(CPU-only build): runs on the CPU")
elif torch.cuda.is_available():
    n = torch.cuda.device_count()
    print(f"{torch.__version__} (CUDA {torch.version.cuda} build): runs on CUDA,",
          n, "GPU" + "s" * (n > 1), f"({torch.cuda.get_device_name()})")
else:
    print(f"{torch.__version__} (CUDA {torch.version.cuda} build): runs on the CPU, no GPU visible")
')"

log "build tools and pure-Python dependencies"
$PIP install -q wheel ninja "numpy==$NUMPY_VERSION" \
  "mmengine==$MMENGINE_VERSION" "timm==$TIMM_VERSION" "pycocotools==$PYCOCOTOOLS_VERSION" \
  ftfy regex matplotlib opencv-python-headless pytest "pytest-xdist==$PYTEST_XDIST_VERSION"

# mmcv 2.1.0 exists on PyPI only as source; its compiled ops (RoIAlign, NMS) are built
# here, with CUDA ops where decide/plan_mmcv say so. torch 2.14's headers need C++20, so
# the sdist's -std flag is raised before building. The wheel is cached outside the
# repository (WHEEL_DIR, see decide). $MMCV_STAMP names the folder the installed
# mmcv came from, so a change of plan (a toolkit or GPU added) installs another.
decide
log "mmcv $MMCV_VERSION $MMCV_LABEL: $MMCV_WHY"
warn_no_cuda_ops
if [ "$(cat "$MMCV_STAMP" 2>/dev/null)" != "$WHEEL_DIR" ] ||
  ! "$VENV/bin/python" -c "import mmcv, mmcv.ops; assert mmcv.__version__ == '$MMCV_VERSION'" 2>/dev/null; then
  if ! ls "$WHEEL_DIR"/mmcv-*.whl >/dev/null 2>&1; then
    BUILD=$(mktemp -d)
    $PIP download -q --no-deps --no-build-isolation --no-binary :all: "mmcv==$MMCV_VERSION" -d "$BUILD"
    tar -xzf "$BUILD"/mmcv-$MMCV_VERSION.tar.gz -C "$BUILD"
    SRC=$BUILD/mmcv-$MMCV_VERSION
    sed -i -e 's/-std=c++14/-std=c++20/g' -e 's/-std=c++17/-std=c++20/g' "$SRC/setup.py"
    # the files mmcv's setup.py compiles (one object each), for the progress lines;
    # mmcv builds CUDA ops when torch sees a GPU or FORCE_CUDA=1, so a CPU-ops build
    # hides the GPUs (a GPU without a matching nvcc would fail the build)
    OPS=$SRC/mmcv/ops/csrc/pytorch
    if [ "$MMCV_CUDA" = 1 ]; then
      total=$( (ls "$OPS"/*.cpp "$OPS"/cpu/*.cpp "$OPS"/cuda/*.cu "$OPS"/cuda/*.cpp 2>/dev/null ||
        true) | wc -l)
      # the toolkit of the nvcc chosen, so that torch's builder uses the same one
      # (nvcc names its root itself: $NVCC may be a wrapper, as /usr/local/bin/nvcc is)
      cuda_home=${CUDA_HOME:-$("$NVCC" --dryrun -c -x cu /dev/null -o /dev/null 2>&1 |
        sed -n 's/^#\$ TOP=//p' | xargs -r readlink -f || true)}
      build_env=(FORCE_CUDA=1 "TORCH_CUDA_ARCH_LIST=$MMCV_ARCH")
      [ -n "$cuda_home" ] && build_env+=("CUDA_HOME=$cuda_home")
      log "building mmcv $MMCV_VERSION $MMCV_LABEL, $BUILD_JOBS jobs (time not yet" \
        "measured with CUDA ops; CPU ops alone take about 20 minutes on 2 cores)"
    else
      total=$( (ls "$OPS"/*.cpp "$OPS"/cpu/*.cpp 2>/dev/null || true) | wc -l)
      build_env=(FORCE_CUDA=0 CUDA_VISIBLE_DEVICES=)
      log "building mmcv $MMCV_VERSION $MMCV_LABEL, $BUILD_JOBS jobs (about 20 minutes on 2 cores)"
    fi
    mkdir -p "$WHEEL_DIR"
    (cd "$SRC" && export MAX_JOBS=$BUILD_JOBS MMCV_WITH_OPS=1 "${build_env[@]}" &&
      $PIP wheel -v --no-build-isolation --no-deps . -w "$WHEEL_DIR.tmp" >"$BUILD/build.log" 2>&1) &
    pid=$!
    start=$SECONDS
    while kill -0 $pid 2>/dev/null; do
      sleep 30
      n=$(find "$SRC" -name '*.o' 2>/dev/null | wc -l)
      log "  mmcv build: $n of $total objects compiled, $((SECONDS - start)) s"
    done
    if ! wait $pid; then
      tail -n 40 "$BUILD/build.log"
      log "mmcv build failed; full log: $BUILD/build.log (known causes: docs/get_started.md," \
        "On a machine with GPUs)"
      exit 1
    fi
    mv "$WHEEL_DIR.tmp"/mmcv-*.whl "$WHEEL_DIR"/ && rmdir "$WHEEL_DIR.tmp"
    rm -rf "$BUILD"
  fi
  log "installing mmcv from $WHEEL_DIR"
  $PIP install -q --no-deps --force-reinstall "$WHEEL_DIR"/mmcv-*.whl
  echo "$WHEEL_DIR" > "$MMCV_STAMP"
fi

log "mmdet $MMDET_VERSION, mmsegmentation $MMSEG_VERSION"
$PIP install -q "mmdet==$MMDET_VERSION" "mmsegmentation==$MMSEG_VERSION" \
  "mmcv==$MMCV_VERSION" --find-links "$WHEEL_DIR"

# mmpretrain's PyPI dependency `modelindex` is an empty shim over `model-index`
log "mmpretrain $MMPRETRAIN_VERSION"
$PIP install -q "mmpretrain==$MMPRETRAIN_VERSION" "mmcv==$MMCV_VERSION" --find-links "$WHEEL_DIR"

# openmim without its download-only dependency (opendatalab pins old setuptools
# and requests; mim's list, search, train and test commands do not use it)
log "openmim $OPENMIM_VERSION"
$PIP install -q --no-deps "openmim==$OPENMIM_VERSION"
$PIP install -q click colorama model-index pandas rich tabulate requests

log "onnx $ONNX_VERSION, onnxscript $ONNXSCRIPT_VERSION, onnxruntime $ONNXRUNTIME_VERSION"
$PIP install -q "onnx==$ONNX_VERSION" "onnxscript==$ONNXSCRIPT_VERSION" \
  "onnxruntime==$ONNXRUNTIME_VERSION"

# A develop-style editable install: the distribution's location is the
# repository, so mim finds flatten_mm/.mim (links to configs/, tools/ and
# model-index.yml, made by setup.py). pip's PEP 660 editable install would
# hide it (the location becomes site-packages).
log "flatten_mm (editable, setup.py develop)"
"$VENV/bin/python" -m pip uninstall -q -y flatten_mm >/dev/null 2>&1 || true
(cd "$ROOT" && PYTHONWARNINGS=ignore "$VENV/bin/python" setup.py -q develop --no-deps \
  >/dev/null 2>&1) || { log "setup.py develop failed"; exit 1; }

"$VENV/bin/python" -c "import mmcv.ops, mmdet, mmseg, mmpretrain, timm, mim, flatten_mm; print('[install] ok: mmcv', mmcv.__version__, 'mmdet', mmdet.__version__, 'mmseg', mmseg.__version__, 'mmpretrain', mmpretrain.__version__, 'timm', timm.__version__)"
check_ops || { log "ERROR: mmcv's ops do not run"; exit 1; }
warn_no_cuda_ops  # again: the first one has scrolled away
report_pins || exit 1
want > "$STAMP"
