# Shared by launch/slurm-dev-up.sh and launch/slurm-dev-down.sh (sourced, not run).
#
# The multi-node dev cluster, all on this machine (see launch/README.md):
#
#   host network namespace: slurmctld, munged, bridge slurmbr0 = 10.77.0.1/24 (name slurm-ctl)
#   node<i> (i = 1..N):     network namespace slurm-node<i> + UTS namespace (hostname node<i>),
#                           lo up, interface dev0 = 10.77.0.(10+i)/24, one slurmd -N node<i>;
#                           host end of its veth pair: veth-node<i>, a port of slurmbr0
#
# The namespaces have no default route, the host does no NAT and forwarding is left as it is:
# traffic on 10.77.0.0/24 stays between the host and the node namespaces.
# Names resolve through the host's /etc/hosts (a block between the marker lines below), which the
# namespaces share: no /etc/netns/<name>/ is created, so `ip netns exec` bind-mounts nothing over it.

STATE_DIR=/var/lib/slurm
RUN_DIR=/run/slurm
LOG_DIR=/var/log/slurm

DEV_BRIDGE=slurmbr0
DEV_IFNAME=dev0                       # the node end of every veth pair: GLOO/NCCL_SOCKET_IFNAME
DEV_NET=${SLURM_DEV_NET:-10.77.0}     # a /24; the host gets .1, node<i> gets .(10+i)
DEV_HOST_ADDR=$DEV_NET.1
DEV_HOST_NAME=slurm-ctl
DEV_NETNS_PREFIX=slurm-node           # network namespace of node<i>: slurm-node<i>
DEV_VETH_PREFIX=veth-node             # host end of node<i>'s veth pair: veth-node<i>
DEV_MAX_NODES=16
HOSTS_FILE=${SLURM_DEV_HOSTS_FILE:-/etc/hosts}
HOSTS_BEGIN="# BEGIN slurm-dev cluster (launch/slurm-dev-up.sh; removed by launch/slurm-dev-down.sh)"
HOSTS_END="# END slurm-dev cluster"

dev_node_name() { echo "node$1"; }
dev_node_addr() { echo "$DEV_NET.$((10 + $1))"; }
dev_node_netns() { echo "$DEV_NETNS_PREFIX$1"; }
dev_node_veth() { echo "$DEV_VETH_PREFIX$1"; }

# pid_alive PIDFILE NAME: the pidfile names a live process called NAME (NAME may be a|b)
pid_alive() {
    local pidfile=$1 name=$2 pid comm
    [[ -s $pidfile ]] || return 1
    pid=$(cat "$pidfile" 2>/dev/null) || return 1
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    comm=$(cat "/proc/$pid/comm" 2>/dev/null) || return 1
    [[ "|$name|" == *"|$comm|"* ]]
}

# wait_for SECONDS COMMAND...: poll COMMAND every 0.2 s until it succeeds, bounded
wait_for() {
    local seconds=$1 i
    shift
    for ((i = 0; i < seconds * 5; i++)); do
        if "$@" >/dev/null 2>&1; then return 0; fi
        sleep 0.2
    done
    return 1
}

# stop_pidfile PIDFILE NAME: TERM the process the pidfile names, bounded wait, then KILL
stop_pidfile() { stop_pidfiles "$2" "$1"; }

