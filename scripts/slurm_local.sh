#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, for running and testing cluster sweeps locally.
#
#   scripts/slurm_local.sh start    install slurm-wlm, slurmdbd, munge and mariadb-server from
#                                   Debian if missing (root), write a one-node slurm.conf for this
#                                   machine's real CPUs and memory, start munged, MariaDB + slurmdbd
#                                   (job accounting: `sacct`, which submitit polls for job states),
#                                   slurmctld and slurmd, wait until `sinfo` shows the node idle
#   scripts/slurm_local.sh stop     stop the daemons
#   scripts/slurm_local.sh status   print `sinfo` (exit 1 when the cluster is not up)
#
# Idempotent: `start` on a running, idle cluster changes nothing. When a daemon does not come up
# it prints the tail of that daemon's log and exits non-zero. Nothing in cascade is special to
# this cluster: sweeps reach it with `hydra/launcher=slurm`, exactly as on a real one.
#
# Environment: SLURM_LOCAL_PARTITION (default "debug"), SLURM_LOCAL_WAIT_S (default 60).
set -euo pipefail

PARTITION=${SLURM_LOCAL_PARTITION:-debug}
WAIT_S=${SLURM_LOCAL_WAIT_S:-60}
CONF=/etc/slurm/slurm.conf
LOGDIR=/var/log/slurm
MUNGE_LOG=/var/log/munge/munged.log

die() { echo "slurm_local: $*" >&2; exit 1; }

log_tail() {  # name, file
    echo "---- last lines of $2 ($1) ----" >&2
    tail -n 25 "$2" >&2 2>/dev/null || echo "(no log at $2)" >&2
}

need_root() {
    [ "$(id -u)" -eq 0 ] || die "must run as root (it installs packages and starts system daemons)"
}

PACKAGES="slurm-wlm slurmdbd munge mariadb-server"

install_packages() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v slurmdbd >/dev/null \
        && command -v munged >/dev/null && command -v mariadbd >/dev/null; then
        return
    fi
    command -v apt-get >/dev/null || die "SLURM daemons are missing and there is no apt-get to install them ($PACKAGES)"
    echo "slurm_local: installing $PACKAGES from the Debian archive"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq || die "apt-get update failed"
    apt-get install -y -qq $PACKAGES >/dev/null || die "apt-get install $PACKAGES failed"
}

node_up() {  # the node answers and is idle or allocated/mixed (busy with our jobs is up too)
    local state
    state=$(sinfo -h -N -o '%T' 2>/dev/null | head -n 1) || return 1
    case "$state" in idle|mixed|allocated|completing) return 0 ;; *) return 1 ;; esac
}

start_munge() {
    if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
        return
    fi
    [ -s /etc/munge/munge.key ] || { mungekey --create --force >/dev/null 2>&1 || \
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 2>/dev/null; }
    chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge
    runuser -u munge -- /usr/sbin/munged || { log_tail munged "$MUNGE_LOG"; die "munged did not start"; }
    for _ in $(seq 20); do
        munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return
        sleep 0.5
    done
    log_tail munged "$MUNGE_LOG"
    die "munged started but does not answer"
}

