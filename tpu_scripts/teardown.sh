#!/usr/bin/env bash
# Delete every TPU VM whose name starts with PREFIX (trainer or workers), without waiting.
#
#   TPU_PROJECT=my-proj TPU_ZONE=us-central2-b tpu_scripts/teardown.sh rlax-worker
# shellcheck source=tpu_scripts/common.sh
source "$(dirname "$0")/common.sh"

prefix="${1:?usage: teardown.sh NAME_PREFIX}"
if [[ -n "${TPU_NAMES:-}" ]]; then
  names="$TPU_NAMES"   # given explicitly (and in tests): skip the listing call
else
  names="$(gcloud compute tpus tpu-vm list --project="$TPU_PROJECT" --zone="$TPU_ZONE" \
           --format='value(name.basename())' --filter="name~^.*/$prefix")"
fi
for name in $names; do
  [[ "$name" == "$prefix"* ]] || continue
  gtpu delete "$name" --quiet --async
done
