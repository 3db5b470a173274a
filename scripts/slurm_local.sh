#!/usr/bin/env bash
# A real single-node Slurm (slurmctld + slurmd) for tests and demos, in a directory of its own.
#
#   scripts/slurm_local.sh start     install Debian's slurmctld/slurmd/slurm-client if missing
#                                    (root), write the config, start both daemons, wait until the
#                                    node is idle
#   scripts/slurm_local.sh status    daemons, node state, queue
#   scripts/slurm_local.sh stop      end exactly the daemons `start` started (by PID)
#   scripts/slurm_local.sh env       print `export SLURM_CONF=...` for sbatch/squeue/scontrol
#
# Environment: HPCPS_SLURM_DIR (default /tmp/hpcps-slurm), HPCPS_SLURM_CPUS (CPUs the node
# advertises, default 8: the tests oversubscribe a 2-core machine), HPCPS_SLURM_PORT (slurmctld
# port, default 16817; slurmd uses the next one).
#
# Not for production: AuthType=auth/none, no cgroups, no accounting, everything as root.
set -euo pipefail

DIR=${HPCPS_SLURM_DIR:-/tmp/hpcps-slurm}
CPUS=${HPCPS_SLURM_CPUS:-8}
PORT=${HPCPS_SLURM_PORT:-16817}
CONF=$DIR/slurm.conf
HOST=$(hostname -s)

say() { echo "slurm_local: $*" >&2; }

install() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null; then
        return
    fi
    if [ "$(id -u)" != 0 ]; then
        say "slurmctld/slurmd/slurm-client are missing and installing them needs root"; exit 1
    fi
    say "installing slurmctld slurmd slurm-client (Debian packages)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q slurmctld slurmd slurm-client >"$DIR/apt.log" 2>&1 \
        || { apt-get update -q >>"$DIR/apt.log" 2>&1 && apt-get install -y -q slurmctld slurmd slurm-client >>"$DIR/apt.log" 2>&1; } \
        || { tail -20 "$DIR/apt.log" >&2; say "apt-get failed (log: $DIR/apt.log)"; exit 1; }
    # the packages may have started system daemons on the default ports; ours use their own
}

write_conf() {
    mkdir -p "$DIR/state" "$DIR/spool" "$DIR/log"
    local plugins
    plugins=$(dirname "$(find /usr/lib -name auth_none.so -path '*slurm*' 2>/dev/null | head -1)")
    cat >"$CONF" <<EOF
# written by scripts/slurm_local.sh; one node, no cgroups, no munge
ClusterName=hpcps-local
# job ids from the clock, not 1 each start: MPICH names a job's shared-memory file after the job and
# step number, and a file left by an earlier killed job 1.0 made a new job 1.0 spin in MPI_Init
FirstJobId=$(( $(date +%s) % 60000000 + 1000 ))
SlurmctldHost=$HOST
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
PluginDir=$plugins
AuthType=auth/none
CredType=cred/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
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
KillWait=30
MinJobAge=3600
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
NodeName=$HOST CPUs=$CPUS RealMemory=1000 State=UNKNOWN
PartitionName=local Nodes=$HOST Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
}

alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

# MPICH shared-memory files that no live process maps (left by killed jobs)
clean_shm() {
    local f
    for f in /dev/shm/mpich_shm_*; do
        [ -e "$f" ] || continue
        grep -qs "$f" /proc/[0-9]*/maps || rm -f "$f"
    done
}

start() {
    mkdir -p "$DIR"
    install
    export SLURM_CONF=$CONF
    if alive "$DIR/slurmctld.pid" && alive "$DIR/slurmd.pid"; then
        say "already running (slurmctld $(cat "$DIR/slurmctld.pid"), slurmd $(cat "$DIR/slurmd.pid"))"
    else
        stop_daemons quiet
        clean_shm
        write_conf
        local t0=$SECONDS
        slurmctld -f "$CONF" -c          # -c: a clean start, no jobs from an earlier run
        slurmd -f "$CONF" -N "$HOST"
        # slurmd registers; the node comes up idle
        for _ in $(seq 1 120); do
            state=$(sinfo -h -n "$HOST" -o %T 2>/dev/null || true)
            case "$state" in idle*|mixed*|alloc*) break ;; esac
            if [ "${state%%[*~#]*}" = down ] || [ "${state%%[*~#]*}" = drained ]; then
                scontrol update NodeName="$HOST" State=RESUME 2>/dev/null || true
            fi
            sleep 0.5
        done
        state=$(sinfo -h -n "$HOST" -o %T 2>/dev/null || true)
        case "$state" in
            idle*|mixed*|alloc*) say "node $HOST $state after $((SECONDS - t0)) s (slurmctld $(cat "$DIR/slurmctld.pid"), slurmd $(cat "$DIR/slurmd.pid"))" ;;
            *) say "node $HOST is '${state:-unknown}', not idle; logs in $DIR/log"; tail -5 "$DIR/log/"*.log >&2; exit 1 ;;
        esac
    fi
    echo "export SLURM_CONF=$CONF"
}

stop_daemons() {
    local pidfile pid
    for pidfile in "$DIR/slurmd.pid" "$DIR/slurmctld.pid"; do
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
    for d in slurmctld slurmd; do
        if alive "$DIR/$d.pid"; then echo "$d: running ($(cat "$DIR/$d.pid"))"; else echo "$d: not running"; fi
    done
    if alive "$DIR/slurmctld.pid"; then
        sinfo -N -o "%N %T %c" || true
        squeue || true
    fi
}

case "${1:-}" in
    start) start ;;
    stop) stop_daemons ;;
    status) status ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    *) echo "usage: $0 start|stop|status|env" >&2; exit 2 ;;
esac
