# Shared by launch/hosts-dev-up.sh and launch/hosts-dev-down.sh (sourced, not run).
#
# The dev cluster of hosts (cluster=hosts_dev), all on this machine, beside the SLURM one:
#
#   host network namespace: bridge hostsbr0 = 10.78.0.1/24
#   hnode<i> (i = 1..N):    network namespace host-node<i> + UTS namespace (hostname hnode<i>),
#                           interface hdev0 = 10.78.0.(10+i)/24, one OpenSSH server (root login by key);
#                           host end of its veth pair: veth-hnode<i>, a port of hostsbr0
#
# Same file system as the machine (the mount namespace is shared), names in a marked block of /etc/hosts.
# The namespace, veth, bridge and /etc/hosts helpers are launch/slurm-dev-lib.sh's, with these names.

HERE_LIB=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=launch/slurm-dev-lib.sh
source "$HERE_LIB/slurm-dev-lib.sh"

DEV_BRIDGE=hostsbr0
DEV_IFNAME=hdev0
DEV_NET=${HOSTS_DEV_NET:-10.78.0}
DEV_HOST_ADDR=$DEV_NET.1
DEV_NETNS_PREFIX=host-node
DEV_VETH_PREFIX=veth-hnode
HOSTS_BEGIN="# BEGIN hosts-dev cluster (launch/hosts-dev-up.sh; removed by launch/hosts-dev-down.sh)"
HOSTS_END="# END hosts-dev cluster"
KEY_DIR=/etc/orchestrator-hosts-dev            # client key, known_hosts, sshd config and host key
SSHD_RUN=/run/orchestrator-hosts-dev           # sshd pidfiles

dev_node_name() { echo "hnode$1"; }