start_accounting() {  # MariaDB + slurmdbd: sacct answers for finished, killed and timed-out jobs
    if ! mysqladmin ping >/dev/null 2>&1; then
        /etc/init.d/mariadb start >/dev/null 2>&1 || true
        for _ in $(seq 40); do mysqladmin ping >/dev/null 2>&1 && break; sleep 0.5; done
        mysqladmin ping >/dev/null 2>&1 || { log_tail mariadb /var/log/mysql/error.log; die "MariaDB did not start"; }
    fi
    mysql -e "CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurm';
              GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost'; FLUSH PRIVILEGES;" \
        || die "could not create the slurm database user"
    mkdir -p /etc/slurm "$LOGDIR"
    cat >/etc/slurm/slurmdbd.conf <<DBD
# Written by cascade's scripts/slurm_local.sh
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
LogFile=$LOGDIR/slurmdbd.log
PidFile=/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
DBD
    chmod 600 /etc/slurm/slurmdbd.conf
    pgrep -x slurmdbd >/dev/null || slurmdbd || { log_tail slurmdbd "$LOGDIR/slurmdbd.log"; die "slurmdbd did not start"; }
    for _ in $(seq 40); do sacctmgr -n list cluster >/dev/null 2>&1 && break; sleep 0.5; done
    sacctmgr -n list cluster >/dev/null 2>&1 || { log_tail slurmdbd "$LOGDIR/slurmdbd.log"; die "slurmdbd does not answer"; }
    sacctmgr -n -P list cluster format=cluster | grep -qx cascade || sacctmgr -i add cluster cascade >/dev/null \
        || die "could not register the cluster with slurmdbd"
}

write_conf() {
    local host node mem
    host=$(hostname -s)
    # slurmd -C prints this machine's real topology and memory; keep 5% of the memory back
    node=$(slurmd -C | head -n 1)
    mem=$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$node")
    node=$(sed "s/RealMemory=[0-9]*/RealMemory=$((mem * 95 / 100))/" <<<"$node")
    mkdir -p /etc/slurm "$LOGDIR" /var/spool/slurmctld /var/spool/slurmd
    cat >"$CONF.tmp" <<EOF
# Written by cascade's scripts/slurm_local.sh: a one-node cluster on $host.
ClusterName=cascade
SlurmctldHost=$host
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$LOGDIR/slurmctld.log
SlurmdLogFile=$LOGDIR/slurmd.log
# no cgroups in a container: track processes by parent id, no task binding or accounting
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
ReturnToService=2
KillWait=5
MinJobAge=600
$node State=UNKNOWN
PartitionName=$PARTITION Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
    mv "$CONF.tmp" "$CONF"
}

wait_node() {
    for _ in $(seq "$((WAIT_S * 2))"); do
        node_up && return 0
        sleep 0.5
    done
    return 1
}

start() {
    need_root
    install_packages
    if node_up; then
        echo "slurm_local: already up"; sinfo; return
    fi
    start_munge
    write_conf  # before slurmdbd: sacctmgr reads slurm.conf
    start_accounting
    pgrep -x slurmctld >/dev/null || slurmctld || { log_tail slurmctld "$LOGDIR/slurmctld.log"; die "slurmctld did not start"; }
    for _ in $(seq 20); do scontrol ping >/dev/null 2>&1 && break; sleep 0.5; done
    scontrol ping >/dev/null 2>&1 || { log_tail slurmctld "$LOGDIR/slurmctld.log"; die "slurmctld does not answer"; }
    pgrep -x slurmd >/dev/null || slurmd || { log_tail slurmd "$LOGDIR/slurmd.log"; die "slurmd did not start"; }
    if ! wait_node; then
        scontrol update nodename="$(hostname -s)" state=resume >/dev/null 2>&1 || true  # a node left DOWN by an earlier stop
        wait_node || { sinfo >&2 || true; log_tail slurmd "$LOGDIR/slurmd.log"; log_tail slurmctld "$LOGDIR/slurmctld.log";
                       die "the node did not become idle within ${WAIT_S}s"; }
    fi
    echo "slurm_local: up"
    sinfo
}

stop() {
    need_root
    scontrol shutdown >/dev/null 2>&1 || true
    for d in slurmd slurmctld slurmdbd; do
        for _ in $(seq 20); do pgrep -x "$d" >/dev/null || break; sleep 0.5; done
        pkill -x "$d" 2>/dev/null || true
    done
    /etc/init.d/mariadb stop >/dev/null 2>&1 || true
    pkill -x munged 2>/dev/null || true
    echo "slurm_local: stopped"
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) node_up && sinfo || { echo "slurm_local: not up" >&2; exit 1; } ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
