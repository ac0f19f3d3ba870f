#!/usr/bin/env bash
# Stop the single-node SLURM dev cluster started by launch/slurm-dev-up.sh (run as root).
# Cancels nothing explicitly: running jobs die with slurmd; their state is kept in
# /var/lib/slurm, so the next slurm-dev-up.sh shows them as failed/requeued.
# SLURM_DEV_KEEP_MUNGE=1 leaves munged running.
set -euo pipefail

RUN_DIR=/run/slurm
say() { echo "slurm-dev-down: $*"; }

[[ $(id -u) -eq 0 ]] || { echo "slurm-dev-down: run as root" >&2; exit 1; }

stop_pidfile() {  # stop_pidfile PIDFILE NAME: TERM, bounded wait, then KILL
    local pidfile=$1 name=$2 pid i
    [[ -s $pidfile ]] || return 0
    pid=$(cat "$pidfile" 2>/dev/null || true)
    [[ $pid =~ ^[0-9]+$ ]] || return 0
    [[ -r /proc/$pid/comm && $(cat "/proc/$pid/comm") == "$name" ]] || return 0
    say "stopping $name (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 20; i++)); do
        kill -0 "$pid" 2>/dev/null || return 0
        sleep 1
    done
    say "$name did not exit within 20 s; killing it"
    kill -KILL "$pid" 2>/dev/null || true
}

stop_pidfile "$RUN_DIR/slurmd.pid" slurmd
stop_pidfile "$RUN_DIR/slurmctld.pid" slurmctld
if [[ ${SLURM_DEV_KEEP_MUNGE:-0} != 1 ]]; then
    stop_pidfile /run/munge/munged.pid munged
fi
say "down"
