#!/usr/bin/env bash
# Start a real single-machine Slurm cluster for tests (Debian 12 / Ubuntu, as root, no systemd).
#
# What runs (all recorded in $STATE/pids, stopped by stop.sh):
#   munged (as the munge user), MariaDB (private datadir, unix socket, no TCP), slurmdbd,
#   slurmctld, and one slurmd per fake node node1..nodeN (this Slurm build has MULTIPLE_SLURMD).
# Partition `debug` (default) holds every node; each node claims $NODE_CPUS CPUs and
# $NODE_MEM_MB MB whatever the machine has (SlurmdParameters=config_overrides).
# Preemption (for the preemption tests): partition `preemptible` (PriorityTier 1, PreemptMode
# REQUEUE, GraceTime 60 s) is preempted by jobs of partition `urgent` (PriorityTier 10); jobs of
# `debug` are never preempted (PreemptMode=OFF). A running cluster without these partitions gets
# them live (slurm.conf rewritten, `scontrol reconfigure`: running jobs keep running).
#
# Fake GPUs (for the placement tests): every node has $NODE_GPUS GPUs as gres/gpu backed by dummy
# character devices ($STATE/dev/node<i>-gpu<j>, the numbers of /dev/null), so Slurm allocates and
# binds them (CUDA_VISIBLE_DEVICES per task) like real ones. A running cluster without them gets
# them by a restart of the whole cluster (stop.sh, which cancels its jobs, then a fresh start with
# the same state directory): run start.sh under `heavy-all` then, so that no test is using it.
#
# Idempotent: if every recorded daemon is alive and the nodes answer, it only reports that.
# Environment knobs: TOKENFLOW_SLURM_STATE (default /var/tmp/tokenflow-slurm),
#   TOKENFLOW_SLURM_NODES (default 3), TOKENFLOW_SLURM_NODE_CPUS (4), TOKENFLOW_SLURM_NODE_MEM_MB (4000),
#   TOKENFLOW_SLURM_TIMEOUT (seconds to wait for idle nodes, default 60), TOKENFLOW_SLURM_NODE_GPUS (4).
# Client tools find the cluster through /etc/slurm/slurm.conf (a symlink into $STATE; an existing
# foreign slurm.conf is moved aside to slurm.conf.before-tokenflow).
set -euo pipefail

T0=$(date +%s%N)
STATE=${TOKENFLOW_SLURM_STATE:-/var/tmp/tokenflow-slurm}
NODES=${TOKENFLOW_SLURM_NODES:-3}
NODE_CPUS=${TOKENFLOW_SLURM_NODE_CPUS:-4}
NODE_MEM_MB=${TOKENFLOW_SLURM_NODE_MEM_MB:-4000}
NODE_GPUS=${TOKENFLOW_SLURM_NODE_GPUS:-4}
TIMEOUT=${TOKENFLOW_SLURM_TIMEOUT:-60}
CLUSTER=tokenflow
CTLD_PORT=17817
DBD_PORT=17819
FIRST_NODE_PORT=17001
HERE=$(cd "$(dirname "$0")" && pwd)

die() { echo "start.sh: ERROR: $*" >&2; exit 1; }
log() { echo "start.sh: $*"; }
elapsed() { local ms=$(( ($(date +%s%N) - T0) / 1000000 )); printf '%d.%d' $((ms / 1000)) $((ms % 1000 / 100)); }
tail_logs() {
  command -v sinfo >/dev/null && { echo "---- sinfo -N"; sinfo -N -o '%N %T %E' 2>&1; } >&2
  for f in "$STATE"/log/*.log; do [ -f "$f" ] && { echo "---- tail $f"; tail -n 15 "$f"; }; done >&2
}

[ "$(id -u)" = 0 ] || die "must run as root (it installs packages and starts daemons)"
[ "$NODES" -ge 1 ] && [ "$NODES" -le 9 ] || die "TOKENFLOW_SLURM_NODES must be 1..9, got $NODES"
NODE_LAST_PORT=$((FIRST_NODE_PORT + NODES - 1))
NODE_RANGE="node[1-$NODES]"; [ "$NODES" = 1 ] && NODE_RANGE=node1

# ---------------------------------------------------------------- preemption settings
add_preemption() {  # $1: slurm.conf; the debug partition line must exist
  sed -i -e '/^PreemptType=/d' -e '/^PreemptMode=/d' -e '/^PartitionName=preemptible /d' \
      -e '/^PartitionName=urgent /d' "$1"
  sed -i 's/^PartitionName=debug .*/PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=OFF/' "$1"
  cat >> "$1" <<'PREEMPT'
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
PartitionName=preemptible Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime=60
PartitionName=urgent Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
PREEMPT
}

