#!/usr/bin/env bash
# Usage: tools/dist_train.sh CONFIG GPUS [train.py options]
# Multi-node: NNODES, NODE_RANK, MASTER_ADDR, PORT in the environment.
CONFIG=$1
GPUS=$2
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
PORT=${PORT:-29500}
MASTER_ADDR=${MASTER_ADDR:-"127.0.0.1"}
PYTHONPATH="$(dirname "$0")/..":${PYTHONPATH:-} \
python -m torch.distributed.run --nnodes="$NNODES" --node_rank="$NODE_RANK" \
  --master_addr="$MASTER_ADDR" --nproc_per_node="$GPUS" --master_port="$PORT" \
  "$(dirname "$0")/train.py" "$CONFIG" --launcher pytorch "${@:3}"
