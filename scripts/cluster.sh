#!/usr/bin/env bash
# Pretend hosts on one machine, for trying and testing multi-node hpcps without a cluster.
#
#   scripts/cluster.sh up N [--split-cpus]   make hosts h0..h(N-1)
#   scripts/cluster.sh down [--force]        remove them (refused while processes run there, unless --force)
#   scripts/cluster.sh status                hosts, addresses, CPUs and how many processes run on each
#   scripts/cluster.sh exec HOST CMD...      run CMD on HOST
#   scripts/cluster.sh mpiexec-args HOSTS    print the mpiexec arguments that launch on HOSTS (h0,h1:2,...):
#                                            hydra's (MPICH, Intel MPI), or prterun's when $HPCPS_MPIEXEC
#                                            (else the mpiexec on PATH) is Open MPI's
#   scripts/cluster.sh mpiexec HOSTS ARGS... run `mpiexec <those arguments> ARGS` from the first of HOSTS
#                                            ($HPCPS_MPIEXEC, else the mpiexec on PATH)
#
# Each host has its own network, hostname and IPC namespace, joined by a private bridge that has no
# address in this machine's own network and no route out: traffic goes only between the hosts. Each
# launch on a host gets a fresh mount namespace with the cluster's /etc/hosts and the host's own
# /dev/shm, so MPI sees separate nodes (no shared memory between hosts; MPICH uses TCP between them).
# --split-cpus pins each host to its own CPUs (round robin); without it the hosts share all CPUs.
# Needs root. HPCPS_CLUSTER names the cluster (default "hpc", at most 8 letters and digits), so that
# several can exist at once; HPCPS_CLUSTER_NET is the first three bytes of the hosts' addresses
# (default 10.213.0). The launcher is the `ssh` subcommand of this script: it enters a host's
# namespaces instead of connecting anywhere (hydra's -launcher-exec, Open MPI's plm_ssh_agent).
set -euo pipefail

CL=${HPCPS_CLUSTER:-hpc}
NET=${HPCPS_CLUSTER_NET:-10.213.0}
SELF=$(readlink -f "$0")
STATE=/run/hpcps-cluster/$CL
SHM=$STATE/shm   # a tmpfs: each host's /dev/shm is a folder of it

die() { echo "cluster.sh: $*" >&2; exit 2; }

[[ $CL =~ ^[a-z][a-z0-9]{0,7}$ ]] || die "HPCPS_CLUSTER='$CL': use 1-8 lowercase letters and digits, starting with a letter"
[[ $NET =~ ^[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}$ ]] || die "HPCPS_CLUSTER_NET='$NET': give three bytes, e.g. 10.213.0"

need_root() { [[ $(id -u) == 0 ]] || die "needs root (network namespaces)"; }
hosts_of() { [[ -f $STATE/count ]] || die "no cluster '$CL' is up (scripts/cluster.sh up N)"; seq 0 $(( $(cat "$STATE/count") - 1 )) | sed 's/^/h/'; }
ns_inode() { stat -L -c %i "/run/netns/$CL-$1" 2>/dev/null || true; }

procs_on() {   # pids whose network namespace is host $1's
    local ino; ino=$(ns_inode "$1"); [[ -n $ino ]] || return 0
    local p
    for p in /proc/[0-9]*; do
        [[ $(readlink "$p/ns/net" 2>/dev/null) == "net:[$ino]" ]] && echo "${p#/proc/}"
    done
    return 0
}

cpus_for() {   # CPU list of host index $1 of $2, round robin over this machine's CPUs
    local i=$1 n=$2 ncpu c list=""
    ncpu=$(nproc --all)
    if (( n >= ncpu )); then echo $(( i % ncpu )); return; fi
    for (( c = i; c < ncpu; c += n )); do list+="${list:+,}$c"; done
    echo "$list"
}

