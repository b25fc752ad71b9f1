#!/usr/bin/env bash
# Stop the test cluster started by start.sh: cancel its jobs, then stop the daemons by the PIDs
# start.sh recorded in $STATE/pids, in three phases (slurmd + slurmctld, then slurmdbd, then
# MariaDB + munged), each TERM and then KILL after 15 s.
set -uo pipefail
STATE=${TOKENFLOW_SLURM_STATE:-/var/tmp/tokenflow-slurm}
[ -s "$STATE/pids" ] || { echo "stop.sh: no recorded cluster in $STATE"; exit 0; }
export SLURM_CONF=$STATE/etc/slurm.conf
if scontrol ping >/dev/null 2>&1; then
  jobs=$(squeue -h -o %A 2>/dev/null | sort -u)
  if [ -n "$jobs" ]; then
    scancel $jobs 2>/dev/null
    for _ in $(seq 1 50); do [ -z "$(squeue -h -o %A 2>/dev/null)" ] && break; sleep 0.2; done
  fi
fi

is_ours() {  # is_ours NAME PID: the PID still runs the recorded daemon (a stale file after a reboot must not kill others)
  local want=${1%%.*}; [ "$want" = mariadb ] && want=mariadbd
  [ "$(cat "/proc/$2/comm" 2>/dev/null)" = "$want" ]
}
stop_phase() {  # stop_phase NAME_REGEX: TERM every recorded daemon whose name matches, wait, KILL leftovers
  local names=() pids=() name pid i
  while read -r name pid; do
    [[ "$name" =~ $1 ]] && is_ours "$name" "$pid" && { names+=("$name"); pids+=("$pid"); kill -TERM "$pid"; }
  done < "$STATE/pids"
  for _ in $(seq 1 150); do
    local alive=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && break
    sleep 0.1
  done
  for i in "${!pids[@]}"; do
    if kill -0 "${pids[$i]}" 2>/dev/null; then kill -KILL "${pids[$i]}"; echo "stop.sh: killed ${names[$i]} (${pids[$i]})"
    else echo "stop.sh: stopped ${names[$i]} (${pids[$i]})"; fi
  done
}
stop_phase '^(slurmd\..*|slurmctld)$'
stop_phase '^slurmdbd$'
stop_phase '^(mariadb|munged)$'
: > "$STATE/pids"
