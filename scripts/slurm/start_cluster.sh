#!/usr/bin/env bash
# Start a real single-node SLURM cluster on this machine, for tests (tests/test_slurm.py) and CI.
#
#   sudo bash scripts/slurm/start_cluster.sh      # idempotent: installs, configures, starts, waits for idle
#   bash scripts/slurm/stop_cluster.sh            # stops the daemons this script started
#
# What it does (as root, on Debian; no systemd needed -- the daemons are started directly):
#   1. installs Debian's slurm-wlm and munge (apt-get update + install) if any of sbatch, slurmctld, slurmd,
#      munged, ... is missing; nothing is downloaded when they are all there;
#   2. creates a munge key and starts munged;
#   3. writes /etc/slurm/slurm.conf for ONE node (this host, CPUs and memory as `slurmd -C` reports them)
#      with container-friendly plugins (no cgroups, no accounting database) and a default partition `debug`;
#   4. starts slurmctld and slurmd and waits until `sinfo` shows the node idle.
# Every step prints what it does; on failure it prints the daemon logs and exits non-zero.
#
# Environment knobs (all optional):
#   SLURM_NODE_NAME      node name (default: `hostname -s`, falling back to localhost)
#   SLURM_START_TIMEOUT  seconds to wait for the node to become idle (default 60)
#   SLURM_LOG_DIR        daemon logs (default /var/log/slurm)
#   SLURM_CRED_EXPIRE    credential lifetime = delay before a requeued job may start again (default 10 s)
set -euo pipefail

