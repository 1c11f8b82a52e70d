#!/usr/bin/env bash
# Stop the single-node test cluster started by scripts/slurm/start_cluster.sh: slurmctld, slurmd, munged.
# Jobs still queued or running are cancelled first. Installed packages, config and state stay in place,
# so start_cluster.sh brings the same cluster back quickly.
set -euo pipefail
export PATH=$PATH:/usr/sbin:/sbin
log() { printf '[slurm-stop %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }

RUN_DIR=/run/slurm

stop_pidfile() {  # stop_pidfile NAME PIDFILE: SIGTERM the daemon recorded in PIDFILE, wait up to 10 s
    local name=$1 pidfile=$2 pid
    pid=$(cat "$pidfile" 2>/dev/null) || { log "$name: no pid file"; return 0; }
    if [[ -z $pid ]] || ! kill -0 "$pid" 2>/dev/null || [[ $(cat "/proc/$pid/comm" 2>/dev/null) != "$name" ]]; then
        log "$name: not running"
        return 0
    fi
    log "stopping $name (pid $pid)"
    kill -TERM "$pid"
    for _ in $(seq 50); do
        kill -0 "$pid" 2>/dev/null || return 0
        sleep 0.2
    done
    log "$name (pid $pid) did not stop after 10 s; sending SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
}

if command -v scancel >/dev/null && scontrol ping >/dev/null 2>&1; then
    scancel --quiet --full --user=root 2>/dev/null || true
fi
stop_pidfile slurmd "$RUN_DIR/slurmd.pid"
stop_pidfile slurmctld "$RUN_DIR/slurmctld.pid"
stop_pidfile munged /run/munge/munged.pid
log "stopped"
