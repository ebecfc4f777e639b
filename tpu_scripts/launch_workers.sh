#!/usr/bin/env bash
# Keep COUNT spot TPU VMs named PREFIX-0..PREFIX-(COUNT-1) running, each with one inference
# worker under the preemption watchdog (a preemption notice becomes SIGTERM: leases are
# released, nothing is lost; a hard kill loses nothing either because leases expire; a
# worker that crashes is started again). A multi-host TYPE (v5litepod-16, v4-32, ...) runs
# one worker over all the hosts of each slice (--coordinator_address=auto).
# One pass creates the VMs that are missing and deletes and recreates those that are
# PREEMPTED or TERMINATED; others (READY, CREATING, STOPPED by you, ...) are left alone.
# Rerunning it is safe. With KEEP_INTERVAL_S=N it makes a pass every N seconds until
# stopped, so the fleet refills as spot capacity returns.
#
#   TPU_PROJECT=my-proj TPU_ZONE=us-west4-a SERVER_ADDRESS=10.0.0.2:50051 \
#   WORKER_TOKEN=... tpu_scripts/launch_workers.sh rlax-worker 8 v5litepod-4
#
# Each worker decodes on every chip of its hosts (--devices=0: this flag wins over a config
# file's worker.devices; a --devices in WORKER_ARGS wins over it).
# Workers need the trainer's model settings: the same MODEL_URI (copied to ~/model on each VM,
# also those a later pass recreates, and given as --config.init_from_hf=$HOME/model), or the
# same --config.init_from_hf in WORKER_ARGS. rl_local's workers need none: the weights come
# from the parameter server, the model's shape from the recipe's model block.
# Env: WORKER_CONFIG (default configs/rl_local.py: the trainer's TRAIN_CONFIG default; give
# workers the recipe the trainer runs), WORKER_ARGS (more `rlax-ps worker` flags, a --config
# there wins; shell words, read once by the VM's shell: quote a value with spaces as on a
# command line), MODEL_URI,
# KEEP_INTERVAL_S, TPU_RUNTIME (default: the accelerator generation's image), DRY_RUN=1 (print the gcloud commands, run none: the listing then answers
# nothing, so every VM is created; TPU_STATES="NAME STATE" lines stands in for it).
# The worker token reaches each VM as an owner-only file (common.sh), not on any argv.
# shellcheck source=tpu_scripts/common.sh
source "$(dirname "$0")/common.sh"

prefix="${1:?usage: launch_workers.sh PREFIX COUNT ACCELERATOR_TYPE}"
count="${2:?usage: launch_workers.sh PREFIX COUNT ACCELERATOR_TYPE}"
accelerator="${3:?usage: launch_workers.sh PREFIX COUNT ACCELERATOR_TYPE}"
: "${SERVER_ADDRESS:?set SERVER_ADDRESS to the parameter server host:port}"
: "${WORKER_TOKEN:?set WORKER_TOKEN to the worker token of the server}"
[[ "$count" =~ ^[1-9][0-9]*$ ]] || { echo "COUNT: expected a positive integer, got '$count'" >&2; exit 2; }
# A multi-host slice runs one worker over all its hosts: one jax.distributed job whose
# host 0 talks to the server.
multi=""
single_host "$accelerator" || multi=" --coordinator_address=auto"
# WORKER_ARGS come after --devices=0 (every chip of each host) and --config: theirs win.
worker_cmd=".venv/bin/python -m inference_workers.preemption_watchdog --restart --"
worker_cmd+=" .venv/bin/rlax-ps worker --address=$(q "$SERVER_ADDRESS")"
worker_cmd+=" --token_file=\$HOME/$REMOTE_TOKEN_FILE --devices=0$multi"
worker_cmd+=" --config=$(q "${WORKER_CONFIG:-configs/rl_local.py}")"
check_model_settings WORKER_ARGS "${WORKER_ARGS:-}"
[[ -z "$MODEL_URI" ]] || worker_cmd+=" --config.init_from_hf=$REMOTE_MODEL_DIR"
worker_cmd+=" ${WORKER_ARGS:-}"
interval="${KEEP_INTERVAL_S:-}"
[[ -z "$interval" || "$interval" =~ ^[1-9][0-9]*$ ]] || {
  echo "KEEP_INTERVAL_S: expected a positive number of seconds, got '$interval'" >&2; exit 2; }

# start_worker NAME: create the spot VM, ship this checkout, start its worker. Each step is
# checked (this runs where `set -e` does not apply); a VM that was created but could not be
# set up is deleted, so the next pass creates it again rather than keeping an idle VM.
start_worker() {
  local name="$1"
  gtpu create "$name" --accelerator-type="$accelerator" --version="$(tpu_runtime "$accelerator")" --spot || return 1
  if ! { ship_repo "$name" && copy_model "$name" &&
         gtpu scp "$WORKER_TOKEN_FILE" "$name:$REMOTE_TOKEN_FILE" --worker=all &&
         gtpu ssh "$name" --worker=all --command="chmod 600 $REMOTE_TOKEN_FILE && cd $(q "$RLAX_PS_DIR") && $(detached "$worker_cmd" worker.log)"; }; then
    gtpu delete "$name" --quiet --async
    return 1
  fi
}

# "NAME STATE" for each TPU VM of the zone (TPU_STATES, if set, stands in for the listing).
list_states() {
  if [[ -v TPU_STATES ]]; then
    printf '%s\n' "$TPU_STATES"
  else
    gtpu list --format='value(name.basename(),state)'
  fi
}

# One pass; its status is 1 when any VM could not be started (the others still are).
keep_once() {
  local listing name state failed=0 i
  listing="$(list_states)" || { echo "listing the TPU VMs failed" >&2; return 1; }
  declare -A states=()
  while read -r name state; do
    [[ -n "$name" ]] && states["$name"]="$state"
  done <<< "$listing"
  for ((i = 0; i < count; i++)); do
    name="$prefix-$i"
    state="${states[$name]:-}"
    case "$state" in
      "") ;;
      PREEMPTED | TERMINATED) echo "$name is $state: recreating it" >&2
        gtpu delete "$name" --quiet || { failed=1; continue; } ;;
      *) continue ;;
    esac
    start_worker "$name" || {
      echo "$name: could not be started${interval:+; the next pass retries}" >&2; failed=1; }
  done
  return "$failed"
}

write_worker_token_file
if [[ -z "$interval" ]]; then
  keep_once
  echo "$count spot workers up under prefix $prefix (one pass: KEEP_INTERVAL_S keeps them up)"
else
  while true; do
    keep_once || true
    sleep "$interval" & wait "$!"  # in the background: a kill ends the wait at once
  done
fi
