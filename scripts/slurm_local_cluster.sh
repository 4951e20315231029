#!/usr/bin/env bash
# A real two-node Slurm cluster on this machine, for tests (see shared/reference/slurm.md).
#
#   scripts/slurm_local_cluster.sh start | status | stop
#
# Debian's slurmctld, two slurmd in "multiple slurmd" mode (nodes n1 and n2, both on 127.0.0.1,
# ports 17021-17022) and munged, started by hand: no systemd, no cgroups. Needs root: it installs
# the packages when missing, writes /etc/slurm/{slurm,cgroup}.conf and adds a tagged /etc/hosts
# line so the node names resolve. Every daemon is stopped through its PID file, munged only if
# this script started it. A start wipes the previous cluster state (jobs, node state, logs).
#
# Environment:
#   SLURM_LOCAL_ROOT     state, logs and PID files (default /tmp/moe-train-slurm)
#   SLURM_LOCAL_CPUS     CPUs per node (default 2)
#   SLURM_LOCAL_TIMEOUT  seconds to wait for the controller and the nodes (default 30)
#
# Exit status: 0 ok; 1 error; 3 Slurm is missing and cannot be installed (not root, no apt-get,
# or apt-get failed), which tests treat as a reason to skip.
set -euo pipefail

ROOT=${SLURM_LOCAL_ROOT:-/tmp/moe-train-slurm}
CPUS=${SLURM_LOCAL_CPUS:-2}
TIMEOUT=${SLURM_LOCAL_TIMEOUT:-30}
NODES=(n1 n2)
PACKAGES=(slurmctld slurmd slurm-client munge)
MARKER="# moe-train-slurm-local"
MUNGE_PID=/run/munge/munged.pid
MUNGE_OURS=$ROOT/run/munged.started

log() { echo "slurm-local: $*" >&2; }
die() { log "error: $*"; exit 1; }
cannot_install() { log "cannot install Slurm: $*"; exit 3; }

# Succeeds if process $1 exists, is named $2 (so a reused PID is never taken for ours) and is
# not a zombie (PID 1 here may be slow to reap killed daemons).
proc_alive() {
    [ "$(cat "/proc/$1/comm" 2>/dev/null)" = "$2" ] || return 1
    [ "$(sed -n 's/^State:[[:space:]]*\(.\).*/\1/p' "/proc/$1/status" 2>/dev/null)" != Z ]
}

# Prints the PID recorded in file $1 if that process is alive and named $2.
running_pid() {
    local pid
    pid=$(cat "$1" 2>/dev/null) || return 1
    [[ $pid =~ ^[0-9]+$ ]] && proc_alive "$pid" "$2" && echo "$pid"
}

# Waits up to $3 tenths of a second for process $1 (daemon $2) to exit; fails if it is still alive.
await_exit() {
    local i
    for ((i = 0; i < $3; i++)); do
        proc_alive "$1" "$2" || return 0
        sleep 0.1
    done
    return 1
}

# Stops the daemon named $2 whose PID file is $1: SIGTERM, then SIGKILL after 15 s. The PID is
# read before signalling because the daemons delete their PID files as they exit.
stop_daemon() {
    local pid
    pid=$(running_pid "$1" "$2") || return 0
    kill -TERM "$pid" 2>/dev/null || true
    await_exit "$pid" "$2" 150 && return 0
    log "$2 (pid $pid) ignored SIGTERM for 15 s; sending SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
    await_exit "$pid" "$2" 50 || die "$2 (pid $pid) survived SIGKILL"
}

slurm_running() {
    local node
    running_pid "$ROOT/run/slurmctld.pid" slurmctld >/dev/null || return 1
    for node in "${NODES[@]}"; do
        running_pid "$ROOT/run/slurmd-$node.pid" slurmd >/dev/null || return 1
    done
}

install_packages() {
    local installed own_policy='' rc=0
    installed=$(dpkg-query -W -f='${Status}\n' "${PACKAGES[@]}" 2>/dev/null | grep -c 'install ok installed' || true)
    [ "$installed" != "${#PACKAGES[@]}" ] || return 0
    command -v apt-get >/dev/null || cannot_install "apt-get not found"
    log "installing ${PACKAGES[*]} (log: $ROOT/log/apt.log)"
    # The postinst scripts try to start the services; a policy-rc.d exiting 101 forbids that.
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 0755 /usr/sbin/policy-rc.d
        own_policy=1
    fi
    {
        apt-get -q -o DPkg::Lock::Timeout=120 update &&
            DEBIAN_FRONTEND=noninteractive apt-get -q -y -o DPkg::Lock::Timeout=120 \
                install --no-install-recommends "${PACKAGES[@]}"
    } >"$ROOT/log/apt.log" 2>&1 || rc=$?
    [ -z "$own_policy" ] || rm -f /usr/sbin/policy-rc.d
    if [ "$rc" != 0 ]; then
        tail -n 20 "$ROOT/log/apt.log" >&2
        cannot_install "apt-get failed with exit status $rc"
    fi
}