teardown() {   # remove whatever of the cluster exists; never fails
    local h
    for h in $(ls /run/netns 2>/dev/null | sed -n "s/^$CL-\(h[0-9]*\)$/\1/p"); do
        ip netns del "$CL-$h" 2>/dev/null || true
    done
    ip link del "${CL}br" 2>/dev/null || true
    if [[ -d $STATE/ns ]]; then
        for f in "$STATE"/ns/*; do umount "$f" 2>/dev/null || true; done
        umount "$STATE/ns" 2>/dev/null || true
    fi
    umount "$SHM" 2>/dev/null || true
    rm -rf "$STATE"
    rmdir /run/hpcps-cluster 2>/dev/null || true
}

up() {
    need_root
    local n=${1:-}; shift || true
    local split=0
    [[ ${1:-} == --split-cpus ]] && split=1 && shift
    [[ $# == 0 ]] || die "up: unexpected '$*' (usage: up N [--split-cpus])"
    [[ $n =~ ^[0-9]+$ ]] && (( n >= 1 && n <= 64 )) || die "up: N must be 1..64, got '$n'"
    [[ ! -e $STATE ]] || die "cluster '$CL' is already up (scripts/cluster.sh down first)"
    trap 'echo "cluster.sh: up failed; undoing" >&2; teardown' ERR
    mkdir -p "$STATE/ns" "$SHM"
    mount -t tmpfs -o mode=0755 "hpcps-$CL" "$SHM"
    mount --bind "$STATE/ns" "$STATE/ns"
    mount --make-private "$STATE/ns"
    printf '127.0.0.1 localhost\n' > "$STATE/hosts"
    local i
    for (( i = 0; i < n; i++ )); do printf '%s.%d h%d\n' "$NET" $(( 10 + i )) "$i" >> "$STATE/hosts"; done
    ip link add "${CL}br" type bridge
    ip link set "${CL}br" up
    for (( i = 0; i < n; i++ )); do
        local h=h$i
        ip netns add "$CL-$h"
        ip link add "${CL}v$i" type veth peer name "${CL}p$i"
        ip link set "${CL}p$i" netns "$CL-$h"
        ip link set "${CL}v$i" master "${CL}br"
        ip link set "${CL}v$i" up
        ip -n "$CL-$h" link set "${CL}p$i" name eth0
        ip -n "$CL-$h" addr add "$NET.$(( 10 + i ))/24" dev eth0
        ip -n "$CL-$h" link set eth0 up
        ip -n "$CL-$h" link set lo up
        touch "$STATE/ns/$h.uts" "$STATE/ns/$h.ipc"
        nsenter --net="/run/netns/$CL-$h" unshare --uts="$STATE/ns/$h.uts" --ipc="$STATE/ns/$h.ipc" hostname "$h"
        mkdir -m 1777 "$SHM/$h"
        if (( split )); then cpus_for "$i" "$n" > "$STATE/cpus.$h"; fi
    done
    echo "$n" > "$STATE/count"
    trap - ERR
    status
}

down() {
    local force=0
    [[ ${1:-} == --force ]] && force=1
    [[ -e $STATE ]] || [[ -n $(ls /run/netns 2>/dev/null | grep "^$CL-h") ]] || { echo "cluster '$CL' is not up"; return 0; }
    local h pids busy=""
    for h in $(ls /run/netns 2>/dev/null | sed -n "s/^$CL-\(h[0-9]*\)$/\1/p"); do
        pids=$(procs_on "$h" | tr '\n' ' ')
        [[ -z $pids ]] && continue
        if (( force )); then kill -9 $pids 2>/dev/null || true; else busy+=" $h: $pids;"; fi
    done
    [[ -z $busy ]] || die "processes still run on the hosts (${busy% }); end them or use down --force"
    (( force )) && sleep 0.2
    teardown
    echo "cluster '$CL' removed"
}

status() {
    [[ -f $STATE/count ]] || die "no cluster '$CL' is up (scripts/cluster.sh up N)"
    local h
    for h in $(hosts_of); do
        printf '%s %s cpus=%s processes=%s\n' "$h" "$(awk -v h="$h" '$2 == h {print $1}' "$STATE/hosts")" \
            "$(cat "$STATE/cpus.$h" 2>/dev/null || echo all)" "$(procs_on "$h" | wc -l)"
    done
}

host_exec() {
    need_root
    local h=${1:-}; shift || true
    [[ -n $h ]] || die "exec: name a host"
    [[ -f $STATE/count ]] || die "no cluster '$CL' is up (scripts/cluster.sh up N)"
    [[ -e /run/netns/$CL-$h && -e $STATE/ns/$h.uts ]] || die "no host '$h' in cluster '$CL' (hosts: $(hosts_of | tr '\n' ' '))"
    [[ $# -gt 0 ]] || die "exec: give a command"
    local pin=()
    [[ -f $STATE/cpus.$h ]] && pin=(taskset -c "$(cat "$STATE/cpus.$h")")
    exec nsenter --net="/run/netns/$CL-$h" --uts="$STATE/ns/$h.uts" --ipc="$STATE/ns/$h.ipc" \
        unshare --mount --propagation private -- \
        sh -c 'mount --bind "$0/hosts" /etc/hosts && mount --bind "$1" /dev/shm && shift && exec "$@"' \
        "$STATE" "$SHM/$h" "${pin[@]}" "$@"
}

fake_ssh() {   # what hydra calls as its ssh: skip options, then HOST, then the command line
    while [[ $# -gt 0 && $1 == -* ]]; do
        case $1 in -[oplifFiJ]) shift 2 ;; *) shift ;; esac
    done
    local h=${1:-}; shift || true
    h=${h#*@}
    host_exec "$h" sh -c "$*"
}

launcher_kind() {   # "openmpi" when the launcher $1 is Open MPI's (prterun), else "hydra" (MPICH, Intel MPI)
    "$1" --version 2>/dev/null | grep -q -E "Open MPI|prterun|PRRTE" && echo openmpi || echo hydra
}

mpiexec_args() {   # mpiexec_args HOSTS [LAUNCHER]
    local list=${1:-} kind
    [[ -n $list ]] || die "mpiexec-args: give hosts, e.g. h0,h1 or h0:1,h1:2"
    local item
    for item in ${list//,/ }; do
        [[ -e /run/netns/$CL-${item%%:*} ]] || die "no host '${item%%:*}' in cluster '$CL'"
    done
    kind=$(launcher_kind "${2:-${HPCPS_MPIEXEC:-mpiexec}}")
    if [[ $kind == openmpi ]]; then
        # prterun starts its daemon (prted) on each host through this "ssh"; a host without a
        # slot count gets one slot, and more ranks than slots need :oversubscribe
        echo "--host $list --map-by :oversubscribe --bind-to none --prtemca plm_ssh_agent ${SELF%/*}/cluster-ssh"
    else
        echo "-launcher ssh -launcher-exec ${SELF%/*}/cluster-ssh -hosts $list"
    fi
}

run_mpiexec() {
    local list=${1:-}; shift || true
    local first=${list%%,*}; first=${first%%:*}
    local mpiexec=${HPCPS_MPIEXEC:-}
    [[ -n $mpiexec ]] || mpiexec=$(command -v mpiexec) || die "no mpiexec on PATH (activate .venv, or set HPCPS_MPIEXEC)"
    local args; args=$(mpiexec_args "$list" "$mpiexec")
    # shellcheck disable=SC2086
    host_exec "$first" env HPCPS_CLUSTER="$CL" "$mpiexec" $args "$@"
}

cmd=${1:-}; shift || true
case $cmd in
    up) up "$@" ;;
    down) down "$@" ;;
    status) status ;;
    exec) host_exec "$@" ;;
    ssh) fake_ssh "$@" ;;
    mpiexec-args) mpiexec_args "$@" ;;
    mpiexec) run_mpiexec "$@" ;;
    *) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$SELF"; [[ -z $cmd || $cmd == -h || $cmd == --help ]] || exit 2 ;;
esac