# stop_pidfiles NAME PIDFILE...: TERM every live process called NAME that a pidfile names, all at
# once (a slurmd takes ~1.5 s to exit), then wait for all of them (bounded), then KILL the rest
stop_pidfiles() {
    local name=$1 f pid i pids=()
    shift
    for f in "$@"; do
        if pid_alive "$f" "$name"; then
            pid=$(cat "$f")
            say "stopping $(cat "/proc/$pid/comm" 2>/dev/null || echo "$name") (pid $pid, $f)"
            kill -TERM "$pid" 2>/dev/null || true
            pids+=("$pid")
        fi
        rm -f "$f"
    done
    for ((i = 0; i < 100 && ${#pids[@]} > 0; i++)); do
        kill -0 "${pids[@]}" 2>/dev/null || {
            # some exited: keep those still alive
            local alive=()
            for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive+=("$pid"); done
            pids=("${alive[@]}")
            [[ ${#pids[@]} -gt 0 ]] || break
        }
        sleep 0.1
    done
    if [[ ${#pids[@]} -gt 0 ]]; then
        say "$name (pid ${pids[*]}) did not exit within 10 s; killing"
        kill -KILL "${pids[@]}" 2>/dev/null || true
        sleep 0.2
    fi
    return 0
}

# stop_all_slurmd: every slurmd that has a pidfile in RUN_DIR (single-node: slurmd-<host>.pid,
# multi-node: slurmd-node<i>.pid; slurmd.pid is the name used before multi-node mode existed)
stop_all_slurmd() {
    local files=()
    shopt -s nullglob
    files=("$RUN_DIR"/slurmd*.pid)
    shopt -u nullglob
    stop_pidfiles slurmd "${files[@]}"
}

# stop_slurm_daemons: every slurmd and slurmctld at once (each takes 1.5-2 s to exit)
stop_slurm_daemons() {
    local files=()
    shopt -s nullglob
    files=("$RUN_DIR"/slurmd*.pid "$RUN_DIR/slurmctld.pid")
    shopt -u nullglob
    stop_pidfiles "slurmd|slurmctld" "${files[@]}"
}

# dev_netns_list: the node namespaces that exist (slurm-node<i>), one a line
dev_netns_list() {
    ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${DEV_NETNS_PREFIX}[0-9]+$" || true
}

# netns_pids NETNS...: the processes in those namespaces, space-separated
netns_pids() {
    local ns
    for ns in "$@"; do ip netns pids "$ns" 2>/dev/null || true; done | tr '\n' ' ' | sed 's/ *$//'
}

# kill_netns_pids NETNS...: TERM every process in those namespaces (slurmd, slurmstepd, job
# tasks), wait up to 3 s, then KILL what is left (slurmstepd outlives TERM). A namespace is only
# gone once no process holds it.
kill_netns_pids() {
    local pids i
    pids=$(netns_pids "$@")
    [[ -n $pids ]] || return 0
    say "stopping the processes in $*: $pids"
    # shellcheck disable=SC2086
    kill -TERM $pids 2>/dev/null || true
    for ((i = 0; i < 30; i++)); do
        pids=$(netns_pids "$@")
        [[ -n $pids ]] || return 0
        sleep 0.1
    done
    say "killing what is left after 3 s: $pids"
    # shellcheck disable=SC2086
    kill -KILL $pids 2>/dev/null || true
    for ((i = 0; i < 50; i++)); do
        [[ -n $(netns_pids "$@") ]] || return 0
        sleep 0.1
    done
    say "warning: processes still in $*: $(netns_pids "$@")"
}

# remove_node_netns NETNS...: their processes, the namespaces, the host ends of their veth pairs
remove_node_netns() {
    local ns
    [[ $# -gt 0 ]] || return 0
    kill_netns_pids "$@"
    for ns in "$@"; do
        say "removing namespace $ns"
        ip netns del "$ns" 2>/dev/null || true
        # the veth pair goes with the namespace; remove the host end if it outlived it
        ip link del "$DEV_VETH_PREFIX${ns#"$DEV_NETNS_PREFIX"}" 2>/dev/null || true
    done
}

# ensure_dev_network NODES: the bridge (DEV_BRIDGE = DEV_HOST_ADDR/24), one network namespace per node
# 1..NODES with DEV_IFNAME = dev_node_addr i (host end of its veth pair on the bridge); namespaces of
# nodes beyond NODES (the cluster was bigger before) removed. Idempotent.
ensure_dev_network() {
    local nodes=$1 ns veth addr i extra=()
    if ! ip link show "$DEV_BRIDGE" >/dev/null 2>&1; then
        say "creating bridge $DEV_BRIDGE ($DEV_HOST_ADDR/24)"
        ip link add "$DEV_BRIDGE" type bridge
    fi
    ip -4 addr show dev "$DEV_BRIDGE" | grep -qF " $DEV_HOST_ADDR/24 " \
        || ip addr add "$DEV_HOST_ADDR/24" dev "$DEV_BRIDGE"
    ip link set "$DEV_BRIDGE" up
    for ns in $(dev_netns_list); do
        if ((${ns#"$DEV_NETNS_PREFIX"} > nodes)); then extra+=("$ns"); fi
    done
    remove_node_netns "${extra[@]}"
    for ((i = 1; i <= nodes; i++)); do
        ns=$(dev_node_netns "$i") veth=$(dev_node_veth "$i") addr=$(dev_node_addr "$i")
        if ! ip netns list | awk '{print $1}' | grep -qx "$ns"; then
            ip link del "$veth" 2>/dev/null || true   # a host end whose namespace is gone
            ip netns add "$ns"
        fi
        if ! ip -n "$ns" link show "$DEV_IFNAME" >/dev/null 2>&1; then
            say "creating namespace $ns: $DEV_IFNAME = $addr, host end $veth on $DEV_BRIDGE"
            ip link del "$veth" 2>/dev/null || true
            ip link add "$veth" type veth peer name "$DEV_IFNAME" netns "$ns"
        fi
        ip link set "$veth" master "$DEV_BRIDGE"
        ip link set "$veth" up
        ip -n "$ns" link set lo up
        ip -n "$ns" -4 addr show dev "$DEV_IFNAME" | grep -qF " $addr/24 " \
            || ip -n "$ns" addr add "$addr/24" dev "$DEV_IFNAME"
        ip -n "$ns" link set "$DEV_IFNAME" up
    done
}

# remove_dev_network: every node namespace, stray host-side veths, the bridge
remove_dev_network() {
    local link
    # shellcheck disable=SC2046
    remove_node_netns $(dev_netns_list)
    for link in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | sed 's/@.*//' \
        | grep -E "^${DEV_VETH_PREFIX}[0-9]+$" || true); do
        ip link del "$link" 2>/dev/null || true
    done
    if ip link show "$DEV_BRIDGE" >/dev/null 2>&1; then
        say "removing bridge $DEV_BRIDGE"
        ip link del "$DEV_BRIDGE"
    fi
}

# set_hosts_block [LINE...]: replace the block between the marker lines of HOSTS_FILE with LINEs
# (no LINE: remove the block). Writes in place (keeps the inode: /etc/hosts may be a bind mount)
# and only when the content changes.
set_hosts_block() {
    local new
    new=$(awk -v b="$HOSTS_BEGIN" -v e="$HOSTS_END" '
        $0 == b {skip = 1; next}
        $0 == e {skip = 0; next}
        !skip {print}' "$HOSTS_FILE")
    if [[ $# -gt 0 ]]; then
        new+=$'\n'"$HOSTS_BEGIN"
        local line
        for line in "$@"; do new+=$'\n'"$line"; done
        new+=$'\n'"$HOSTS_END"
    fi
    new+=$'\n'
    if [[ $new != "$(cat "$HOSTS_FILE")"$'\n' ]]; then
        printf '%s' "$new" >"$HOSTS_FILE"
        return 0
    fi
    return 0
}
