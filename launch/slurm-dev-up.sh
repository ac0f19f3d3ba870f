#!/usr/bin/env bash
# Start a SLURM dev cluster on this machine (run as root). Idempotent: when the cluster is already
# up with the same configuration, it only checks that every node is idle.
#
#   launch/slurm-dev-install.sh        # once: Debian packages slurmctld slurmd slurm-client munge
#   launch/slurm-dev-up.sh             # multi-node (default 2 nodes): node1, node2, ... each a
#                                      # slurmd in its own network + UTS namespace on bridge slurmbr0
#   launch/slurm-dev-up.sh --single    # single-node: one slurmd in the host namespace (as before)
#   launch/slurm-dev-up.sh --nodes 3   # same as SLURM_DEV_NODES=3
#   sbatch / srun -N2 --ntasks-per-node=2 hostname / python -m orchestrator ... cluster=slurm_dev
#   launch/slurm-dev-down.sh
#
# Multi-node: slurmctld and munged stay in the host namespace; the bridge slurmbr0 has
# 10.77.0.1 (SlurmctldHost address, name slurm-ctl), node<i> has 10.77.0.(10+i) on interface dev0
# inside namespace slurm-node<i>. Names resolve through a marked block in /etc/hosts. Jobs see
# the host's filesystem (same mount tree), so python, the repo and submitit folders just work.
# Put GLOO_SOCKET_IFNAME=dev0 / NCCL_SOCKET_IFNAME=dev0 in multi-node jobs. See launch/README.md.
#
# Each node advertises SLURM_DEV_CPUS CPUs (multi-node default max(4, nproc) per node, single-node
# default max(8, nproc)) so 4-rank jobs run on a 2-core machine; see launch/slurm.conf.template.
# Environment: SLURM_DEV_NODES (default 2; 1 = single-node), SLURM_DEV_CPUS (per node),
#              SLURM_DEV_MEMORY_MB (per node; default the machine's memory / nodes),
#              SLURM_DEV_WAIT_S (default 60), SLURM_DEV_NET (default 10.77.0, a /24),
#              SLURM_CONF (default /etc/slurm/slurm.conf).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
say() { echo "slurm-dev-up: $*"; }
die() { echo "slurm-dev-up: error: $*" >&2; exit 1; }
# shellcheck source=launch/slurm-dev-lib.sh
source "$HERE/slurm-dev-lib.sh"

TEMPLATE="$HERE/slurm.conf.template"
CONF=${SLURM_CONF:-/etc/slurm/slurm.conf}
WAIT_S=${SLURM_DEV_WAIT_S:-60}
MARKER="rendered by launch/slurm-dev-up.sh"
NODES=${SLURM_DEV_NODES:-2}

