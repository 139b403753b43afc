#!/usr/bin/env bash
# The built-in demo: make the shapes data, train Mask R-CNN and Semantic FPN with
# a FLatten-PVT-T backbone on it, evaluate both with the real metrics, draw the
# predictions, and print the two result lines.
# Usage: tools/demo.sh [WORK_DIR]
#   MAX_ITERS_DET / MAX_ITERS_SEG shorten the schedules; DEMO_DATA points the
#   configs at other data made by tools/make_demo_data.py (default data/shapes).
#   The two runs train side by side, each on half of the cores (DEMO_THREADS
#   overrides the threads per run): at these image sizes one run does not keep
#   two cores busy, so two one-thread runs finish sooner than one after the other.
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${1:-work_dirs/demo}
PY=${PY:-.venv/bin/python}
DATA=${DEMO_DATA:-data/shapes}
DET=configs/demo/mask-rcnn_flatten-pvt-t_fpn_shapes.py
SEG=configs/demo/fpn_flatten-pvt-t_shapes.py
CORES=$(nproc)
THREADS=${DEMO_THREADS:-$(( CORES > 1 ? CORES / 2 : 1 ))}
mkdir -p "$WORK"
start=$SECONDS

if [ ! -f "$DATA/annotations/instances_val.json" ]; then
  $PY tools/make_demo_data.py "$DATA"
fi

run() {  # run CONFIG NAME ITERS: train, then evaluate with pictures
  local cfg=$1 name=$2 iters=$3 root=$DATA/ split
  local opts=(train_cfg.val_interval=1000000)
  [ -n "$iters" ] && opts+=(train_cfg.max_iters="$iters")
  if [ "$name" = det ]; then
    opts+=({val,test}_evaluator.ann_file="$DATA/annotations/instances_val.json")
  else
    root=$DATA/ade/
  fi
  for split in train val test; do opts+=("${split}_dataloader.dataset.data_root=$root"); done
  export OMP_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS
  $PY tools/train.py "$cfg" --work-dir "$WORK/$name" --cfg-options "${opts[@]}" \
    > "$WORK/$name.train.log" 2>&1 || return 1
  local ckpt
  ckpt=$(cat "$WORK/$name/last_checkpoint")
  $PY tools/test.py "$cfg" "$ckpt" --work-dir "$WORK/$name" --show-dir pictures \
    --metrics-out "$WORK/$name.metrics.json" --cfg-options "${opts[@]}" > "$WORK/$name.test.log" 2>&1 || return 2
  local median  # of the step times the train log reports (every 20 iterations)
  median=$(grep 'Iter(train)' "$WORK/$name.train.log" | grep -o ' time: [0-9.]*' | awk '{print $2}' |
    sort -n | awk '{t[NR] = $1} END {if (NR) printf "%.2f s", t[int((NR + 1) / 2)]; else printf "n/a"}') || true
  ckpt=$(basename "$ckpt" .pth)
  echo "[demo] $name done after $((SECONDS - start)) s: ${ckpt#iter_} iterations," \
    "median $median per iteration"
}

echo "[demo] training det ($DET) and seg ($SEG) side by side, $THREADS thread(s) each;" \
  "logs in $WORK/{det,seg}.{train,test}.log, pictures under $WORK/{det,seg}/"
trap 'kill $(jobs -p) 2>/dev/null; exit 130' INT TERM
run "$DET" det "${MAX_ITERS_DET:-}" & det_pid=$!
run "$SEG" seg "${MAX_ITERS_SEG:-}" & seg_pid=$!
failed=0
for name in det seg; do
  pid_var=${name}_pid
  rc=0
  wait "${!pid_var}" || rc=$?
  if [ "$rc" != 0 ]; then
    failed=1
    log=$WORK/$name.train.log
    [ "$rc" = 2 ] && log=$WORK/$name.test.log
    echo "[demo] $name failed; the end of $log:"
    tail -n 30 "$log"
  fi
done
[ "$failed" = 0 ] || exit 1
echo "[demo] done in $((SECONDS - start)) s"
$PY - "$WORK" <<'PY'
import json, sys
work = sys.argv[1]
det = json.load(open(f'{work}/det.metrics.json'))
seg = json.load(open(f'{work}/seg.metrics.json'))
print(f"demo detection bbox_mAP={det['coco/bbox_mAP']:.3f} segm_mAP={det['coco/segm_mAP']:.3f}")
print(f"demo segmentation mIoU={seg['mIoU']:.2f}")
PY
