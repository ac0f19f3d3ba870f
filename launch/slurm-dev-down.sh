#!/usr/bin/env bash
# Stop the SLURM dev cluster started by launch/slurm-dev-up.sh (run as root), either mode.
#   - every slurmd (pidfiles /run/slurm/slurmd*.pid) and slurmctld
#   - multi-node: every process left in the node namespaces slurm-node<i> (job steps, tasks),
#     the namespaces, their veth pairs, the bridge slurmbr0 and the slurm-dev block of /etc/hosts
#   - munged (SLURM_DEV_KEEP_MUNGE=1 leaves munged running)
# Single-node: running jobs are not cancelled; their state is kept in /var/lib/slurm, so the next
# slurm-dev-up.sh shows them as failed/requeued. Multi-node: jobs running on the nodes are
# cancelled first (their processes would die with the namespaces anyway); pending jobs stay
# queued. Safe to run when nothing is up.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
say() { echo "slurm-dev-down: $*"; }
# shellcheck source=launch/slurm-dev-lib.sh
source "$HERE/slurm-dev-lib.sh"

[[ $(id -u) -eq 0 ]] || { echo "slurm-dev-down: run as root" >&2; exit 1; }

# Multi-node: the job processes die with the namespaces below, which slurmctld would not notice:
# after the next slurm-dev-up.sh it would show those jobs RUNNING for minutes, holding their CPUs
# (the nodes did not reboot, so it does not purge them). So cancel the jobs running on the nodes
# first and wait (bounded) until slurmctld has seen them end. Partition dev goes DOWN before, so
# that no pending job starts meanwhile; pending jobs stay queued (slurm-dev-up.sh sets it UP).
# (Setting the nodes DOWN instead, to requeue, raced: slurmctld started a requeued job again.)
nodes=$(dev_netns_list | sed "s/^$DEV_NETNS_PREFIX/node/" | paste -sd, -)
if [[ -n $nodes ]] && pid_alive "$RUN_DIR/slurmctld.pid" slurmctld; then
    timeout 10 scontrol update PartitionName=dev State=DOWN >/dev/null 2>&1 || true
    active() { timeout 10 squeue -h -w "$nodes" -t RUNNING,COMPLETING,SUSPENDED,CONFIGURING -o %i 2>/dev/null; }
    jobs=$(active | paste -sd' ' -)
    if [[ -n $jobs ]]; then
        say "cancelling the jobs running on $nodes: $jobs"
        timeout 10 scancel -w "$nodes" 2>/dev/null || true
        wait_for 20 bash -c "[[ -z \$(squeue -h -w '$nodes' -t RUNNING,COMPLETING,SUSPENDED,CONFIGURING -o %i) ]]" \
            || say "warning: jobs still active after 20 s: $(active | paste -sd' ' -)"
    fi
fi
# Multi-node: TERM every process in the node namespaces (slurmd, slurmstepd, tasks) at once,
# KILL what is left after 3 s (slurmstepd and a slurmd busy ending jobs take longer, KillWait=10),
# then remove the namespaces, veths and bridge. Then slurmctld (and a single-node slurmd).
if command -v ip >/dev/null 2>&1; then
    remove_dev_network
fi
stop_slurm_daemons
set_hosts_block
if [[ ${SLURM_DEV_KEEP_MUNGE:-0} != 1 ]]; then
    stop_pidfile /run/munge/munged.pid munged
fi
say "down"
