#!/usr/bin/env bash
# Delete every TPU VM whose name starts with PREFIX (trainer or workers), without waiting,
# and every relay VM of launch_relay.sh (label rlax_ps=relay) whose name starts with PREFIX.
# Other Compute Engine VMs are left alone, whatever their names.
#
#   TPU_PROJECT=my-proj TPU_ZONE=us-central2-b tpu_scripts/teardown.sh rlax-worker
#
# Env: DRY_RUN=1 (print the gcloud commands, run none: the listings then answer nothing;
# TPU_NAMES and RELAY_NAMES, space-separated names, stand in for them).
# shellcheck source=tpu_scripts/common.sh
source "$(dirname "$0")/common.sh"

prefix="${1:?usage: teardown.sh NAME_PREFIX}"
if [[ -v TPU_NAMES ]]; then
  names="$TPU_NAMES"
else
  names="$(gtpu list --format='value(name.basename())' --filter="name~^.*/$prefix")"
fi
if [[ -v RELAY_NAMES ]]; then
  relays="$RELAY_NAMES"
else
  relays="$(run gcloud compute instances list --project="$TPU_PROJECT" --zones="$TPU_ZONE" \
              --format='value(name)' --filter="name~^$prefix AND labels.$RELAY_LABEL")"
fi
for name in $names; do
  [[ "$name" == "$prefix"* ]] || continue
  gtpu delete "$name" --quiet --async
done
for name in $relays; do
  [[ "$name" == "$prefix"* ]] || continue
  gvm instances delete "$name" --quiet
done
