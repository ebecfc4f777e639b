#!/usr/bin/env bash
# Create the trainer's TPU VM (on demand), ship this checkout, start the parameter server
# and the RL trainer (`rlax-ps train`) on host 0. The trainer reads its token from the
# server's owner-only tokens.json, so no secret is on a command line.
#
#   TPU_PROJECT=my-proj TPU_ZONE=us-central2-b tpu_scripts/launch_trainer.sh rlax-trainer v5litepod-8
#
# Then start workers with tpu_scripts/launch_workers.sh (SERVER_ADDRESS = host 0's internal
# IP and SERVER_PORT, WORKER_TOKEN = the "worker" entry of ~/rlax-ps-server/tokens.json).
# Env: TRAIN_CONFIG (default configs/rl_local.py), TRAIN_ARGS (more `rlax-ps train` flags,
# e.g. --config.init_from_hf=... for the warm start), TRAIN_CMD (replaces the trainer
# command; TRAIN_HOSTS=all runs it on every host of the slice),
# SERVE_ARGS (extra `rlax-ps serve` flags), SERVER_PORT (default 50051), DRY_RUN=1 to print
# the gcloud commands only.
# shellcheck source=tpu_scripts/common.sh
source "$(dirname "$0")/common.sh"

name="${1:?usage: launch_trainer.sh NAME ACCELERATOR_TYPE (e.g. v5litepod-8, v4-8)}"
accelerator="${2:?usage: launch_trainer.sh NAME ACCELERATOR_TYPE}"
port="${SERVER_PORT:-50051}"
[[ "$port" =~ ^[0-9]+$ ]] || { echo "SERVER_PORT: expected a port number, got '$port'" >&2; exit 2; }
hosts="${TRAIN_HOSTS:-0}"
[[ "$hosts" == "0" || "$hosts" == "all" ]] || { echo "TRAIN_HOSTS: expected 0 or all, got '$hosts'" >&2; exit 2; }
tokens="\$HOME/rlax-ps-server/tokens.json"
# The default trainer first waits for the server to have written its tokens.
train_cmd="${TRAIN_CMD:-until [ -s $tokens ]; do sleep 1; done && .venv/bin/rlax-ps train --config=${TRAIN_CONFIG:-configs/rl_local.py} --workdir=runs/rl --address=127.0.0.1:$port --token_file=$tokens ${TRAIN_ARGS:-}}"

gtpu create "$name" --accelerator-type="$accelerator" --version="$TPU_RUNTIME"
ship_repo "$name"
gtpu ssh "$name" --worker=0 --command="cd $RLAX_PS_DIR && nohup .venv/bin/rlax-ps serve --port=$port --host=0.0.0.0 --storage_dir=\$HOME/rlax-ps-server ${SERVE_ARGS:-} > serve.log 2>&1 &"
gtpu ssh "$name" --worker="$hosts" --command="cd $RLAX_PS_DIR && nohup bash -c '$train_cmd' > train.log 2>&1 &"
echo "trainer $name started; server on host 0 port $port (tokens in ~/rlax-ps-server on host 0)"
