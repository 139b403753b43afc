#!/usr/bin/env bash
# The built-in demo: make the shapes data, train Mask R-CNN and Semantic FPN with
# a FLatten-PVT-T backbone on it, evaluate both with the real metrics, draw the
# predictions, and print the two result lines.
# Usage: tools/demo.sh [WORK_DIR]   (MAX_ITERS_DET / MAX_ITERS_SEG shorten it)
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${1:-work_dirs/demo}
PY=${PY:-.venv/bin/python}
DATA=data/shapes
DET=configs/demo/mask-rcnn_flatten-pvt-t_fpn_shapes.py
SEG=configs/demo/fpn_flatten-pvt-t_shapes.py
mkdir -p "$WORK"
start=$SECONDS

if [ ! -f "$DATA/annotations/instances_val.json" ]; then
  $PY tools/make_demo_data.py "$DATA"
fi

run() {  # run CONFIG NAME: train, then evaluate with pictures
  local cfg=$1 name=$2 iters=$3
  local opts=(train_cfg.val_interval=1000000)
  [ -n "$iters" ] && opts+=(train_cfg.max_iters="$iters")
  echo "[demo] training $name ($cfg), log in $WORK/$name"
  $PY tools/train.py "$cfg" --work-dir "$WORK/$name" --cfg-options "${opts[@]}" \
    > "$WORK/$name.train.log" 2>&1 || { tail -n 30 "$WORK/$name.train.log"; exit 1; }
  grep -o 'Iter(train) \[ *[0-9]*/[0-9]*\].*time: [0-9.]*' "$WORK/$name.train.log" | tail -n 1 || true
  local ckpt
  ckpt=$(cat "$WORK/$name/last_checkpoint")
  echo "[demo] evaluating $name, pictures under $WORK/$name"
  $PY tools/test.py "$cfg" "$ckpt" --work-dir "$WORK/$name" --show-dir pictures \
    --metrics-out "$WORK/$name.metrics.json" > "$WORK/$name.test.log" 2>&1 \
    || { tail -n 30 "$WORK/$name.test.log"; exit 1; }
}

run "$DET" det "${MAX_ITERS_DET:-}"
run "$SEG" seg "${MAX_ITERS_SEG:-}"
echo "[demo] done in $((SECONDS - start)) s"
$PY - "$WORK" <<'PY'
import json, sys
work = sys.argv[1]
det = json.load(open(f'{work}/det.metrics.json'))
seg = json.load(open(f'{work}/seg.metrics.json'))
print(f"demo detection bbox_mAP={det['coco/bbox_mAP']:.3f} segm_mAP={det['coco/segm_mAP']:.3f}")
print(f"demo segmentation mIoU={seg['mIoU']:.2f}")
PY
