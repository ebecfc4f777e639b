#!/usr/bin/env bash
# Create the trainer's TPU VM (on demand), ship this checkout, start the parameter server
# on host 0 and the RL trainer (`rlax-ps train`) on host 0, or with TRAIN_HOSTS=all on
# every host of a multi-host slice (one jax.distributed job; process 0 talks to the server;
# checkpoints then go to storage every host sees: --config.checkpoint.directory=gs://...
# in TRAIN_ARGS). The trainer reads its token from the server's owner-only tokens.json,
# waiting for the server to write it, so no secret is on a command line.
#
#   TPU_PROJECT=my-proj TPU_ZONE=us-west4-a tpu_scripts/launch_trainer.sh rlax-trainer v5litepod-8
#
# Then start workers with tpu_scripts/launch_workers.sh (SERVER_ADDRESS = host 0's internal
# IP and SERVER_PORT, WORKER_TOKEN = the "worker" entry of ~/rlax-ps-server/tokens.json).
# The model to start from: MODEL_URI (an HF checkpoint folder in storage, gs://bucket/model),
# copied to ~/model on every host and given as --config.init_from_hf=$HOME/model; or a
# --config.init_from_hf=FOLDER on the VM in TRAIN_ARGS. Without either, one host runs the
# recipe's warm start first: `rlax-ps sft` with TRAIN_CONFIG and TRAIN_ARGS in runs/rl/sft
# (configs/rl_local.py: its sft block), then trains from its export; TRAIN_HOSTS=all needs
# one of the two. Give the workers the same (launch_workers.sh).
# Env: TRAIN_CONFIG (default configs/rl_local.py), TRAIN_ARGS (more `rlax-ps train` flags,
# config overrides also for the warm start; rl.max_seconds is 0 unless it says so: a
# restart would begin the limit anew), MODEL_URI, TRAIN_HOSTS (0 or all; all on a
# multi-host slice), TPU_RUNTIME (default: the accelerator generation's image), TRAIN_CMD
# (replaces the trainer command and its warm start),
# SERVE_ARGS (extra `rlax-ps serve` flags), SERVER_PORT (default 50051), DRY_RUN=1 to print
# the gcloud commands only. TRAIN_ARGS, TRAIN_CMD and SERVE_ARGS are shell words, read once
# by the VM's shell as if typed there: quote a value with spaces or quotes as you would on
# a command line, e.g. TRAIN_ARGS="--config.tokenizer.chat_kwargs='{\"enable_thinking\": false}'".
# shellcheck source=tpu_scripts/common.sh
source "$(dirname "$0")/common.sh"

name="${1:?usage: launch_trainer.sh NAME ACCELERATOR_TYPE (e.g. v5litepod-8, v4-8)}"
accelerator="${2:?usage: launch_trainer.sh NAME ACCELERATOR_TYPE}"
port="${SERVER_PORT:-50051}"
[[ "$port" =~ ^[0-9]+$ ]] || { echo "SERVER_PORT: expected a port number, got '$port'" >&2; exit 2; }
hosts="${TRAIN_HOSTS:-0}"
[[ "$hosts" == "0" || "$hosts" == "all" ]] || { echo "TRAIN_HOSTS: expected 0 or all, got '$hosts'" >&2; exit 2; }
if [[ "$hosts" == "0" ]] && ! single_host "$accelerator"; then
  echo "$accelerator spans several hosts and JAX must run on each: set TRAIN_HOSTS=all" \
    "(with --config.checkpoint.directory=gs://... in TRAIN_ARGS)" >&2
  exit 2
fi
tokens="\$HOME/rlax-ps-server/tokens.json"
multi=""
if [[ "$hosts" == "all" ]]; then
  multi="--coordinator_address=auto"
  if [[ -z "${TRAIN_CMD:-}" && "${TRAIN_ARGS:-}" != *--config.checkpoint.directory=* ]]; then
    echo "TRAIN_HOSTS=all: every host writes its shards of each checkpoint; set" \
      "--config.checkpoint.directory=gs://... (storage every host sees) in TRAIN_ARGS" >&2
    exit 2
  fi
fi
train_args="${TRAIN_ARGS:-}"
check_model_settings TRAIN_ARGS "$train_args"
config="${TRAIN_CONFIG:-configs/rl_local.py}"
# The trainer's command, and where no model is given the warm start to run before it.
warm_start=""
if [[ -n "$MODEL_URI" ]]; then
  train_args="--config.init_from_hf=$REMOTE_MODEL_DIR $train_args"
elif [[ -z "${TRAIN_CMD:-}" && "$train_args" != *--config.init_from_hf=* ]]; then
  if [[ "$hosts" == "all" ]]; then
    echo "TRAIN_HOSTS=all: set MODEL_URI=gs://... (copied to every host) or" \
      "--config.init_from_hf=FOLDER (on every host) in TRAIN_ARGS: the recipe's warm start" \
      "runs on one host, its export on that host alone" >&2
    exit 2
  fi
  warm_start=".venv/bin/rlax-ps sft --config=$config --workdir=runs/rl/sft --progress=false $train_args"
  train_args="--config.init_from_hf=runs/rl/sft/hf $train_args"
fi
train_cmd="${TRAIN_CMD:-.venv/bin/rlax-ps train --config=$config --workdir=runs/rl --address=127.0.0.1:$port --token_file=$tokens $multi --config.rl.max_seconds=0 $train_args}"

# left_running STEP: after the VM is made, a failed STEP leaves it running (on demand, so
# billed): say so, and how to delete it.
left_running() {
  echo "$1 failed: TPU VM $name is still running; delete it with" \
    "gcloud compute tpus tpu-vm delete $name --project=$TPU_PROJECT --zone=$TPU_ZONE" >&2
  exit 1
}

gtpu create "$name" --accelerator-type="$accelerator" --version="$(tpu_runtime "$accelerator")"
ship_repo "$name" || left_running "setting it up (tpu_scripts/setup_vm.sh)"
copy_model "$name" || left_running "copying MODEL_URI to it"
# Both run under the watchdog: a crash restarts them (the server from its storage, the
# trainer from its checkpoint); a clean end, a stop or a preemption notice does not.
supervise=".venv/bin/python -m inference_workers.preemption_watchdog --restart --"
# The trainer command is one word to the VM's shell (quoted with q), which bash -c then reads.
# A warm start runs under a watchdog of its own, so a stop reaches it (not only the shell),
# and the trainer starts once it has finished.
dir="$(q "$RLAX_PS_DIR")"
serve_cmd="$supervise .venv/bin/rlax-ps serve --port=$port --host=0.0.0.0 --storage_dir=\$HOME/rlax-ps-server ${SERVE_ARGS:-}"
if [[ -n "$warm_start" ]]; then
  train_cmd="bash -c $(q "$supervise $warm_start && exec $supervise $train_cmd")"
else
  train_cmd="$supervise bash -c $(q "$train_cmd")"
fi
gtpu ssh "$name" --worker=0 --command="cd $dir && $(detached "$serve_cmd" serve.log)" ||
  left_running "starting the server"
gtpu ssh "$name" --worker="$hosts" --command="cd $dir && $(detached "$train_cmd" train.log)" ||
  left_running "starting the trainer"
echo "trainer $name started${warm_start:+ (after the warm start in runs/rl/sft)}; server on host 0 port $port (tokens in ~/rlax-ps-server on host 0)"
