#!/usr/bin/env bash
# Start a single-node SLURM dev cluster on this machine (run as root). Idempotent: when the
# cluster is already up with the same configuration, it only checks that the node is idle.
#
#   launch/slurm-dev-install.sh     # once: Debian packages slurmctld slurmd slurm-client munge
#   launch/slurm-dev-up.sh          # munged + slurmctld + slurmd; waits until the node is idle
#   sbatch / srun -n 4 hostname / python -m orchestrator ... cluster=slurm_dev
#   launch/slurm-dev-down.sh
#
# The node advertises max(8, nproc) CPUs (SLURM_DEV_CPUS overrides) so that 4-rank jobs run on
# a 2-core machine; see launch/slurm.conf.template for every choice.
# Environment: SLURM_DEV_CPUS, SLURM_DEV_MEMORY_MB, SLURM_DEV_WAIT_S (default 60),
#              SLURM_CONF (default /etc/slurm/slurm.conf).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
TEMPLATE="$HERE/slurm.conf.template"
CONF=${SLURM_CONF:-/etc/slurm/slurm.conf}
STATE_DIR=/var/lib/slurm
RUN_DIR=/run/slurm
LOG_DIR=/var/log/slurm
WAIT_S=${SLURM_DEV_WAIT_S:-60}
MARKER="# Single-node SLURM dev cluster, rendered by launch/slurm-dev-up.sh."

say() { echo "slurm-dev-up: $*"; }
die() { echo "slurm-dev-up: error: $*" >&2; exit 1; }

[[ $(id -u) -eq 0 ]] || die "run as root (slurmd must start job steps as the submitting user)"
for cmd in munged slurmctld slurmd scontrol sinfo srun; do
    command -v "$cmd" >/dev/null 2>&1 || die "'$cmd' not found; run launch/slurm-dev-install.sh first"
done

# pid_alive PIDFILE NAME: the pidfile names a live process called NAME
pid_alive() {
    local pidfile=$1 name=$2 pid
    [[ -s $pidfile ]] || return 1
    pid=$(cat "$pidfile" 2>/dev/null) || return 1
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    [[ -r /proc/$pid/comm ]] && [[ $(cat "/proc/$pid/comm") == "$name" ]]
}

# wait_for SECONDS DESCRIPTION COMMAND...: poll COMMAND every second, bounded
wait_for() {
    local seconds=$1 what=$2
    shift 2
    local i
    for ((i = 0; i < seconds; i++)); do
        if "$@" >/dev/null 2>&1; then return 0; fi
        sleep 1
    done
    return 1
}

# --- munge ---------------------------------------------------------------------------------
if [[ ! -s /etc/munge/munge.key ]]; then
    say "creating /etc/munge/munge.key"
    install -d -o munge -g munge -m 0700 /etc/munge
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
    chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
fi
munge_ok() { munge -n </dev/null | unmunge >/dev/null; }
if ! munge_ok 2>/dev/null; then
    say "starting munged"
    install -d -o munge -g munge -m 0755 /run/munge
    install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge 2>/dev/null || true
    runuser -u munge -- /usr/sbin/munged
    wait_for 15 munged munge_ok || die "munged did not answer within 15 s (see /var/log/munge/munged.log)"
fi

# --- slurm.conf ----------------------------------------------------------------------------
HOST=$(hostname -s)
NPROC=$(nproc)
CPUS=${SLURM_DEV_CPUS:-$((NPROC > 8 ? NPROC : 8))}
if [[ -n ${SLURM_DEV_MEMORY_MB:-} ]]; then
    MEM=$SLURM_DEV_MEMORY_MB
else
    MEM=$(slurmd -C 2>/dev/null | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' | head -1)
    [[ -n $MEM ]] || MEM=$(($(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024))
fi
install -d -m 0755 "$STATE_DIR" "$STATE_DIR/slurmctld" "$STATE_DIR/slurmd" "$RUN_DIR" "$LOG_DIR" "$(dirname "$CONF")"

rendered=$(mktemp)
trap 'rm -f "$rendered"' EXIT
sed -e "s|@HOST@|$HOST|g" -e "s|@CPUS@|$CPUS|g" -e "s|@REAL_MEMORY@|$MEM|g" \
    -e "s|@STATE_DIR@|$STATE_DIR|g" -e "s|@RUN_DIR@|$RUN_DIR|g" -e "s|@LOG_DIR@|$LOG_DIR|g" \
    -e "s|@SLURM_USER@|root|g" "$TEMPLATE" >"$rendered"

changed=0
if ! cmp -s "$rendered" "$CONF"; then
    changed=1
    if [[ -f $CONF ]] && ! grep -qF "$MARKER" "$CONF"; then
        backup="$CONF.bak.$(date +%Y%m%d%H%M%S)"
        say "keeping the existing (foreign) $CONF as $backup"
        cp -p "$CONF" "$backup"
    fi
    install -m 0644 "$rendered" "$CONF"
    say "wrote $CONF (node $HOST, CPUs=$CPUS on $NPROC cores, RealMemory=${MEM}MB)"
fi

# --- daemons -------------------------------------------------------------------------------
stop_daemon() {  # stop_daemon PIDFILE NAME: TERM the process the pidfile names, bounded wait
    local pidfile=$1 name=$2 pid
    pid_alive "$pidfile" "$name" || return 0
    pid=$(cat "$pidfile")
    say "stopping $name (pid $pid) to apply the new configuration"
    kill -TERM "$pid" 2>/dev/null || true
    wait_for 20 "$name exit" bash -c "! kill -0 $pid" || { kill -KILL "$pid" 2>/dev/null || true; }
}
if [[ $changed -eq 1 ]]; then
    stop_daemon "$RUN_DIR/slurmd.pid" slurmd
    stop_daemon "$RUN_DIR/slurmctld.pid" slurmctld
fi

if ! pid_alive "$RUN_DIR/slurmctld.pid" slurmctld; then
    say "starting slurmctld"
    slurmctld -f "$CONF"
fi
wait_for "$WAIT_S" "slurmctld" bash -c "scontrol ping | grep -q 'is UP'" \
    || die "slurmctld did not answer within ${WAIT_S} s (see $LOG_DIR/slurmctld.log)"

if ! pid_alive "$RUN_DIR/slurmd.pid" slurmd; then
    say "starting slurmd"
    slurmd -f "$CONF"
fi

node_state() { sinfo -h -N -n "$HOST" -o '%t' 2>/dev/null | head -1; }
node_usable() { [[ $(node_state) =~ ^(idle|mix|alloc|comp) ]]; }
for ((i = 0; i < WAIT_S; i++)); do
    state=$(node_state || true)
    case $state in
        idle | mix | alloc | comp*) break ;;
        down* | drain* | drng* | fail*)
            # a previous run left the node down (e.g. slurmd restarted); bring it back
            scontrol update NodeName="$HOST" State=RESUME >/dev/null 2>&1 || true ;;
    esac
    sleep 1
done
node_usable || die "node $HOST is '$(node_state)' after ${WAIT_S} s, not idle (see $LOG_DIR/slurmd.log; scontrol show node $HOST)"

say "up: partition dev, node $HOST ($(node_state)), $CPUS CPUs advertised"
sinfo