while [[ $# -gt 0 ]]; do
    case $1 in
        --single) NODES=1 ;;
        --nodes) [[ $# -ge 2 ]] || die "--nodes needs a number"; NODES=$2; shift ;;
        --nodes=*) NODES=${1#--nodes=} ;;
        -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument '$1' (try --help)" ;;
    esac
    shift
done
[[ $NODES =~ ^[0-9]+$ ]] && ((NODES >= 1 && NODES <= DEV_MAX_NODES)) \
    || die "SLURM_DEV_NODES/--nodes must be 1..$DEV_MAX_NODES, not '$NODES'"
[[ $DEV_NET =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "SLURM_DEV_NET must be the first three octets of a /24 (e.g. 10.77.0), not '$DEV_NET'"

[[ $(id -u) -eq 0 ]] || die "run as root (slurmd must start job steps as the submitting user)"
needed=(munged slurmctld slurmd scontrol sinfo srun)
((NODES > 1)) && needed+=(ip nsenter unshare hostname)
for cmd in "${needed[@]}"; do
    command -v "$cmd" >/dev/null 2>&1 || die "'$cmd' not found; run launch/slurm-dev-install.sh first"
done
T0=$(date +%s.%N)

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
    wait_for 15 munge_ok || die "munged did not answer within 15 s (see /var/log/munge/munged.log)"
fi

# --- slurm.conf ----------------------------------------------------------------------------
HOST=$(hostname -s)
NPROC=$(nproc)
if ((NODES == 1)); then
    CPUS=${SLURM_DEV_CPUS:-$((NPROC > 8 ? NPROC : 8))}
else
    CPUS=${SLURM_DEV_CPUS:-$((NPROC > 4 ? NPROC : 4))}
fi
[[ $CPUS =~ ^[1-9][0-9]*$ ]] || die "SLURM_DEV_CPUS must be a positive number, not '$CPUS'"
if [[ -n ${SLURM_DEV_MEMORY_MB:-} ]]; then
    MEM=$SLURM_DEV_MEMORY_MB
else
    MEM=$(($(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / NODES))
fi
[[ $MEM =~ ^[1-9][0-9]*$ ]] || die "SLURM_DEV_MEMORY_MB must be a positive number, not '$MEM'"

node_names=()
if ((NODES == 1)); then
    CTLD_ADDR=127.0.0.1
    node_names=("$HOST")
    node_lines="NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM State=UNKNOWN"
    node_lines+=$'\n'"PartitionName=dev Nodes=$HOST Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO"
else
    CTLD_ADDR=$DEV_HOST_ADDR
    node_lines=""
    for ((i = 1; i <= NODES; i++)); do
        n=$(dev_node_name "$i")
        node_names+=("$n")
        node_lines+="NodeName=$n NodeHostname=$n NodeAddr=$(dev_node_addr "$i") CPUs=$CPUS RealMemory=$MEM State=UNKNOWN"$'\n'
    done
    node_lines+="PartitionName=dev Nodes=node[1-$NODES] Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO"
fi
install -d -m 0755 "$STATE_DIR" "$STATE_DIR/slurmctld" "$RUN_DIR" "$LOG_DIR" "$(dirname "$CONF")"
for n in "${node_names[@]}"; do install -d -m 0755 "$STATE_DIR/slurmd-$n"; done

rendered=$(mktemp)
trap 'rm -f "$rendered"' EXIT
sed -e "s|@HOST@|$HOST|g" -e "s|@CTLD_ADDR@|$CTLD_ADDR|g" \
    -e "s|@STATE_DIR@|$STATE_DIR|g" -e "s|@RUN_DIR@|$RUN_DIR|g" -e "s|@LOG_DIR@|$LOG_DIR|g" \
    -e "s|@SLURM_USER@|root|g" "$TEMPLATE" \
    | NODE_LINES=$node_lines awk '$0 == "@NODES@" {print ENVIRON["NODE_LINES"]; next} {print}' >"$rendered"

changed=0
if ! cmp -s "$rendered" "$CONF"; then
    changed=1
    if [[ -f $CONF ]] && ! grep -qF "$MARKER" "$CONF"; then
        backup="$CONF.bak.$(date +%Y%m%d%H%M%S)"
        say "keeping the existing (foreign) $CONF as $backup"
        cp -p "$CONF" "$backup"
    fi
fi

# A new configuration: stop the daemons first (they read slurm.conf at start).
if [[ $changed -eq 1 ]]; then
    stop_slurm_daemons
    install -m 0644 "$rendered" "$CONF"
    if ((NODES == 1)); then
        say "wrote $CONF (single node $HOST, CPUs=$CPUS on $NPROC cores, RealMemory=${MEM}MB)"
    else
        say "wrote $CONF ($NODES nodes node[1-$NODES], CPUs=$CPUS each on $NPROC cores, RealMemory=${MEM}MB each)"
    fi
fi

# --- network (multi-node) ------------------------------------------------------------------
if ((NODES == 1)); then
    # leftovers of a multi-node cluster: node namespaces (and their processes), bridge, hosts block
    if command -v ip >/dev/null 2>&1; then remove_dev_network; fi
    set_hosts_block
else
    ensure_dev_network "$NODES"

    hosts_lines=("$DEV_HOST_ADDR $DEV_HOST_NAME")
    for ((i = 1; i <= NODES; i++)); do hosts_lines+=("$(dev_node_addr "$i") $(dev_node_name "$i")"); done
    set_hosts_block "${hosts_lines[@]}"
fi

# --- daemons -------------------------------------------------------------------------------
if ! pid_alive "$RUN_DIR/slurmctld.pid" slurmctld; then
    say "starting slurmctld"
    slurmctld -f "$CONF"
fi
wait_for "$WAIT_S" bash -c "scontrol ping | grep -q 'is UP'" \
    || die "slurmctld did not answer within ${WAIT_S} s (see $LOG_DIR/slurmctld.log)"

if ((NODES == 1)); then
    if ! pid_alive "$RUN_DIR/slurmd-$HOST.pid" slurmd; then
        stop_all_slurmd   # e.g. slurmd.pid of an older version of this script
        say "starting slurmd"
        slurmd -N "$HOST" -f "$CONF"
    fi
else
    # munged's socket (/run/munge) is a file on the shared filesystem: reachable from a node namespace
    nsenter --net="/run/netns/$(dev_node_netns 1)" bash -c 'munge -n </dev/null | unmunge >/dev/null' \
        || die "munge does not work inside namespace $(dev_node_netns 1) (is /run/munge/munge.socket.2 there?)"
    started=()
    for ((i = 1; i <= NODES; i++)); do
        n=$(dev_node_name "$i") ns=$(dev_node_netns "$i") pidfile="$RUN_DIR/slurmd-$(dev_node_name "$i").pid"
        if pid_alive "$pidfile" slurmd; then
            # alive, but in the namespace of this name? (not if the namespace was deleted and re-made)
            [[ $(ip netns identify "$(cat "$pidfile")" 2>/dev/null) == "$ns" ]] && continue
            stop_pidfile "$pidfile" slurmd
        fi
        say "starting slurmd $n in namespace $ns (hostname $n, $(dev_node_addr "$i"))"
        # Own network namespace (nsenter --net) + own UTS namespace (unshare --uts) with hostname
        # node<i>; the mount namespace stays the host's. Not `ip netns exec`: it also makes a mount
        # namespace with a fresh /sys, without /sys/fs/cgroup, and slurmd 22.05 then fails with
        # "Unable to initialize cgroup plugin". slurmd daemonizes and writes $pidfile; job steps
        # inherit both namespaces.
        nsenter --net="/run/netns/$ns" unshare --uts -- /bin/sh -c 'hostname "$1" && exec slurmd -N "$1" -f "$2"' \
            sh "$n" "$CONF" || die "slurmd $n did not start (see $LOG_DIR/slurmd-$n.log)"
        started+=("$pidfile")
    done
    for pidfile in "${started[@]}"; do
        wait_for 15 pid_alive "$pidfile" slurmd \
            || die "slurmd did not write $pidfile within 15 s (see $LOG_DIR/slurmd-$(basename "$pidfile" .pid | sed 's/^slurmd-//').log)"
    done
fi

# slurm-dev-down.sh sets partition dev DOWN while it cancels the running jobs of a multi-node
# cluster (no pending job may start meanwhile); slurmctld may have saved that state.
[[ $(sinfo -h -p dev -o %a 2>/dev/null) == up ]] \
    || scontrol update PartitionName=dev State=UP >/dev/null 2>&1 || die "cannot set partition dev UP"

# --- wait until every node is usable -------------------------------------------------------
nodelist=$(IFS=,; echo "${node_names[*]}")
node_states() { sinfo -h -N -n "$nodelist" -o '%N %t' 2>/dev/null | sort -u; }
all_usable() {
    local states
    states=$(node_states)
    [[ $(wc -l <<<"$states") -eq ${#node_names[@]} ]] || return 1
    ! grep -qvE ' (idle|mix|alloc|comp)-?$' <<<"$states"
}
for ((t = 0; t < WAIT_S * 2; t++)); do
    all_usable && break
    while read -r name state; do
        case $state in
            down* | drain* | drng* | fail*)
                # a previous run left the node down (e.g. slurmd restarted); bring it back
                scontrol update NodeName="$name" State=RESUME >/dev/null 2>&1 || true ;;
        esac
    done < <(node_states)
    sleep 0.5
done
if ! all_usable; then
    die "not every node is idle after ${WAIT_S} s: $(node_states | tr '\n' ' ')(see $LOG_DIR/slurmd-<node>.log, $LOG_DIR/slurmctld.log; scontrol show node)"
fi

elapsed=$(awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN {printf "%.1f", b - a}')
if ((NODES == 1)); then
    say "up in ${elapsed} s: partition dev, single node $HOST, $CPUS CPUs advertised"
else
    say "up in ${elapsed} s: partition dev, nodes node[1-$NODES] at $(dev_node_addr 1)..$(dev_node_addr "$NODES"), $CPUS CPUs each; use GLOO_SOCKET_IFNAME=$DEV_IFNAME NCCL_SOCKET_IFNAME=$DEV_IFNAME"
fi
sinfo -N
