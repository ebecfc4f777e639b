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

# gvm: the same for plain Compute Engine VMs (a weight relay needs no accelerator).
gvm() {
  run gcloud compute "$@" --project="$TPU_PROJECT" --zone="$TPU_ZONE"
}

# ship_repo NAME [vm]: copy this checkout (as `git archive`, so no venvs or runs) to every
# host of TPU VM NAME and install it with the TPU extra (setup_vm.sh: Python 3.11+ in
# .venv); with `vm`, to Compute Engine VM NAME, without it. Its status is that of the first step that failed, also where the caller
# has turned `set -e` off.
ship_repo() {
  local name="$1" kind="${2:-tpu}" tarball status=0 extras="tpu,parquet"
  local install="mkdir -p $RLAX_PS_DIR && tar xzf rlax-ps.tar.gz -C $RLAX_PS_DIR && cd $RLAX_PS_DIR && bash tpu_scripts/setup_vm.sh"
  tarball="$(mktemp -t rlax-ps-XXXX.tar.gz)" || return 1
  if [[ "$kind" == "vm" ]]; then
    extras="parquet"
    copy() { gvm scp "$tarball" "$name:rlax-ps.tar.gz"; }
    remote() { gvm ssh "$name" --command="$1"; }
  else
    copy() { gtpu scp "$tarball" "$name:rlax-ps.tar.gz" --worker=all; }
    remote() { gtpu ssh "$name" --worker=all --command="$1"; }
  fi
  if ! { run git -C "$REPO_ROOT" archive --format=tar.gz -o "$tarball" "$RLAX_PS_REF" &&
         copy && remote "$install $extras"; }; then
    status=1
  fi
  rm -f "$tarball"
  return "$status"
}
