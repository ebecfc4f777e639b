#!/usr/bin/env bash
# Create the trainer's TPU VM slice (on demand), ship this checkout, start the parameter
# server on host 0 and the training job on every host (multi-host via jax.distributed).
#
#   TPU_PROJECT=my-proj TPU_ZONE=us-central2-b tpu_scripts/launch_trainer.sh rlax-trainer v4-32
#
# Env: TRAIN_CMD (default: the supervised warm start), SERVE_ARGS (extra `rlax-ps serve`
# flags), SERVER_PORT (default 50051), DRY_RUN=1 to print the gcloud commands only.
source "$(dirname "$0")/common.sh"

name="${1:?usage: launch_trainer.sh NAME ACCELERATOR_TYPE (e.g. v5litepod-8, v4-32)}"
accelerator="${2:?usage: launch_trainer.sh NAME ACCELERATOR_TYPE}"
port="${SERVER_PORT:-50051}"
train_cmd="${TRAIN_CMD:-.venv/bin/rlax-ps sft --config=configs/sft_tiny.py --workdir=runs/sft}"

gtpu create "$name" --accelerator-type="$accelerator" --version="$TPU_RUNTIME"
ship_repo "$name"
gtpu ssh "$name" --worker=0 --command="cd $RLAX_PS_DIR && nohup .venv/bin/rlax-ps serve --port=$port --storage_dir=\$HOME/rlax-ps-server ${SERVE_ARGS:-} > serve.log 2>&1 &"
gtpu ssh "$name" --worker=all --command="cd $RLAX_PS_DIR && nohup $train_cmd > train.log 2>&1 &"
echo "trainer $name started; server on host 0 port $port (tokens in ~/rlax-ps-server on host 0)"
