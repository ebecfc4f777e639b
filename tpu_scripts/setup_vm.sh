#!/usr/bin/env bash
# Run on a VM in the root of the shipped checkout: make .venv with Python 3.11+ and install
# rlax-ps with the extras given. Ubuntu 22.04 (the TPU runtimes' base) has Python 3.10, so
# python3.11 and its venv module come from the distribution first where python3 is older.
#
#   bash tpu_scripts/setup_vm.sh tpu,parquet
set -euo pipefail

extras="${1:-}"
# A new VM's unattended-upgrades holds dpkg's lock for minutes: apt-get waits for it
# (DPkg::Lock::Timeout). `update` fails at once on the package lists' lock (apt-daily's
# update) instead of waiting, so it is tried again, for as long.
apt_install() {
  local apt=(sudo DEBIAN_FRONTEND=noninteractive apt-get -qq -o DPkg::Lock::Timeout=600) tries=60
  until "${apt[@]}" update; do
    (( --tries > 0 )) || return 1
    sleep 10
  done
  "${apt[@]}" install -y "$@"
}

py=python3
if ! python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  py=python3.11
  command -v "$py" > /dev/null || apt_install python3.11 python3.11-venv
fi
if ! "$py" -m venv .venv; then  # the distribution packs the venv module apart
  apt_install "$("$py" -c 'import sys; print("python3.%d-venv" % sys.version_info[1])')"
  "$py" -m venv .venv
fi
.venv/bin/pip install -q -e ".${extras:+[$extras]}"
