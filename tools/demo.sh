#!/usr/bin/env bash
# The built-in demo: make the shapes data, train Mask R-CNN and Semantic FPN with
# a FLatten-PVTv2-B0 backbone on it, evaluate both with the real metrics, draw the
# predictions, and print the two result lines.
# Usage: tools/demo.sh [WORK_DIR]
#   MAX_ITERS_DET / MAX_ITERS_SEG shorten the schedules; DEMO_DATA points the
#   configs at other data made by tools/make_demo_data.py (default data/shapes).
#   The two runs train side by side, each on half of the cores (DEMO_THREADS
#   overrides the threads per run): at these image sizes one run does not keep
#   two cores busy, so two one-thread runs finish sooner than one after the other.
#   Every DEMO_PROGRESS_EVERY seconds (default 20) a line per run gives the
#   iterations done, the loss and the ETA; Ctrl-C stops both runs.
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${1:-work_dirs/demo}
PY=${PY:-.venv/bin/python}
DATA=${DEMO_DATA:-data/shapes}
DET=configs/demo/mask-rcnn_flatten-pvtv2-b0_fpn_shapes.py
SEG=configs/demo/fpn_flatten-pvtv2-b0_shapes.py
CORES=$(nproc)
THREADS=${DEMO_THREADS:-$(( CORES > 1 ? CORES / 2 : 1 ))}
mkdir -p "$WORK"
rm -f "$WORK"/{det,seg}.{train.log,test.log,metrics.json}  # progress reads these
start=$SECONDS

if [ ! -f "$DATA/annotations/instances_val.json" ]; then
  $PY tools/make_demo_data.py "$DATA"
fi

run() {  # run CONFIG NAME ITERS [CFG_OPTION...]: train, then evaluate with pictures
  local cfg=$1 name=$2 iters=$3 log
  shift 3
  local opts=("$@" train_cfg.val_interval=1000000)
  [ -n "$iters" ] && opts+=(train_cfg.max_iters="$iters")
  export OMP_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS
  log=$WORK/$name.train.log
  $PY tools/train.py "$cfg" --work-dir "$WORK/$name" --cfg-options "${opts[@]}" > "$log" 2>&1 &&
    log=$WORK/$name.test.log &&
    $PY tools/test.py "$cfg" "$(cat "$WORK/$name/last_checkpoint")" --work-dir "$WORK/$name" \
      --show-dir pictures --metrics-out "$WORK/$name.metrics.json" --cfg-options "${opts[@]}" \
      > "$log" 2>&1 ||
    { echo "[demo] $name failed; the end of $log:"; tail -n 30 "$log"; return 1; }
  local done_iters median  # median of the step times the train log reports
  done_iters=$(basename "$(cat "$WORK/$name/last_checkpoint")" .pth)
  median=$(sed -n 's/.*Iter(train).* time: \([0-9.]*\).*/\1/p' "$WORK/$name.train.log" | sort -n |
    awk '{t[NR] = $1} END {if (NR) printf "%.2f s", t[int((NR + 1) / 2)]; else printf "n/a"}')
  echo "[demo] $name done after $((SECONDS - start)) s: ${done_iters#iter_} iterations," \
    "median $median per iteration"
}

progress() {  # every DEMO_PROGRESS_EVERY s: iterations, loss and ETA of both runs
  local name line
  set +e +o pipefail  # no log line yet is not an error
  while sleep "${DEMO_PROGRESS_EVERY:-20}"; do
    for name in det seg; do
      line=$(grep -a 'Iter(train)' "$WORK/$name.train.log" 2>/dev/null | tail -n 1 |
        sed -n 's/.*Iter(train) *\[ *\([0-9]*\)\/\([0-9]*\)\].*eta: *\([0-9:day ,]*[0-9]\).*  loss: \([0-9.]*\).*/iteration \1\/\2, loss \4, eta \3/p')
      if [ -f "$WORK/$name.metrics.json" ]; then
        continue  # done: its own line said so
      elif [ -f "$WORK/$name.test.log" ]; then
        echo "[demo] $name: evaluating ($((SECONDS - start)) s)"
      elif [ -n "$line" ]; then
        echo "[demo] $name: $line ($((SECONDS - start)) s)"
      else
        echo "[demo] $name: starting ($((SECONDS - start)) s)"
      fi
    done
  done
}

echo "[demo] training det ($DET) and seg ($SEG) side by side, $THREADS thread(s) each;" \
  "logs in $WORK/{det,seg}.{train,test}.log, pictures under $WORK/{det,seg}/"
kill_tree() {  # a process and all its descendants: the runs' python processes ignore
  local child  # SIGINT (background jobs of a script), so Ctrl-C must stop them here
  for child in $(pgrep -P "$1"); do kill_tree "$child"; done
  kill "$1" 2>/dev/null || true
}
stop() {
  trap - INT TERM
  local job
  for job in $(jobs -p); do kill_tree "$job"; done
  echo "[demo] stopped; logs so far: $WORK/{det,seg}.train.log"
  exit 130
}
trap stop INT TERM
progress & progress_pid=$!
run "$DET" det "${MAX_ITERS_DET:-}" {train,val,test}_dataloader.dataset.data_root="$DATA/" \
  {val,test}_evaluator.ann_file="$DATA/annotations/instances_val.json" & det_pid=$!
run "$SEG" seg "${MAX_ITERS_SEG:-}" {train,val,test}_dataloader.dataset.data_root="$DATA/ade/" &
seg_pid=$!
failed=0
wait $det_pid || failed=1
wait $seg_pid || failed=1
kill $progress_pid 2>/dev/null || true
[ "$failed" = 0 ] || exit 1
echo "[demo] done in $((SECONDS - start)) s; pictures:" \
  $(find "$WORK/det" "$WORK/seg" -type d -name pictures 2>/dev/null | sort)
$PY - "$WORK" <<'PY'
import json, sys
work = sys.argv[1]
det = json.load(open(f'{work}/det.metrics.json'))
seg = json.load(open(f'{work}/seg.metrics.json'))
print(f"demo detection bbox_mAP={det['coco/bbox_mAP']:.3f} segm_mAP={det['coco/segm_mAP']:.3f}")
print(f"demo segmentation mIoU={seg['mIoU']:.2f}")
PY
