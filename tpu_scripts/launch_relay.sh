#!/usr/bin/env bash
# Create a Compute Engine VM in the workers' zone running a weight relay (`rlax-ps relay`):
# it pulls each version from the parameter server once, across the long link, and streams
# it on to the zone's workers as it arrives; their other calls pass through to the server.
# Not a spot VM: the workers' pulls depend on it (they fall back to the server while it is
# down). The token reaches the VM as an owner-only file (common.sh), not on any argv. The
# VM is labelled rlax_ps=relay: `teardown.sh PREFIX` deletes it when NAME starts with PREFIX.
#
#   TPU_PROJECT=my-proj TPU_ZONE=us-central2-b SERVER_ADDRESS=10.0.0.2:50051 \
#   WORKER_TOKEN=... tpu_scripts/launch_relay.sh rlax-relay
#
# Then start the zone's workers with
#   SERVER_ADDRESS=ipv4:RELAY_IP:RELAY_PORT,SERVER_IP:50051 tpu_scripts/launch_workers.sh ...
# (the relay's internal IP; the server should the relay not answer).
# Env: RELAY_MACHINE_TYPE (default e2-standard-8), RELAY_PORT (default 50052), RELAY_ARGS
# (more `rlax-ps relay` flags, e.g. --metrics_port=9090; shell words, read once by the VM's
# shell), DRY_RUN=1 (print the gcloud commands only).
# shellcheck source=tpu_scripts/common.sh
source "$(dirname "$0")/common.sh"

name="${1:?usage: launch_relay.sh NAME}"
: "${SERVER_ADDRESS:?set SERVER_ADDRESS to the parameter server host:port}"
: "${WORKER_TOKEN:?set WORKER_TOKEN to the worker token of the server}"
port="${RELAY_PORT:-50052}"
[[ "$port" =~ ^[0-9]+$ ]] || { echo "RELAY_PORT: expected a port number, got '$port'" >&2; exit 2; }
[[ "$SERVER_ADDRESS" != *,* ]] || {
  echo "SERVER_ADDRESS: expected the server's host:port, not a list, got '$SERVER_ADDRESS'" >&2; exit 2; }

write_worker_token_file
gvm instances create "$name" --machine-type="${RELAY_MACHINE_TYPE:-e2-standard-8}" \
  --image-family=ubuntu-2204-lts --image-project=ubuntu-os-cloud --boot-disk-size=200GB \
  --labels="$RELAY_LABEL"
ship_repo "$name" vm
gvm scp "$WORKER_TOKEN_FILE" "$name:$REMOTE_TOKEN_FILE"
# Under the watchdog: a crash restarts it, keeping what it fetched (its storage_dir).
supervise=".venv/bin/python -m inference_workers.preemption_watchdog --restart --"
relay_cmd="$supervise .venv/bin/rlax-ps relay --address=$(q "$SERVER_ADDRESS") --host=0.0.0.0 --port=$port --storage_dir=\$HOME/rlax-ps-relay --token_file=\$HOME/$REMOTE_TOKEN_FILE ${RELAY_ARGS:-}"
gvm ssh "$name" --command="chmod 600 $REMOTE_TOKEN_FILE && cd $(q "$RLAX_PS_DIR") && $(detached "$relay_cmd" relay.log)"
echo "relay $name started on port $port, following $SERVER_ADDRESS; workers: SERVER_ADDRESS=ipv4:<$name's internal IP>:$port,$SERVER_ADDRESS"
