#!/usr/bin/env bash
# A real network filesystem over loopback, for the tests: `scripts/netfs.sh start|stop|status`.
#
# start: installs sshfs + openssh-server if missing (apt-get), runs an sshd that listens on
# 127.0.0.1 only (port $TOKENFLOW_NETFS_PORT, default 2222) with a throwaway ed25519 key, and mounts
# ONE exported directory, $ROOT/export, TWICE as fuse.sshfs: $ROOT/mnt1 and $ROOT/mnt2 are two
# clients of one export (a writer on one, readers on the other). The mounts keep no directory or
# attribute cache (dir_cache=no, attr_timeout=0), so a reader sees what the server has. Then it
# writes $ROOT/ready (the tests look for it). ROOT is $TOKENFLOW_NETFS (default /var/tmp/tokenflow-netfs).
# stop: unmounts both, stops that sshd (by its pid file), removes $ROOT/ready. Needs root (FUSE, sshd).
set -euo pipefail
ROOT=${TOKENFLOW_NETFS:-/var/tmp/tokenflow-netfs}
PORT=${TOKENFLOW_NETFS_PORT:-2222}
OPTS="dir_cache=no,attr_timeout=0,entry_timeout=0,negative_timeout=0,reconnect,ServerAliveInterval=5"
SSH_OPTS="IdentityFile=$ROOT/ssh/client,StrictHostKeyChecking=no,UserKnownHostsFile=/dev/null,BatchMode=yes"

stop() {
  # /proc/self/mounts, not `mountpoint`: a mount whose sshfs died ("Transport endpoint is not
  # connected") cannot be stat'ed, yet it is still mounted and must be lazily unmounted.
  for m in "$ROOT/mnt1" "$ROOT/mnt2"; do
    if awk -v m="$m" '$2 == m { found = 1 } END { exit !found }' /proc/self/mounts; then
      fusermount3 -uz "$m" 2>/dev/null || fusermount -uz "$m" 2>/dev/null || umount -l "$m" || true
    fi
  done
  if [ -s "$ROOT/sshd.pid" ]; then
    pid=$(cat "$ROOT/sshd.pid")
    [ "$(cat /proc/"$pid"/comm 2>/dev/null)" = sshd ] && kill "$pid" 2>/dev/null || true
    rm -f "$ROOT/sshd.pid"
  fi
  # an sshd of ours whose pid file is gone (a machine restored from a snapshot) still holds the port
  pkill -f "sshd -f $ROOT/sshd_config" 2>/dev/null || true
  rm -f "$ROOT/ready"
}

start() {
  if ! command -v sshfs >/dev/null || [ ! -x /usr/sbin/sshd ]; then
    apt-get install -y -q sshfs openssh-server >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null && apt-get install -y -q sshfs openssh-server >/dev/null; }
  fi
  stop
  rm -rf "$ROOT/export"   # the tests' files of an earlier start: every start serves an empty export
  mkdir -p "$ROOT"/{export,mnt1,mnt2,ssh} /run/sshd
  chmod 700 "$ROOT/ssh"
  [ -f "$ROOT/ssh/client" ] || ssh-keygen -q -t ed25519 -N "" -f "$ROOT/ssh/client"
  [ -f "$ROOT/ssh/host" ] || ssh-keygen -q -t ed25519 -N "" -f "$ROOT/ssh/host"
  cp "$ROOT/ssh/client.pub" "$ROOT/ssh/authorized_keys"
  cat > "$ROOT/sshd_config" <<CONF
Port $PORT
ListenAddress 127.0.0.1
HostKey $ROOT/ssh/host
AuthorizedKeysFile $ROOT/ssh/authorized_keys
PidFile $ROOT/sshd.pid
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
StrictModes no
UsePAM no
Subsystem sftp internal-sftp
CONF
  /usr/sbin/sshd -f "$ROOT/sshd_config" -E "$ROOT/sshd.log"
  for _ in $(seq 1 50); do [ -s "$ROOT/sshd.pid" ] && break; sleep 0.1; done
  for m in mnt1 mnt2; do
    sshfs -p "$PORT" -o "$OPTS,$SSH_OPTS" "root@127.0.0.1:$ROOT/export" "$ROOT/$m"
  done
  for m in mnt1 mnt2; do
    [ "$(findmnt -n -o FSTYPE "$ROOT/$m")" = fuse.sshfs ] || { echo "netfs: $ROOT/$m is not mounted" >&2; stop; exit 1; }
  done
  printf '%s\n%s\n' "$ROOT/mnt1" "$ROOT/mnt2" > "$ROOT/ready"
  echo "netfs: $ROOT/export mounted twice (fuse.sshfs): $ROOT/mnt1 $ROOT/mnt2"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) [ -f "$ROOT/ready" ] && cat "$ROOT/ready" || { echo "netfs: not started"; exit 1; } ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
