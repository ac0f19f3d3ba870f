#!/usr/bin/env bash
# Stop the dev cluster of hosts started by launch/hosts-dev-up.sh (run as root): every process in the
# namespaces host-node<i> (sshd, sessions, ranks), the namespaces, their veth pairs, the bridge hostsbr0
# and the hosts-dev block of /etc/hosts. The keys in /etc/orchestrator-hosts-dev stay. Safe when nothing is up.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
say() { echo "hosts-dev-down: $*"; }
# shellcheck source=launch/hosts-dev-lib.sh
source "$HERE/hosts-dev-lib.sh"

[[ $(id -u) -eq 0 ]] || { echo "hosts-dev-down: run as root" >&2; exit 1; }
shopt -s nullglob
for f in "$SSHD_RUN"/sshd-*.pid; do stop_pidfile "$f" sshd; done
shopt -u nullglob
remove_dev_network
set_hosts_block
say "down"
