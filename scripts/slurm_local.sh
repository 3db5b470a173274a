#!/usr/bin/env bash
# A real Slurm (slurmctld + slurmd) for tests and demos, in a directory of its own.
#
#   scripts/slurm_local.sh start     install Debian's slurmctld/slurmd/slurm-client/libpmix-dev if missing
#                                    (root), write the config, start the daemons, wait until the
#                                    nodes are idle
#   scripts/slurm_local.sh start --cluster
#                                    a multi-node Slurm on the pretend hosts of scripts/cluster.sh
#                                    (cluster $HPCPS_CLUSTER, up first): one slurmd per host (node
#                                    hI at the host's address, spool and log of its own),
#                                    slurmctld on h0. Commands reach it from a host, e.g.
#                                    `scripts/cluster.sh exec h0 sbatch -N 2 slurm/train.sbatch`
#   scripts/slurm_local.sh status    daemons, node states, queue
#   scripts/slurm_local.sh stop      end exactly the daemons `start` started (by PID)
#   scripts/slurm_local.sh env       print `export SLURM_CONF=...` for sbatch/squeue/scontrol
#
# Environment: HPCPS_SLURM_DIR (default /tmp/hpcps-slurm), HPCPS_SLURM_CPUS (CPUs each node
# advertises, default 8: the tests oversubscribe a 2-core machine), HPCPS_SLURM_PORT (slurmctld
# port, default 16817; slurmd uses the next one).
#
# Not for production: AuthType=auth/none, no cgroups, no accounting, everything as root.
set -euo pipefail

DIR=${HPCPS_SLURM_DIR:-/tmp/hpcps-slurm}
CPUS=${HPCPS_SLURM_CPUS:-8}
PORT=${HPCPS_SLURM_PORT:-16817}
CONF=$DIR/slurm.conf
CLUSTER_SH=$(dirname "$(readlink -f "$0")")/cluster.sh

say() { echo "slurm_local: $*" >&2; }

# Where the daemons run: this machine, or the pretend hosts of the cluster named in $DIR/cluster
cluster() { cat "$DIR/cluster" 2>/dev/null || true; }
on() {   # on NODE CMD...: run CMD on NODE (a pretend host in cluster mode, else here)
    local node=$1; shift
    if [[ -n $(cluster) ]]; then HPCPS_CLUSTER=$(cluster) "$CLUSTER_SH" exec "$node" "$@"; else "$@"; fi
}
nodes() {   # "NAME ADDRESS" per node
    if [[ -n $(cluster) ]]; then awk '$2 ~ /^h[0-9]+$/ {print $2, $1}' "/run/hpcps-cluster/$(cluster)/hosts"
    else echo "$(hostname -s) $(hostname -s)"; fi
}
ctl_node() { nodes | head -1 | cut -d' ' -f1; }

install() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
        && dpkg -s libpmix-dev >/dev/null 2>&1; then
        return
    fi
    if [ "$(id -u)" != 0 ]; then
        say "slurmctld/slurmd/slurm-client/libpmix-dev are missing and installing them needs root"; exit 1
    fi
    # libpmix-dev: Slurm's mpi/pmix plugin opens libpmix.so, which libpmix2 alone does not provide
    # ("mpi/pmix_v4: can not load PMIx library"); Open MPI 5 starts under srun --mpi=pmix only
    local pkgs=(slurmctld slurmd slurm-client libpmix-dev)
    say "installing ${pkgs[*]} (Debian packages)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q "${pkgs[@]}" >"$DIR/apt.log" 2>&1 \
        || { apt-get update -q >>"$DIR/apt.log" 2>&1 && apt-get install -y -q "${pkgs[@]}" >>"$DIR/apt.log" 2>&1; } \
        || { tail -20 "$DIR/apt.log" >&2; say "apt-get failed (log: $DIR/apt.log)"; exit 1; }
    # the packages may have started system daemons on the default ports; ours use their own
}

write_conf() {
    mkdir -p "$DIR/state" "$DIR/log"
    local plugins ctl names name addr
    plugins=$(dirname "$(find /usr/lib -name auth_none.so -path '*slurm*' 2>/dev/null | head -1)")
    ctl=$(nodes | head -1 | awk '{print $1 "(" $2 ")"}')
    names=$(nodes | cut -d' ' -f1 | paste -sd,)
    cat >"$CONF" <<EOF
# written by scripts/slurm_local.sh; no cgroups, no munge; each slurmd has its own spool, log and pid
ClusterName=hpcps-local
# job ids from the clock, not 1 each start: MPICH names a job's shared-memory file after the job and
# step number, and a file left by an earlier killed job 1.0 made a new job 1.0 spin in MPI_Init
FirstJobId=$(( $(date +%s) % 60000000 + 1000 ))
SlurmctldHost=$ctl
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
PluginDir=$plugins
AuthType=auth/none
CredType=cred/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool-%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
KillWait=10
MinJobAge=3600
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
EOF
    while read -r name addr; do
        echo "NodeName=$name NodeAddr=$addr CPUs=$CPUS RealMemory=1000 State=UNKNOWN" >>"$CONF"
    done < <(nodes)
    echo "PartitionName=local Nodes=$names Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES" >>"$CONF"
    # srun --mpi=pmix makes a directory per job step named by uid, job and step in this base
    # (/tmp by default): pretend hosts share /tmp, and the second node's step failed on "File exists".
    # Each host's /dev/shm is its own (scripts/cluster.sh)
    echo "PMIxCliTmpDirBase=/dev/shm" >"$(dirname "$CONF")/mpi.conf"
}

alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
pidfiles() { ls "$DIR"/slurmctld.pid "$DIR"/slurmd-*.pid 2>/dev/null || true; }
all_alive() {
    local name addr
    alive "$DIR/slurmctld.pid" || return 1
    while read -r name addr; do alive "$DIR/slurmd-$name.pid" || return 1; done < <(nodes)
}

# MPICH shared-memory files that no live process maps (left by killed jobs), here and on the hosts
clean_shm() {
    local f
    for f in /dev/shm/mpich_shm_* /run/hpcps-cluster/"$(cluster)"/shm/*/mpich_shm_*; do
        [ -e "$f" ] || continue
        grep -qs "${f##*/}" /proc/[0-9]*/maps || rm -f "$f"
    done
}

wait_idle() {   # every node idle (a down or drained one left by an earlier run is resumed)
    local t0=$SECONDS name addr state bad=""
    for _ in $(seq 1 120); do
        bad=""
        while read -r name addr; do
            state=$(on "$(ctl_node)" sinfo -h -n "$name" -o %T 2>/dev/null || true)
            case "$state" in
                idle*|mixed*|alloc*) ;;
                down*|drain*) bad+=" $name"
                    on "$(ctl_node)" scontrol update NodeName="$name" State=RESUME 2>/dev/null || true ;;
                *) bad+=" $name" ;;
            esac
        done < <(nodes)
        [[ -z $bad ]] && { say "nodes $(nodes | cut -d' ' -f1 | paste -sd,) idle after $((SECONDS - t0)) s"; return; }
        sleep 0.5
    done
    say "nodes not idle:$bad; logs in $DIR/log"; tail -n 5 "$DIR/log/"*.log >&2; exit 1
}

start() {
    local mode=${1:-}
    mkdir -p "$DIR"
    install
    if [[ $mode == --cluster ]]; then
        local cl=${HPCPS_CLUSTER:-hpc}
        [[ -f /run/hpcps-cluster/$cl/count ]] || { say "no pretend cluster '$cl' is up (scripts/cluster.sh up N)"; exit 2; }
        [[ $(cluster) == "$cl" ]] || { stop_daemons quiet; echo "$cl" >"$DIR/cluster"; }
    elif [[ -n $mode ]]; then
        say "start: unknown option '$mode' (start [--cluster])"; exit 2
    elif [[ -n $(cluster) ]]; then
        stop_daemons quiet; rm -f "$DIR/cluster"
    fi
    export SLURM_CONF=$CONF
    if all_alive; then
        say "already running (slurmctld $(cat "$DIR/slurmctld.pid"))"
    else
        stop_daemons quiet
        clean_shm
        write_conf
        on "$(ctl_node)" slurmctld -f "$CONF" -c          # -c: a clean start, no jobs from an earlier run
        local name addr
        while read -r name addr; do on "$name" slurmd -f "$CONF" -N "$name"; done < <(nodes)
        wait_idle
    fi
    echo "export SLURM_CONF=$CONF"
}

stop_daemons() {
    local pidfile pid
    for pidfile in $(pidfiles); do
        if alive "$pidfile"; then
            pid=$(cat "$pidfile")
            kill "$pid" 2>/dev/null || true
            for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
            kill -9 "$pid" 2>/dev/null || true
            [ "${1:-}" = quiet ] || say "stopped $(basename "$pidfile" .pid) ($pid)"
        fi
        rm -f "$pidfile"
    done
}

status() {
    export SLURM_CONF=$CONF
    local f
    [[ -z $(cluster) ]] || echo "on the pretend hosts of cluster '$(cluster)' (commands: scripts/cluster.sh exec $(ctl_node) ...)"
    [[ -n $(pidfiles) ]] || echo "no daemons"
    for f in $(pidfiles); do
        if alive "$f"; then echo "$(basename "$f" .pid): running ($(cat "$f"))"; else echo "$(basename "$f" .pid): not running"; fi
    done
    if alive "$DIR/slurmctld.pid"; then
        on "$(ctl_node)" sinfo -N -o "%N %T %c" || true
        on "$(ctl_node)" squeue || true
    fi
}

case "${1:-}" in
    start) start "${2:-}" ;;
    stop) stop_daemons ;;
    status) status ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    *) echo "usage: $0 start [--cluster] | stop | status | env" >&2; exit 2 ;;
esac