# ---------------------------------------------------------------- fake GPUs
add_gpus() {  # $1: slurm.conf (with its NodeName line); writes gres.conf beside it and the device files
  local dir i j
  dir=$(dirname "$1")
  mkdir -p "$STATE/dev"
  : > "$dir/gres.conf.tmp"
  for i in $(seq 1 "$NODES"); do
    for j in $(seq 0 $((NODE_GPUS - 1))); do
      [ -c "$STATE/dev/node$i-gpu$j" ] || mknod "$STATE/dev/node$i-gpu$j" c 1 3
    done
    echo "NodeName=node$i Name=gpu File=$STATE/dev/node$i-gpu[0-$((NODE_GPUS - 1))]" >> "$dir/gres.conf.tmp"
  done
  mv "$dir/gres.conf.tmp" "$dir/gres.conf"
  sed -i -e '/^GresTypes=/d' -e 's/ Gres=gpu:[0-9]*//' -e "s/^\(NodeName=.*\) State=UNKNOWN/\1 Gres=gpu:$NODE_GPUS State=UNKNOWN/" "$1"
  echo "GresTypes=gpu" >> "$1"
}
has_gpus() { scontrol show node node1 2>/dev/null | grep -q "Gres=gpu:$NODE_GPUS"; }

# ---------------------------------------------------------------- already running?
nodes_ready() { [ "$(sinfo -h -N -t idle,mix,alloc -o %N 2>/dev/null | sort -u | wc -l)" -ge "$NODES" ]; }
if [ -s "$STATE/pids" ] && command -v sinfo >/dev/null; then
  alive=1
  while read -r name pid; do
    want=${name%%.*}; [ "$want" = mariadb ] && want=mariadbd
    [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$want" ] || { alive=0; log "$name (pid $pid) is gone"; }
  done < "$STATE/pids"
  if [ "$alive" = 1 ] && nodes_ready && ! scontrol show partition preemptible >/dev/null 2>&1; then
    add_preemption "$STATE/etc/slurm.conf"
    scontrol reconfigure || die "scontrol reconfigure failed after adding the preemption partitions"
    log "added the preemption partitions to the running cluster"
  fi
  if [ "$alive" = 1 ] && nodes_ready && ! has_gpus; then
    log "the running cluster has no fake GPUs (gres/gpu): restarting it with $NODE_GPUS per node"
    alive=0
  fi
  if [ "$alive" = 1 ] && nodes_ready; then
    log "cluster already running ($(sinfo -h -o '%P %D %T' | paste -sd' ')); nothing to do ($(elapsed) s)"
    exit 0
  fi
  log "stopping the recorded cluster before a fresh start"
  "$HERE/stop.sh" || true
fi

# ---------------------------------------------------------------- packages
PKGS=(slurm-wlm slurmctld slurmd slurm-client slurmdbd munge mariadb-server libpmix-dev openmpi-bin libopenmpi-dev hdf5-tools)
missing=()
for p in "${PKGS[@]}"; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  log "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  # policy-rc.d 101 keeps the packages' init scripts from starting system daemons.
  made_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; made_policy=1; fi
  apt-get install -y -q --no-install-recommends "${missing[@]}" </dev/null >"/tmp/tokenflow-slurm-apt.log" 2>&1 || {
    apt-get update -q </dev/null >>"/tmp/tokenflow-slurm-apt.log" 2>&1
    apt-get install -y -q --no-install-recommends "${missing[@]}" </dev/null >>"/tmp/tokenflow-slurm-apt.log" 2>&1 \
      || { tail -n 30 /tmp/tokenflow-slurm-apt.log >&2; die "apt-get install failed (log /tmp/tokenflow-slurm-apt.log)"; }
  }
  [ "$made_policy" = 1 ] && rm -f /usr/sbin/policy-rc.d
  log "packages installed ($(elapsed) s)"
fi

# ---------------------------------------------------------------- layout and config
mkdir -p "$STATE"/{log,run,ctld,etc,mysql}
for i in $(seq 1 "$NODES"); do mkdir -p "$STATE/spool/node$i" "$STATE/tmp/node$i"; done
chmod 1777 "$STATE"/tmp/node*
: > "$STATE/pids"
HOST=$(hostname -s)

# Open MPI (srun --mpi=pmix, cluster.mpi): the fake nodes are one machine under one host name, so
# Open MPI would take tasks of different nodes for neighbours and use shared memory (vader) between
# them, which crashes across the nodes' separate tmp dirs; and this machine's other interfaces may
# refuse connections. So MPI talks TCP over lo here (a site setting of the test cluster).
MCA=/etc/openmpi/openmpi-mca-params.conf
if [ -f "$MCA" ] && ! grep -q "^btl_tcp_if_include" "$MCA"; then
  sed -i 's/^btl *=.*/btl = self,tcp/' "$MCA"
  grep -q "^btl *=" "$MCA" || printf '\nbtl = self,tcp\n' >> "$MCA"
  printf '\nbtl_tcp_if_include = lo\n' >> "$MCA"  # the file may lack a final newline
fi
grep -qE "(^|[[:space:]])node1([[:space:]]|$)" /etc/hosts || \
  echo "127.0.0.1 $(for i in $(seq 1 "$NODES"); do printf 'node%s ' "$i"; done)" >> /etc/hosts
for i in $(seq 1 "$NODES"); do getent hosts "node$i" >/dev/null || die "node$i does not resolve (add it to /etc/hosts)"; done

cat > "$STATE/etc/slurm.conf" <<CONF
# Written by slurm/cluster/start.sh: a single-machine test cluster; do not edit by hand.
ClusterName=$CLUSTER
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job otherwise waits for the old credential to expire (120 s).
AuthInfo=cred_expire=10
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd.%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
# PMIx puts its rendezvous files under TmpFS: one directory per fake node, or they collide.
TmpFS=$STATE/tmp/%n
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
DefMemPerCPU=256
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_min_interval=100000,defer_batch=0
JobRequeue=1
ReturnToService=2
SlurmdParameters=config_overrides
SlurmctldTimeout=30
SlurmdTimeout=30
MessageTimeout=10
KillWait=3
MinJobAge=60
InactiveLimit=0
Waittime=0
MailProg=/bin/true
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$DBD_PORT
JobCompType=jobcomp/none
NodeName=$NODE_RANGE NodeHostname=localhost NodeAddr=127.0.0.1 Port=$FIRST_NODE_PORT-$NODE_LAST_PORT CPUs=$NODE_CPUS RealMemory=$NODE_MEM_MB State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
[ "$NODES" = 1 ] && sed -i "s/Port=$FIRST_NODE_PORT-$NODE_LAST_PORT/Port=$FIRST_NODE_PORT/" "$STATE/etc/slurm.conf"
add_preemption "$STATE/etc/slurm.conf"
add_gpus "$STATE/etc/slurm.conf"

MYSOCK=$STATE/mysql/mysqld.sock
cat > "$STATE/etc/slurmdbd.conf" <<CONF
# Written by slurm/cluster/start.sh.
AuthType=auth/munge
DbdHost=localhost
DbdPort=$DBD_PORT
SlurmUser=root
LogFile=$STATE/log/slurmdbd.log
PidFile=$STATE/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=root
StorageLoc=tokenflow_slurm_acct
CONF
chmod 600 "$STATE/etc/slurmdbd.conf"

mkdir -p /etc/slurm
for f in slurm.conf slurmdbd.conf gres.conf; do
  if [ -e "/etc/slurm/$f" ] && [ "$(readlink "/etc/slurm/$f" || true)" != "$STATE/etc/$f" ]; then
    mv "/etc/slurm/$f" "/etc/slurm/$f.before-tokenflow"; log "moved /etc/slurm/$f aside"
  fi
  ln -sfn "$STATE/etc/$f" "/etc/slurm/$f"
done
export SLURM_CONF=$STATE/etc/slurm.conf

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
  local secs=$1 what=$2; shift 2
  local end=$(( $(date +%s) + secs ))
  until "$@" >/dev/null 2>&1; do
    [ "$(date +%s)" -lt "$end" ] || { tail_logs; die "timed out after ${secs}s waiting for $what"; }
    sleep 0.2
  done
}
record() { echo "$1 $2" >> "$STATE/pids"; }
pid_of_file() { local end=$(( $(date +%s) + 20 )); until [ -s "$1" ]; do [ "$(date +%s)" -lt "$end" ] || return 1; sleep 0.1; done; cat "$1"; }