setup_munge() {
    [ -s /etc/munge/munge.key ] || mungekey --create --keyfile=/etc/munge/munge.key
    chown munge:munge /etc/munge /etc/munge/munge.key /var/log/munge /var/lib/munge
    chmod 0700 /etc/munge /var/log/munge
    chmod 0711 /var/lib/munge
    chmod 0600 /etc/munge/munge.key
    # Without systemd nothing creates the runtime directory.
    install -d -o munge -g munge -m 0755 /run/munge
    if ! running_pid "$MUNGE_PID" munged >/dev/null; then
        runuser -u munge -- /usr/sbin/munged </dev/null ||
            runuser -u munge -- /usr/sbin/munged --force </dev/null ||
            die "munged did not start; see /var/log/munge/munged.log"
        touch "$MUNGE_OURS"
    fi
    munge -n | unmunge >/dev/null || die "munge -n | unmunge failed; see /var/log/munge/munged.log"
}

slurm_conf() {
    local host
    host=$(hostname)
    cat <<EOF
$MARKER: written by scripts/slurm_local_cluster.sh on every start
ClusterName=moelocal
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobRequeue=0
MailProg=/bin/true
SchedulerParameters=batch_sched_delay=0
StateSaveLocation=$ROOT/state/ctld
SlurmdSpoolDir=$ROOT/state/%n
SlurmctldPidFile=$ROOT/run/slurmctld.pid
SlurmdPidFile=$ROOT/run/slurmd-%n.pid
SlurmctldLogFile=$ROOT/log/slurmctld.log
SlurmdLogFile=$ROOT/log/slurmd-%n.log
EOF
    if [ "$CPUS" -gt "$(nproc)" ]; then
        # Otherwise each slurmd finds fewer CPUs than configured and its node drains as INVAL.
        echo "SlurmdParameters=config_overrides"
    fi
    echo "NodeName=n[1-${#NODES[@]}] NodeHostname=$host NodeAddr=127.0.0.1 Port=17021-$((17020 + ${#NODES[@]})) CPUs=$CPUS RealMemory=1000 State=UNKNOWN"
    echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
}

# Writes /etc/slurm/$1 with content $2, first keeping a config this script did not write.
write_conf() {
    local file=/etc/slurm/$1
    if [ -e "$file" ] && ! grep -qF "$MARKER" "$file" && [ ! -e "$file.pre-slurm-local" ]; then
        cp -p "$file" "$file.pre-slurm-local"
    fi
    printf '%s\n' "$2" >"$file"
}

# Rewrites /etc/hosts without our tagged line, then appends $1 if given. The file is written in
# place, not replaced (no sed -i), because it may be a bind mount.
set_hosts_line() {
    local kept
    kept=$(grep -vF "$MARKER" /etc/hosts) || [ $? = 1 ]
    {
        [ -z "$kept" ] || printf '%s\n' "$kept"
        [ -z "${1:-}" ] || printf '%s\n' "$1"
    } >/etc/hosts
}

print_logs() {
    local f
    sinfo -R >&2 2>/dev/null || true
    for f in "$ROOT"/log/slurmctld.log "$ROOT"/log/slurmd-*.log; do
        [ -e "$f" ] || continue
        echo "----- $f (last 30 lines)" >&2
        tail -n 30 "$f" >&2
    done
}

wait_for() {
    local what=$1 deadline=$((SECONDS + TIMEOUT))
    shift
    until "$@"; do
        if [ "$SECONDS" -ge "$deadline" ]; then
            print_logs
            die "$what not reached within $TIMEOUT s (SLURM_LOCAL_TIMEOUT)"
        fi
        sleep 0.2
    done
}

controller_up() { scontrol ping 2>/dev/null | grep -q 'is UP'; }

