#!/usr/bin/env bash
# Create COUNT spot TPU VMs named PREFIX-0..PREFIX-(COUNT-1), each running one inference
# worker under the preemption watchdog (a preemption notice becomes SIGTERM: leases are
# released, nothing is lost; a hard kill loses nothing either because leases expire).
#
#   TPU_PROJECT=my-proj TPU_ZONE=us-central2-b SERVER_ADDRESS=10.0.0.2:50051 \
#   WORKER_TOKEN=... tpu_scripts/launch_workers.sh rlax-worker 8 v5litepod-4
#
# Env: WORKER_ARGS (more `rlax-ps worker` flags, at least --config=configs/...), DRY_RUN=1.
# shellcheck source=tpu_scripts/common.sh
source "$(dirname "$0")/common.sh"

prefix="${1:?usage: launch_workers.sh PREFIX COUNT ACCELERATOR_TYPE}"
count="${2:?usage: launch_workers.sh PREFIX COUNT ACCELERATOR_TYPE}"
accelerator="${3:?usage: launch_workers.sh PREFIX COUNT ACCELERATOR_TYPE}"
: "${SERVER_ADDRESS:?set SERVER_ADDRESS to the parameter server host:port}"
: "${WORKER_TOKEN:?set WORKER_TOKEN to the worker token of the server}"
[[ "$count" =~ ^[1-9][0-9]*$ ]] || { echo "COUNT: expected a positive integer, got '$count'" >&2; exit 2; }

for ((i = 0; i < count; i++)); do
  name="$prefix-$i"
  gtpu create "$name" --accelerator-type="$accelerator" --version="$TPU_RUNTIME" --spot
  ship_repo "$name"
  # The token travels in the environment of the remote command, never on its argv.
  gtpu ssh "$name" --worker=all --command="cd $RLAX_PS_DIR && RLAX_PS_WORKER_TOKEN='$WORKER_TOKEN' nohup .venv/bin/python -m inference_workers.preemption_watchdog -- .venv/bin/rlax-ps worker --address=$SERVER_ADDRESS ${WORKER_ARGS:-} > worker.log 2>&1 &"
done
echo "$count spot workers requested under prefix $prefix"