# ---------------------------------------------------------------- munge
[ -s /etc/munge/munge.key ] || { mkdir -p /etc/munge; dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 2>/dev/null; }
chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key
mkdir -p /run/munge /var/log/munge /var/lib/munge; chown munge:munge /run/munge /var/log/munge /var/lib/munge
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  runuser -u munge -- /usr/sbin/munged --force
  wait_for 10 "munged" sh -c 'munge -n | unmunge'
fi
record munged "$(cat /run/munge/munged.pid)"

# ---------------------------------------------------------------- MariaDB (private, socket only)
touch "$STATE/log/mariadb.log"
chown -R mysql:mysql "$STATE/mysql" "$STATE/log/mariadb.log"
if [ ! -d "$STATE/mysql/data/mysql" ]; then
  mariadb-install-db --user=mysql --datadir="$STATE/mysql/data" --auth-root-authentication-method=socket \
    --skip-test-db >"$STATE/log/mariadb-install.log" 2>&1 || { tail -n 20 "$STATE/log/mariadb-install.log" >&2; die "mariadb-install-db failed"; }
fi
mariadbd --no-defaults --user=mysql --datadir="$STATE/mysql/data" --socket="$MYSOCK" --skip-networking \
  --pid-file="$STATE/mysql/mariadb.pid" --log-error="$STATE/log/mariadb.log" \
  --innodb-buffer-pool-size=64M --performance-schema=OFF >/dev/null 2>&1 &
