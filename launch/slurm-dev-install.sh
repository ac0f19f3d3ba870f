#!/usr/bin/env bash
# Install the Debian/Ubuntu packages of a single-node SLURM dev cluster (run as root).
# Idempotent: does nothing when every package is already installed.
#   launch/slurm-dev-install.sh
set -euo pipefail

PACKAGES=(slurmctld slurmd slurm-client munge)

if [[ $(id -u) -ne 0 ]]; then
    echo "slurm-dev-install: run as root (e.g. sudo $0)" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "slurm-dev-install: apt-get not found; install ${PACKAGES[*]} with your package manager" >&2
    exit 1
fi

missing=()
for p in "${PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$p")
    fi
done
if [[ ${#missing[@]} -eq 0 ]]; then
    echo "slurm-dev-install: already installed: ${PACKAGES[*]}"
    exit 0
fi

export DEBIAN_FRONTEND=noninteractive
echo "slurm-dev-install: installing ${missing[*]}"
apt-get update
apt-get install -y --no-install-recommends "${missing[@]}"
echo "slurm-dev-install: done"
