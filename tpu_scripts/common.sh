# shellcheck shell=bash
# Shared settings and helpers for the gcloud TPU VM scripts. Source it; do not run it.
# Every gcloud call goes through `run`, so DRY_RUN=1 prints each gcloud command on stdout
# and runs none: a listing (`gcloud ... list`) then answers nothing, so DRY_RUN shows what
# an empty zone would get (TPU_STATES, TPU_NAMES, RELAY_NAMES stand in for the listings).
# Files the scripts make (the repo tarball, the worker token file) live in one private
# temporary directory, removed on exit, Ctrl-C or kill.
set -euo pipefail

# bash_at_least MAJOR MINOR [HAVE_MAJOR HAVE_MINOR]: whether this bash (or the one given) is
# that recent. The scripts use [[ -v ]] (4.2) and associative arrays (4.0); macOS's
# /bin/bash is 3.2.
bash_at_least() {
  local major="${3:-${BASH_VERSINFO[0]}}" minor="${4:-${BASH_VERSINFO[1]}}"
  (( major > $1 || (major == $1 && minor >= $2) ))
}
bash_at_least 4 2 || {
  echo "tpu_scripts need bash >= 4.2, this is $BASH_VERSION (macOS: brew install bash, then" \
    "run them with that bash)" >&2
  exit 2; }

: "${TPU_PROJECT:?set TPU_PROJECT to your gcloud project id}"
: "${TPU_ZONE:?set TPU_ZONE, e.g. us-central2-b}"

# tpu_runtime ACCELERATOR_TYPE: the TPU VM image to create it with: TPU_RUNTIME if set, else
# its generation's (v5e, v5p and v6e have their own; v4 and older the Ubuntu base).
tpu_runtime() {
  if [[ -n "${TPU_RUNTIME:-}" ]]; then
    printf '%s' "$TPU_RUNTIME"
    return
  fi
  case "$1" in
    v5litepod-*|v5e-*) printf 'v2-alpha-tpuv5-lite' ;;
    v5p-*) printf 'v2-alpha-tpuv5' ;;
    v6e-*) printf 'v2-alpha-tpuv6e' ;;
    *) printf 'tpu-ubuntu2204-base' ;;
  esac
}