wait_for 30 "MariaDB" mariadb --no-defaults --socket="$MYSOCK" -e "select 1"
record mariadb "$(pid_of_file "$STATE/mysql/mariadb.pid")"

# ---------------------------------------------------------------- slurmdbd, slurmctld, slurmd per node
# slurmdbd finds the private socket through the client library's MYSQL_UNIX_PORT.
MYSQL_UNIX_PORT=$MYSOCK slurmdbd
record slurmdbd "$(pid_of_file "$STATE/run/slurmdbd.pid")" || { tail_logs; die "slurmdbd did not start"; }
wait_for 30 "slurmdbd" sacctmgr -n list cluster
sacctmgr -n list cluster format=cluster -P | grep -qx "$CLUSTER" || sacctmgr -i add cluster "$CLUSTER" >/dev/null

slurmctld -i
record slurmctld "$(pid_of_file "$STATE/run/slurmctld.pid")" || { tail_logs; die "slurmctld did not start"; }
wait_for 30 "slurmctld" scontrol ping
for i in $(seq 1 "$NODES"); do
  slurmd -N "node$i"
  record "slurmd.node$i" "$(pid_of_file "$STATE/run/slurmd.node$i.pid")" || { tail_logs; die "slurmd node$i did not start"; }
done

wait_for "$TIMEOUT" "$NODES idle nodes" nodes_ready
log "cluster up: $(sinfo -h -o '%P %D %T %N' | paste -sd' ') — state in $STATE, started in $(elapsed) s"
