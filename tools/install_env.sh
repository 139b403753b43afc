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
WANT=$(cat "$ROOT/tools/install_env.sh" "$ROOT/setup.py" | sha256sum | cut -c1-16)
CACHE=${FLATTEN_MM_CACHE:-$HOME/.cache/flatten_mm}

log() { printf '[install] %s\n' "$*"; }

# package -> pinned version; every pip call below is constrained by these, and the
# installed versions are checked against them at the end and on every later run
PINS=(torch=$TORCH_VERSION torchvision=$TORCHVISION_VERSION numpy=$NUMPY_VERSION
      setuptools=$SETUPTOOLS_VERSION mmengine=$MMENGINE_VERSION mmcv=$MMCV_VERSION
      mmdet=$MMDET_VERSION mmsegmentation=$MMSEG_VERSION mmpretrain=$MMPRETRAIN_VERSION
      timm=$TIMM_VERSION
      pycocotools=$PYCOCOTOOLS_VERSION openmim=$OPENMIM_VERSION onnx=$ONNX_VERSION
      onnxscript=$ONNXSCRIPT_VERSION onnxruntime=$ONNXRUNTIME_VERSION)

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

if [ "${1:-}" = --check ]; then  # only check the pins of an existing .venv
  report_pins && log "every pinned package has its pinned version"
  exit
fi

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && [ -z "$(check_pins 2>&1)" ]; then
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

log "torch $TORCH_VERSION, torchvision $TORCHVISION_VERSION (CPU execution)"
$PIP install -q "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION" \
  "setuptools==$SETUPTOOLS_VERSION"

log "build tools and pure-Python dependencies"
$PIP install -q wheel ninja "numpy==$NUMPY_VERSION" \
  "mmengine==$MMENGINE_VERSION" "timm==$TIMM_VERSION" "pycocotools==$PYCOCOTOOLS_VERSION" \
  ftfy regex matplotlib opencv-python-headless pytest

# mmcv 2.1.0 exists on PyPI only as source; its compiled ops (RoIAlign, NMS) are built here.
# torch 2.14's headers need C++20, so the sdist's -std flag is raised before building.
# The wheel is cached outside the repository, keyed by mmcv, the torch it is compiled
# against (the installed one, read from torch itself) and the Python version.
read -r PYTAG TORCH_BUILT < <("$VENV/bin/python" -c \
  'import sys, torch; print(f"cp{sys.version_info[0]}{sys.version_info[1]}", torch.__version__)')
WHEEL_DIR=$CACHE/wheels/mmcv-$MMCV_VERSION-torch$TORCH_BUILT-$PYTAG
if ! "$VENV/bin/python" -c "import mmcv, mmcv.ops; assert mmcv.__version__ == '$MMCV_VERSION'" 2>/dev/null; then
  if ! ls "$WHEEL_DIR"/mmcv-*.whl >/dev/null 2>&1; then
    BUILD=$(mktemp -d)
    log "building mmcv $MMCV_VERSION with compiled ops (about 20 minutes on 2 cores)"
    $PIP download -q --no-deps --no-build-isolation --no-binary :all: "mmcv==$MMCV_VERSION" -d "$BUILD"
    tar -xzf "$BUILD"/mmcv-$MMCV_VERSION.tar.gz -C "$BUILD"
    SRC=$BUILD/mmcv-$MMCV_VERSION
    sed -i -e 's/-std=c++14/-std=c++20/g' -e 's/-std=c++17/-std=c++20/g' "$SRC/setup.py"
    mkdir -p "$WHEEL_DIR"
    (cd "$SRC" && MAX_JOBS=${MAX_JOBS:-2} MMCV_WITH_OPS=1 \
      $PIP wheel -v --no-build-isolation --no-deps . -w "$WHEEL_DIR.tmp" >"$BUILD/build.log" 2>&1) &
    pid=$!
    start=$SECONDS
    while kill -0 $pid 2>/dev/null; do
      sleep 30
      n=$(find "$SRC" -name '*.o' 2>/dev/null | wc -l)
      log "  mmcv build: $n of ~77 objects compiled, $((SECONDS - start)) s"
    done
    if ! wait $pid; then
      tail -n 40 "$BUILD/build.log"
      log "mmcv build failed; full log: $BUILD/build.log"
      exit 1
    fi
    mv "$WHEEL_DIR.tmp"/mmcv-*.whl "$WHEEL_DIR"/ && rmdir "$WHEEL_DIR.tmp"
    rm -rf "$BUILD"
  fi
  log "installing mmcv from $WHEEL_DIR"
  $PIP install -q --no-deps --force-reinstall "$WHEEL_DIR"/mmcv-*.whl
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
report_pins || exit 1
echo "$WANT" > "$STAMP"