log() { printf '[slurm-start %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
die() {
    log "ERROR: $*"
    # Everything that helps to see why: daemon logs, node state, the config.
    for f in "$LOG_DIR"/slurmctld.log "$LOG_DIR"/slurmd.log /var/log/munge/munged.log; do
        if [[ -f $f ]]; then
            echo "----- tail $f -----" >&2
            tail -n 30 "$f" >&2
        fi
    done
    if command -v sinfo >/dev/null; then
        echo "----- sinfo -----" >&2
        sinfo -N -l >&2 || true
    fi
    exit 1
}

[[ $(id -u) -eq 0 ]] || { echo "start_cluster.sh must run as root (it installs packages and starts daemons)" >&2; exit 1; }

CONF_DIR=/etc/slurm
CONF=$CONF_DIR/slurm.conf
LOG_DIR=${SLURM_LOG_DIR:-/var/log/slurm}
STATE_DIR=/var/spool/slurmctld
SPOOL_DIR=/var/spool/slurmd
RUN_DIR=/run/slurm
TIMEOUT=${SLURM_START_TIMEOUT:-60}
CRED_EXPIRE=${SLURM_CRED_EXPIRE:-10}
T0=$SECONDS

# ---------------------------------------------------------------------------------------------------
# 1. Packages.
# ---------------------------------------------------------------------------------------------------
export PATH=$PATH:/usr/sbin:/sbin
need_install() {  # true when any binary the cluster needs is missing
    local bin
    for bin in sbatch squeue sinfo scontrol srun slurmctld slurmd munged mungekey; do
        command -v "$bin" >/dev/null || return 0
    done
    return 1
}
if need_install; then
    export DEBIAN_FRONTEND=noninteractive
    pkgs=(slurm-wlm munge)
    apt_opts=(-y -q --no-install-recommends -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold)
    t=$SECONDS
    # Refresh the package lists first (under a second here): lists baked into a machine image go stale, and
    # installing a superseded version then fails with a 404. A failed refresh (e.g. an unreachable third-party
    # source) is not fatal: the install below still works from the lists already on the machine.
    log "apt-get update"
    apt-get update -q || log "apt-get update reported errors; trying the install with the current lists"
    log "installing ${pkgs[*]} from Debian (apt-get install --no-install-recommends)"
    apt-get install "${apt_opts[@]}" "${pkgs[@]}" || die "apt-get install ${pkgs[*]} failed"
    log "installed in $((SECONDS - t)) s"
    need_install && die "packages installed but some SLURM/munge binaries are still missing"
else
    log "slurm and munge already installed"
fi
log "slurm $(dpkg-query -W -f '${Version}' slurm-client)"

# ---------------------------------------------------------------------------------------------------
# 2. munge: a key and the daemon (as the munge user, which the Debian package creates).
# ---------------------------------------------------------------------------------------------------
install -d -o munge -g munge -m 0700 /etc/munge /var/lib/munge /var/log/munge
install -d -o munge -g munge -m 0755 /run/munge
if [[ ! -s /etc/munge/munge.key ]]; then
    log "creating the munge key"
    mungekey --create --keyfile=/etc/munge/munge.key
fi
chown munge:munge /etc/munge/munge.key
chmod 0400 /etc/munge/munge.key

munge_ok() { munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; }
if munge_ok; then
    log "munged already running"
else
    log "starting munged"
    rm -f /run/munge/munged.pid
    # munged forks into the background itself; --force: start even with a stale socket left behind.
    runuser -u munge -- /usr/sbin/munged --force
    for _ in $(seq 50); do
        munge_ok && break
        sleep 0.1
    done
    munge_ok || die "munged does not answer (munge -n | unmunge)"
fi

# ---------------------------------------------------------------------------------------------------
# 3. slurm.conf for one node: this host, its real CPUs and memory.
# ---------------------------------------------------------------------------------------------------
NODE=${SLURM_NODE_NAME:-$(hostname -s 2>/dev/null || true)}
if [[ -z $NODE ]] || ! getent hosts "$NODE" >/dev/null; then
    NODE=localhost   # the short hostname does not resolve: use a name that always does
fi
# `slurmd -C` prints e.g. "NodeName=vm CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1
# RealMemory=23995"; keep its topology and report slightly less memory than it sees, so that a little
# fluctuation never drains the node with "Low RealMemory".
HW=$(slurmd -C | head -n 1)
[[ $HW == NodeName=* ]] || die "unexpected output of slurmd -C: $HW"
hw_field() { sed -n "s/.*\b$1=\([0-9]*\).*/\1/p" <<<"$HW"; }
CPUS=$(hw_field CPUs)
MEM=$(( $(hw_field RealMemory) * 95 / 100 ))
TOPOLOGY="Boards=$(hw_field Boards) SocketsPerBoard=$(hw_field SocketsPerBoard) CoresPerSocket=$(hw_field CoresPerSocket) ThreadsPerCore=$(hw_field ThreadsPerCore)"

install -d -m 0755 "$CONF_DIR" "$LOG_DIR" "$STATE_DIR" "$SPOOL_DIR" "$RUN_DIR"
NEW_CONF=$(mktemp)
cat >"$NEW_CONF" <<CONF
# Written by scripts/slurm/start_cluster.sh: a single-node test cluster (no systemd, no cgroups, no slurmdbd).
ClusterName=moc-test
SlurmctldHost=$NODE
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# cred_expire (default 120 s) is also how long a requeued job waits (Reason=BeginTime) before it may run
# again; short here so that requeue tests do not idle for two minutes.
AuthInfo=cred_expire=$CRED_EXPIRE
CredType=cred/munge
MpiDefault=none
SwitchType=switch/none
# No cgroup setup (containers and small VMs often have no usable hierarchy): track processes by parent
# pid, bind nothing.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
# Run the main scheduling loop every 5 s (default 60 s): a requeued job whose BeginTime has passed is only
# started by that loop.
SchedulerParameters=sched_interval=5
# Cores and memory are the consumable resources; a job that asks for no memory gets 1 GiB per CPU.
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
DefMemPerCPU=1024
# No accounting database: sacct does not work here (use scontrol show job / squeue).
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$LOG_DIR/jobcomp.log
# Keep finished jobs visible to "scontrol show job" for an hour.
MinJobAge=3600
# A node that went DOWN (e.g. the machine restarted) comes back by itself once slurmd registers.
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=60
InactiveLimit=0
KillWait=10
StateSaveLocation=$STATE_DIR
SlurmdSpoolDir=$SPOOL_DIR
SlurmctldPidFile=$RUN_DIR/slurmctld.pid
SlurmdPidFile=$RUN_DIR/slurmd.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS $TOPOLOGY RealMemory=$MEM State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
CONF
CONF_CHANGED=0
if ! cmp -s "$NEW_CONF" "$CONF"; then
    log "writing $CONF (node $NODE: $CPUS CPUs, ${MEM} MB)"
    [[ -f $CONF ]] && { diff -u "$CONF" "$NEW_CONF" >&2 || true; }
    install -m 0644 "$NEW_CONF" "$CONF"
    CONF_CHANGED=1
fi
rm -f "$NEW_CONF"

# ---------------------------------------------------------------------------------------------------
# 4. slurmctld and slurmd (both fork into the background unless given -D).
# ---------------------------------------------------------------------------------------------------
running() {  # running NAME PIDFILE: the daemon whose pid is in PIDFILE is alive
    local pid
    pid=$(cat "$2" 2>/dev/null) || return 1
    [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null && [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$1" ]]
}
stop_daemon() {  # stop_daemon NAME: SIGTERM the daemon of our pid file and wait up to 10 s (then SIGKILL)
    local pidfile=$RUN_DIR/$1.pid pid
    running "$1" "$pidfile" || return 0
    pid=$(cat "$pidfile")
    kill -TERM "$pid"
    for _ in $(seq 50); do
        kill -0 "$pid" 2>/dev/null || return 0
        sleep 0.2
    done
    kill -KILL "$pid" 2>/dev/null || true
}
if (( CONF_CHANGED )); then
    # The daemons read slurm.conf at start; running jobs survive a restart (slurmstepd keeps them).
    if running slurmctld "$RUN_DIR/slurmctld.pid" || running slurmd "$RUN_DIR/slurmd.pid"; then
        log "slurm.conf changed: restarting the daemons"
        stop_daemon slurmd
        stop_daemon slurmctld
    fi
fi
if running slurmctld "$RUN_DIR/slurmctld.pid"; then
    log "slurmctld already running"
else
    log "starting slurmctld"
    slurmctld || die "slurmctld failed to start"
fi
if running slurmd "$RUN_DIR/slurmd.pid"; then
    log "slurmd already running"
else
    log "starting slurmd"
    # -N: the node name of slurm.conf, even when it is not this machine's hostname (the localhost fallback)
    slurmd -N "$NODE" || die "slurmd failed to start"
fi

# ---------------------------------------------------------------------------------------------------
# 5. Wait for the node to be idle (or busy with jobs, when the cluster was already up).
# ---------------------------------------------------------------------------------------------------
deadline=$((SECONDS + TIMEOUT))
state=""
while (( SECONDS < deadline )); do
    state=$(sinfo -h -N -n "$NODE" -o '%T' 2>/dev/null | head -n 1 || true)
    case $state in
        idle|mixed|allocated|completing) break ;;
        drained|draining|down|down\*|drained\*)
            # e.g. a node left down by an earlier run: ReturnToService=2 normally handles it
            scontrol update NodeName="$NODE" State=RESUME >/dev/null 2>&1 || true ;;
    esac
    sleep 1
done
case $state in
    idle|mixed|allocated|completing) ;;
    *) die "node $NODE is not idle after ${TIMEOUT} s (state: '${state:-no answer from slurmctld}')" ;;
esac
log "cluster up in $((SECONDS - T0)) s: node $NODE is $state"
sinfo >&2
