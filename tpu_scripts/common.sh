# shellcheck shell=bash
# Shared settings and helpers for the gcloud TPU VM scripts. Source it; do not run it.
# Every gcloud call goes through `run`, so DRY_RUN=1 prints the commands instead.
set -euo pipefail

: "${TPU_PROJECT:?set TPU_PROJECT to your gcloud project id}"
: "${TPU_ZONE:?set TPU_ZONE, e.g. us-central2-b}"
TPU_RUNTIME="${TPU_RUNTIME:-tpu-ubuntu2204-base}"
RLAX_PS_REF="${RLAX_PS_REF:-HEAD}"          # git ref of this checkout to ship to the VMs
RLAX_PS_DIR="${RLAX_PS_DIR:-rlax-ps}"       # where it lands in the VM user's home
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

run() {
  if [[ "${DRY_RUN:-0}" == "1" ]]; then
    printf '+'; printf ' %q' "$@"; printf '\n'
  else
    "$@"
  fi
}

gtpu() {
  run gcloud compute tpus tpu-vm "$@" --project="$TPU_PROJECT" --zone="$TPU_ZONE"
}

# ship_repo NAME: copy this checkout (as `git archive`, so no venvs or runs) to every host
# of TPU VM NAME and install it with the TPU extra. Its status is that of the first step that
# failed, also where the caller has turned `set -e` off.
ship_repo() {
  local name="$1" tarball status=0
  tarball="$(mktemp -t rlax-ps-XXXX.tar.gz)" || return 1
  if ! { run git -C "$REPO_ROOT" archive --format=tar.gz -o "$tarball" "$RLAX_PS_REF" &&
         gtpu scp "$tarball" "$name:rlax-ps.tar.gz" --worker=all &&
         gtpu ssh "$name" --worker=all --command="mkdir -p $RLAX_PS_DIR && tar xzf rlax-ps.tar.gz -C $RLAX_PS_DIR && cd $RLAX_PS_DIR && python3 -m venv .venv && .venv/bin/pip install -q -e '.[tpu,parquet]'"; }; then
    status=1
  fi
  rm -f "$tarball"
  return "$status"
}
