#!/usr/bin/env bash
# Start the dev cluster of hosts on this machine (run as root): cluster=hosts_dev's hnode1, hnode2, ...
# Idempotent: what is up already is kept (a running sshd in its namespace, the key, the bridge).
#
#   launch/hosts-dev-up.sh [--nodes N]     # N network namespaces host-node<i> (default 2), each with an
#                                          # OpenSSH server (Debian's openssh-server, installed if missing),
#                                          # hostname hnode<i>, 10.78.0.(10+i) on bridge hostsbr0
#   ssh -i /etc/orchestrator-hosts-dev/id_ed25519 root@hnode1 hostname
#   python -m orchestrator +experiment=gpt_pp2_dp2 cluster=hosts_dev
#   launch/hosts-dev-down.sh
#
# The namespaces share this machine's file system (python, the repo, run directories just work). They are
# apart from the SLURM dev cluster (slurm-node<i>, slurmbr0, 10.77.0.0/24). Environment: HOSTS_DEV_NODES
# (default 2), HOSTS_DEV_NET (default 10.78.0, a /24).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
say() { echo "hosts-dev-up: $*"; }
die() { echo "hosts-dev-up: error: $*" >&2; exit 1; }
# shellcheck source=launch/hosts-dev-lib.sh
source "$HERE/hosts-dev-lib.sh"

NODES=${HOSTS_DEV_NODES:-2}
while [[ $# -gt 0 ]]; do
    case $1 in
        --nodes) [[ $# -ge 2 ]] || die "--nodes needs a number"; NODES=$2; shift ;;
        --nodes=*) NODES=${1#--nodes=} ;;
        -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument '$1' (try --help)" ;;
    esac
    shift
done
[[ $NODES =~ ^[0-9]+$ ]] && ((NODES >= 1 && NODES <= DEV_MAX_NODES)) || die "--nodes must be 1..$DEV_MAX_NODES, not '$NODES'"
[[ $(id -u) -eq 0 ]] || die "run as root (network namespaces, sshd)"
T0=$(date +%s.%N)

if [[ ! -x /usr/sbin/sshd ]] || ! command -v ssh >/dev/null 2>&1; then
    say "installing openssh-server openssh-client"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q openssh-server openssh-client >/dev/null \
        || die "apt-get install openssh-server openssh-client failed"
fi

# --- keys: one client key (root's login on every node), one host key, known_hosts -------------------
install -d -m 0700 "$KEY_DIR"
install -d -m 0755 "$SSHD_RUN" /run/sshd
[[ -s $KEY_DIR/id_ed25519 ]] || ssh-keygen -q -t ed25519 -N '' -C hosts-dev -f "$KEY_DIR/id_ed25519"
[[ -s $KEY_DIR/ssh_host_ed25519_key ]] || ssh-keygen -q -t ed25519 -N '' -C hosts-dev-host -f "$KEY_DIR/ssh_host_ed25519_key"
cp "$KEY_DIR/id_ed25519.pub" "$KEY_DIR/authorized_keys"
hostkey=$(cut -d' ' -f1,2 "$KEY_DIR/ssh_host_ed25519_key.pub")
: >"$KEY_DIR/known_hosts.new"
for ((i = 1; i <= NODES; i++)); do echo "$(dev_node_name "$i"),$(dev_node_addr "$i") $hostkey" >>"$KEY_DIR/known_hosts.new"; done
mv "$KEY_DIR/known_hosts.new" "$KEY_DIR/known_hosts"
cat >"$KEY_DIR/sshd_config" <<CONF
HostKey $KEY_DIR/ssh_host_ed25519_key
PermitRootLogin prohibit-password
PubkeyAuthentication yes
AuthorizedKeysFile $KEY_DIR/authorized_keys
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
MaxStartups 64:30:128
ClientAliveInterval 5
ClientAliveCountMax 3
CONF

# --- network: bridge, one namespace per node, /etc/hosts ---------------------------------------------
ensure_dev_network "$NODES"
hosts_lines=()
for ((i = 1; i <= NODES; i++)); do hosts_lines+=("$(dev_node_addr "$i") $(dev_node_name "$i")"); done
set_hosts_block "${hosts_lines[@]}"

# --- one sshd per node, in its namespace (own UTS namespace: hostname hnode<i>; mount namespace shared) ---
for ((i = 1; i <= NODES; i++)); do
    n=$(dev_node_name "$i") ns=$(dev_node_netns "$i") pidfile="$SSHD_RUN/sshd-$(dev_node_name "$i").pid"
    if pid_alive "$pidfile" sshd && [[ $(ip netns identify "$(cat "$pidfile")" 2>/dev/null) == "$ns" ]]; then
        continue
    fi
    stop_pidfile "$pidfile" sshd
    say "starting sshd $n in namespace $ns ($(dev_node_addr "$i"):22)"
    nsenter --net="/run/netns/$ns" unshare --uts -- /bin/sh -c 'hostname "$1" && exec /usr/sbin/sshd -f "$2" -o PidFile="$3" -o ListenAddress="$4"' \
        sh "$n" "$KEY_DIR/sshd_config" "$pidfile" "$(dev_node_addr "$i")" || die "sshd $n did not start"
done
ssh_ok() {
    ssh -o BatchMode=yes -o ConnectTimeout=5 -o UserKnownHostsFile="$KEY_DIR/known_hosts" -o StrictHostKeyChecking=yes \
        -i "$KEY_DIR/id_ed25519" "root@$1" true
}
for ((i = 1; i <= NODES; i++)); do
    wait_for 20 ssh_ok "$(dev_node_name "$i")" || die "ssh root@$(dev_node_name "$i") does not answer within 20 s"
done
elapsed=$(awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN {printf "%.1f", b - a}')
say "up in ${elapsed} s: hnode1..$(dev_node_name "$NODES") at $(dev_node_addr 1)..$(dev_node_addr "$NODES"), ssh key $KEY_DIR/id_ed25519"