# Succeeds once every node is usable: idle, or running jobs when an existing cluster is reused.
# Fails the whole start at once if a node is drained, invalid or failed (e.g. too many CPUs).
nodes_ready() {
    local states
    states=$(sinfo -h -N -o '%N %t' 2>/dev/null) || return 1
    if grep -qE ' (inval|drain|drng|fail)' <<<"$states"; then
        print_logs
        die "a node is unusable: $(tr '\n' ' ' <<<"$states")"
    fi
    [ "$(grep -cE ' (idle|mix|alloc)$' <<<"$states")" = "${#NODES[@]}" ]
}

any_slurmd_running() {
    local node
    for node in "${NODES[@]}"; do
        ! running_pid "$ROOT/run/slurmd-$node.pid" slurmd >/dev/null || return 0
    done
    return 1
}

stop_slurm() {
    local node i
    if ! running_pid "$ROOT/run/slurmctld.pid" slurmctld >/dev/null && any_slurmd_running; then
        # slurmctld died (e.g. kill -9) while its nodes may run jobs, whose step daemons ignore
        # SIGTERM and outlive slurmd: restart it on its saved state so the jobs can be cancelled.
        slurmctld -i </dev/null 2>/dev/null || true
        for ((i = 0; i < 25; i++)); do
            ! controller_up || break
            sleep 0.2
        done
    fi
    if running_pid "$ROOT/run/slurmctld.pid" slurmctld >/dev/null; then
        # Cancel jobs while the daemons still run, so that Slurm ends their processes.
        scancel --quiet --partition=debug 2>/dev/null || true
        for ((i = 0; i < 50; i++)); do
            [ -n "$(squeue -h -o %i 2>/dev/null)" ] || break
            sleep 0.2
        done
    fi
    for node in "${NODES[@]}"; do
        stop_daemon "$ROOT/run/slurmd-$node.pid" slurmd
    done
    stop_daemon "$ROOT/run/slurmctld.pid" slurmctld
}

start() {
    local conf node hosts_line
    [ "$(id -u)" = 0 ] || cannot_install "must run as root (packages, /etc/slurm, /etc/hosts)"
    mkdir -p "$ROOT/run" "$ROOT/log"
    install_packages
    setup_munge
    hosts_line="127.0.0.1 ${NODES[*]} $MARKER"
    grep -qxF "$hosts_line" /etc/hosts || set_hosts_line "$hosts_line"
    conf=$(slurm_conf)
    if slurm_running && [ "$conf" = "$(cat /etc/slurm/slurm.conf)" ]; then
        wait_for "all nodes up" nodes_ready
        log "already running"
        return
    fi
    stop_slurm
    write_conf slurm.conf "$conf"
    # Pin v1: autodetect would pick cgroup/v2 on pure v2 hosts, which needs systemd over dbus.
    write_conf cgroup.conf "$MARKER
CgroupPlugin=cgroup/v1"
    rm -rf "$ROOT/state" "$ROOT"/log/slurm*.log
    mkdir -p "$ROOT/state/ctld"
    slurmctld </dev/null || { print_logs; die "slurmctld did not start"; }
    wait_for "controller answering scontrol ping" controller_up
    for node in "${NODES[@]}"; do
        slurmd -N "$node" </dev/null || { print_logs; die "slurmd -N $node did not start"; }
    done
    wait_for "all nodes idle" nodes_ready
    log "up: ${NODES[*]} idle (state in $ROOT)"
}

# Prints "<label>: running (pid N)" or "<label>: not running" for PID file $1 and name $2.
report() {
    local pid
    if pid=$(running_pid "$1" "$2"); then
        echo "$3: running (pid $pid)"
    else
        echo "$3: not running"
        return 1
    fi
}

# Prints one line per daemon and the node states; exits 0 only if the whole cluster runs.
status() {
    local rc=0 node
    report "$MUNGE_PID" munged munged || rc=1
    report "$ROOT/run/slurmctld.pid" slurmctld slurmctld || rc=1
    for node in "${NODES[@]}"; do
        report "$ROOT/run/slurmd-$node.pid" slurmd "slurmd $node" || rc=1
    done
    [ "$rc" != 0 ] || sinfo -N -o '%N %t'
    return "$rc"
}

stop() {
    stop_slurm
    if [ -e "$MUNGE_OURS" ]; then
        stop_daemon "$MUNGE_PID" munged
        rm -f "$MUNGE_OURS"
    fi
    if grep -qF "$MARKER" /etc/hosts; then
        set_hosts_line
    fi
    log "stopped"
}

case ${1:-} in
    start | status | stop) "$1" ;;
    *)
        echo "usage: $0 start|status|stop" >&2
        exit 2
        ;;
esac