# single_host ACCELERATOR_TYPE: whether a slice of that type is one host. Every
# generation's single-host types end in a number <= 8 (v4-8, v5litepod-4, v6e-8); the
# others (v4-16, v5litepod-16, ...) span several, and JAX must run on each of them.
single_host() {
  [[ "$1" =~ -[1-8]$ ]]
}
RLAX_PS_REF="${RLAX_PS_REF:-HEAD}"          # git ref of this checkout to ship to the VMs
RLAX_PS_DIR="${RLAX_PS_DIR:-rlax-ps}"       # where it lands in the VM user's home
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck disable=SC2034  # used by the scripts that source this file
RELAY_LABEL="rlax_ps=relay"                 # marks the relay VMs teardown.sh may delete
# On exit: remove $SCRATCH and end the background jobs (launch_workers.sh's sleep).
cleanup() {
  local jobs
  rm -rf "${SCRATCH:-}"
  jobs="$(jobs -p)"
  # shellcheck disable=SC2086  # one word per job
  [[ -z "$jobs" ]] || kill $jobs 2> /dev/null || true
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
SCRATCH="$(mktemp -d -t rlax-ps-XXXXXX)"
exec 3>&1  # DRY_RUN's listing: to stdout also from inside $(...)

# run CMD...: run it, or with DRY_RUN=1 print it (shell-quoted) and output nothing.
run() {
  if [[ "${DRY_RUN:-0}" == "1" ]]; then
    { printf '+'; printf ' %q' "$@"; printf '\n'; } >&3
  else
    "$@" 3>&-
  fi
}

gtpu() {
  run gcloud compute tpus tpu-vm "$@" --project="$TPU_PROJECT" --zone="$TPU_ZONE"
}

# gvm: the same for plain Compute Engine VMs (a weight relay needs no accelerator).
gvm() {
  run gcloud compute "$@" --project="$TPU_PROJECT" --zone="$TPU_ZONE"
}

# q WORD: WORD as one word for the VM's shell (any POSIX shell): as it is when it holds
# nothing special, else in single quotes, each ' in it written '\''.
q() {
  if [[ "$1" =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then
    printf '%s' "$1"
  else
    printf "'%s'" "${1//\'/\'\\\'\'}"
  fi
}

# detached CMD LOG: the VM's shell words that start CMD (shell words) under nohup in the
# background, output to LOG, input from /dev/null. The job holds none of the ssh session's
# streams, so the remote shell and `gcloud ... ssh --command` (no tty) return at once; in
# `cd D && nohup CMD > LOG &` the backgrounded list keeps ssh's stdout open while CMD runs.
detached() {
  printf '{ nohup %s > %s 2>&1 < /dev/null & }' "$1" "$2"
}

# The worker token goes to the VMs as a file, never on a command line (not even gcloud's):
# WORKER_TOKEN_FILE, {"worker": $WORKER_TOKEN} in $SCRATCH (owner-only; printf is a shell
# builtin), is copied to REMOTE_TOKEN_FILE in the VM user's home, kept owner-only there
# (chmod 600), and given to `rlax-ps worker` / `relay` as --token_file.
WORKER_TOKEN_FILE="$SCRATCH/worker-token.json"
# shellcheck disable=SC2034  # used by the scripts that source this file
REMOTE_TOKEN_FILE="rlax-ps-worker-token.json"
write_worker_token_file() {
  local token="${WORKER_TOKEN//\\/\\\\}"
  [[ "$WORKER_TOKEN" != *[[:cntrl:]]* ]] || {
    echo "WORKER_TOKEN: expected no control characters (newline, tab, ...), got some" >&2
    return 2; }
  (umask 077 && printf '{"worker": "%s"}\n' "${token//\"/\\\"}" > "$WORKER_TOKEN_FILE")
}

# MODEL_URI: a model folder (HF checkpoint) in storage gcloud reads, e.g. gs://bucket/my-model,
# copied to REMOTE_MODEL_DIR on each host of a TPU VM: --config.init_from_hf reads a local
# folder only. REMOTE_MODEL_DIR is as the VM's shell expands it.
MODEL_URI="${MODEL_URI:-}"
REMOTE_MODEL_DIR="\$HOME/model"
# check_model_settings VAR ARGS: refuse (exit 2) a MODEL_URI that is no storage URL, or a
# --config.init_from_hf=URL in ARGS (the flags in the variable VAR) instead of MODEL_URI.
check_model_settings() {
  [[ -z "$MODEL_URI" || "$MODEL_URI" =~ ^[a-z][a-z0-9]*://[^/]+ ]] || {
    echo "MODEL_URI: expected a gcloud storage URL such as gs://bucket/my-model, got" \
      "'$MODEL_URI'" >&2
    exit 2; }
  [[ ! "$2" =~ --config\.init_from_hf=[\'\"]?[a-z][a-z0-9]*:// ]] || {
    echo "$1: --config.init_from_hf reads a folder on the VM, not a storage URL: set" \
      "MODEL_URI=gs://... instead (copied to $REMOTE_MODEL_DIR)" >&2
    exit 2; }
}
# copy_model NAME: MODEL_URI's files to REMOTE_MODEL_DIR on every host of TPU VM NAME (the
# VM's service account must be able to read them); nothing without MODEL_URI.
copy_model() {
  local files
  [[ -n "$MODEL_URI" ]] || return 0
  files="$(q "${MODEL_URI%/}/*")"  # the folder's files and subfolders, into the one made
  gtpu ssh "$1" --worker=all \
    --command="mkdir -p $REMOTE_MODEL_DIR && gcloud storage cp -r $files $REMOTE_MODEL_DIR"
}

# ship_repo NAME [vm]: copy this checkout (as `git archive`, so no venvs or runs) to every
# host of TPU VM NAME and install it with the TPU extra (setup_vm.sh: Python 3.11+ in
# .venv); with `vm`, to Compute Engine VM NAME, without it. Its status is that of the first
# step that failed, also where the caller has turned `set -e` off.
ship_repo() {
  local name="$1" kind="${2:-tpu}" tarball="$SCRATCH/rlax-ps.tar.gz" status=0 extras="tpu,parquet"
  local dir
  dir="$(q "$RLAX_PS_DIR")"
  local install="mkdir -p $dir && tar xzf rlax-ps.tar.gz -C $dir && cd $dir &&"
  install+=" bash tpu_scripts/setup_vm.sh"
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
