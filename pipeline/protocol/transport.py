"""Message transport between roles: ZeroMQ sockets carrying authenticated `wire` messages.

The orchestrator owns one ROUTER socket (`MessageServer`); generators and trainers each hold a
DEALER socket (`MessageClient`). Both sides speak `wire.Message`s signed with the run secret.

Trust (docs/security.md): a connection is accepted only after ZeroMQ's PLAIN handshake with a
credential derived from the run secret, checked by a ZAP handler in this process (`_Zap`): a peer
without the secret never gets a message queued. The credential crosses the network in clear (the
fabric is trusted); it lets a peer connect, not sign: every message still carries its GMAC.

Invariants:
- bounded before buffered: ZeroMQ drops a connection whose frame exceeds the message bound
  (``MAXMSGSIZE``) before buffering it and holds at most ``recv_hwm`` messages per connection;
  a connection that has not authenticated within ``HANDSHAKE_S`` is closed;
- a message that is malformed, oversized, not signed with the run's secret, stamped with another
  identity or role than its connection's (`pipeline.protocol.roles`), from a role the server does
  not serve, or whose counter its sender's incarnation already used (a replay) is dropped,
  counted by reason in ``dropped`` and logged (rate-limited); nothing raises out of `recv` on
  bad input; an identity that sent ``MAX_MAC_FAILURES`` unauthenticated messages is ignored from
  then on;
- every blocking call takes a timeout (``recv(timeout_s)`` returns None when it expires; sends
  never block: a full peer queue drops the send and counts it, so a dead peer cannot stall the
  orchestrator's loop);
- the secret lives in ``RUN/secret`` (32 random bytes, file mode 0600, created exclusively once);
  it is read only from a regular file owned by this user, private to it, not through a symlink.

Sockets bind to loopback by default; on a cluster, ``TransportConfig.interface`` names the network
interface whose IPv4 address is bound and published to the other roles.
"""
from __future__ import annotations

import fcntl
import hashlib
import hmac
import logging
import os
import secrets
import socket
import stat
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import zmq

from pipeline.protocol import wire
from pipeline.protocol.roles import ORCHESTRATOR, role_of
from pipeline.run_files import SECRET_FILE

log = logging.getLogger(__name__)

@dataclass
class TransportConfig:
    """Where and how the orchestrator listens."""

    host: str = "127.0.0.1"
    """Address to bind when no interface is named (loopback keeps a single-machine run private;
    "0.0.0.0" listens on every interface and publishes this node's host name)."""
    interface: str | None = None
    """Network interface (e.g. ib0, eth0) whose IPv4 address to bind on clusters; overrides host."""
    port: int = 0
    """TCP port; 0 picks a free one (published in the run directory's rendezvous file)."""
    max_message_mb: float = 256.0
    """Messages larger than this are dropped as oversized (a larger frame ends its connection
    before it is buffered)."""
    max_groups_per_result: int = 16
    """Groups one `Result` message carries at most (a generator packs no more, the orchestrator
    refuses more); a generator also starts a new message before one would pass max_message_mb."""
    send_hwm: int = 1000
    """Per-peer queue of outgoing messages; beyond it a send is dropped and counted."""
    recv_hwm: int = 16
    """Per-connection queue of received messages ZeroMQ holds before the loop takes them (a full
    queue stops reading that connection: its sender waits)."""
    timeout_s: float = 30.0
    """Default timeout of request/reply calls made by clients."""


class TransportError(RuntimeError):
    """A transport operation failed (timeout, unusable secret or address)."""


HANDSHAKE_S = 5.0
"""A connection that has not completed the authenticating handshake by then is closed."""
MAX_MAC_FAILURES = 8
"""Unauthenticated messages after which an identity's messages are ignored."""
ZAP_DOMAIN = "tokenflow"


def load_or_create_secret(run_dir: Path) -> bytes:
    """The run's secret; created (0600, exclusively) on first use. An existing one is read only
    from a regular file of this user's, mode 0600 or stricter, not through a symlink."""
    path = Path(run_dir) / SECRET_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as exc:  # ELOOP: a symlink
            raise TransportError(f"{path} cannot be read as the run secret ({exc}); it must be a "
                                 f"regular file, not a symlink") from None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            mode = st.st_mode & 0o777
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                raise TransportError(f"{path} is not a regular file owned by this user (uid "
                                     f"{st.st_uid}, ours {os.getuid()}): not trusted as the run secret")
            if mode & 0o077:
                raise TransportError(f"{path} is readable by others (mode {mode:o}); chmod 600 it")
            data = f.read(33)
        if len(data) != 32:
            raise TransportError(f"{path} holds {len(data)} bytes, expected a 32-byte secret")
        return data
    data = secrets.token_bytes(32)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return data


def interface_address(name: str) -> str:
    """IPv4 address of a network interface (Linux SIOCGIFADDR)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
        except OSError as exc:
            raise TransportError(f"network interface {name!r} has no IPv4 address ({exc})") from None
    return socket.inet_ntoa(packed[20:24])


def bind_host(cfg: TransportConfig) -> str:
    return interface_address(cfg.interface) if cfg.interface else cfg.host


def connect_credential(key: bytes) -> tuple[bytes, bytes]:
    """The PLAIN user name and password a peer holding ``key`` connects with (both derived from
    it, so several runs' servers can share one process's ZAP handler)."""
    user = hashlib.sha256(b"tokenflow zmq user v1" + key).hexdigest()[:32]
    password = hmac.new(key, b"tokenflow zmq connect v1", hashlib.sha256).hexdigest()
    return user.encode(), password.encode()


class _Zap:
    """This process's ZAP handler (one per ZeroMQ context): admits PLAIN peers that know the
    credential of a key some server of this process serves."""

    _lock = threading.Lock()
    _auth = None

    @classmethod
    def admit(cls, ctx: zmq.Context, key: bytes) -> None:
        from zmq.auth.thread import ThreadAuthenticator

        user, password = (v.decode() for v in connect_credential(key))
        with cls._lock:
            if cls._auth is None:
                auth = ThreadAuthenticator(ctx, log=logging.getLogger("pipeline.protocol.zap"))
                auth.start()
                auth.configure_plain(domain=ZAP_DOMAIN, passwords={user: password})
                cls._auth = auth
            else:
                cls._auth.passwords[ZAP_DOMAIN][user] = password


class _Endpoint:
    """What servers and clients share: the context, the key, this end's stamp and drop accounting."""

    def __init__(self, key: bytes, max_message_mb: float, identity: str):
        self.key = key
        self.max_bytes = int(max_message_mb * 2**20)
        self.ctx = zmq.Context.instance()
        self.sender = wire.Sender(identity, role_of(identity))
        self.dropped: Counter[str] = Counter()
        self._last_log = 0.0
        self._last_seen: dict[bytes, tuple[int, int]] = {}  # identity -> (incarnation, counter)

    def _fresh(self, identity: bytes, origin: wire.Origin) -> bool:
        """Whether ``origin`` is newer than anything its sender sent before (else: a replay)."""
        stamp = (origin.incarnation, origin.counter)
        last = self._last_seen.get(identity)
        if last is not None and (stamp[0] < last[0] or stamp[0] == last[0] and stamp[1] <= last[1]):
            return False
        self._last_seen[identity] = stamp
        return True

    def _drop(self, reason: str, detail: str) -> None:
        self.dropped[reason] += 1
        now = time.monotonic()
        if now - self._last_log > 1.0:  # rate-limited: a flood of garbage must not flood the log
            self._last_log = now
            log.warning("dropped a message (%s): %s [totals: %s]", reason, detail, dict(self.dropped))

    def _configure(self, sock: zmq.Socket, cfg: TransportConfig) -> None:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, cfg.send_hwm)
        sock.setsockopt(zmq.RCVHWM, cfg.recv_hwm)
        # A frame beyond the message bound ends its connection before ZeroMQ buffers it.
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_bytes)
        sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000))


class MessageServer(_Endpoint):
    """The orchestrator's ROUTER socket: receives from authenticated peers of the roles it serves
    (``accepts``), replies by identity."""

    def __init__(self, key: bytes, cfg: TransportConfig, accepts: frozenset[str]):
        super().__init__(key, cfg.max_message_mb, ORCHESTRATOR)
        self.accepts = accepts
        self._mac_failures: Counter[bytes] = Counter()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self._configure(self.sock, cfg)
        _Zap.admit(self.ctx, key)
        self.sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
        self.sock.setsockopt(zmq.PLAIN_SERVER, 1)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        host = bind_host(cfg)
        if cfg.port:
            self.sock.bind(f"tcp://{host}:{cfg.port}")
            self.port = cfg.port
        else:
            self.port = self.sock.bind_to_random_port(f"tcp://{host}")
        advertised = socket.gethostname() if host == "0.0.0.0" else host
        self.address = f"tcp://{advertised}:{self.port}"
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)

    def recv(self, timeout_s: float) -> tuple[bytes, wire.Message] | None:
        """Next valid message and its sender's identity, or None after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:  # a ready message is taken without polling first (a turn drains many)
                frames = self._recv_ready()
            except zmq.Again:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self.poller.poll(int(remaining * 1000)):
                    return None
                continue
            identity, payload = frames[0].bytes, frames[1:]
            msg = self._admit(identity, payload)
            if msg is not None:
                return identity, msg
            if time.monotonic() >= deadline:
                return None

    def _recv_ready(self) -> list[zmq.Frame]:
        """The frames of a message that has arrived (`zmq.Again` if none has). A multipart message
        arrives whole, so only its first frame can be missing; each frame says whether more follow
        (`recv_multipart` asks the socket that, per frame)."""
        frame = self.sock.recv(zmq.NOBLOCK, copy=False)
        frames = [frame]
        while frame.more:
            frame = self.sock.recv(copy=False)
            frames.append(frame)
        return frames

    def _admit(self, identity: bytes, payload: list) -> wire.Message | None:
        """The message if it is authentic, fresh and from a role served here; else dropped (None)."""
        if self._mac_failures[identity] >= MAX_MAC_FAILURES:
            self.dropped["ignored_peer"] += 1
            return None
        try:
            msg = wire.decode(self.key, payload, self.max_bytes)
        except wire.FrameError as exc:
            if exc.reason == "unauthenticated":
                self._mac_failures[identity] += 1
            self._drop(exc.reason, f"from {identity[:64]!r}: {exc.detail}")
            return None
        origin = msg.origin
        if origin is None or origin.identity.encode() != identity:
            self._drop("forged", f"connection {identity[:64]!r} sent a message stamped {origin}")
        elif origin.role != role_of(origin.identity) or origin.role not in self.accepts:
            self._drop("forged", f"{identity[:64]!r} claims role {origin.role!r}; this server takes "
                                 f"{sorted(self.accepts)}")
        elif not self._fresh(identity, origin):
            self._drop("replayed", f"{origin} was sent before")
        else:
            return msg
        return None

    def send(self, identity: bytes, kind: str, meta: Mapping[str, Any] | None = None,
             arrays: Mapping[str, np.ndarray] | None = None) -> bool:
        """Queue a message for a peer; False (and counted) if the peer is gone or its queue full."""
        frames = wire.encode(self.key, kind, meta, arrays, self.sender)
        try:
            self.sock.send_multipart([identity, *frames], flags=zmq.NOBLOCK, copy=False)
            return True
        except (zmq.Again, zmq.ZMQError) as exc:
            self._drop("send_failed", f"to {identity!r}: {exc}")
            return False

    def close(self) -> None:
        self.sock.close(linger=0)


class MessageClient(_Endpoint):
    """A generator's or trainer's DEALER socket connected to the orchestrator."""

    def __init__(self, key: bytes, address: str, cfg: TransportConfig, identity: str):
        super().__init__(key, cfg.max_message_mb, identity)
        self.address = address
        self.timeout_s = cfg.timeout_s
        self.sock = self.ctx.socket(zmq.DEALER)
        self._configure(self.sock, cfg)
        user, password = connect_credential(key)
        self.sock.setsockopt(zmq.PLAIN_USERNAME, user)
        self.sock.setsockopt(zmq.PLAIN_PASSWORD, password)
        self.sock.setsockopt(zmq.IDENTITY, identity.encode())
        self.sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self.sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        self.sock.connect(address)

    def send(self, kind: str, meta: Mapping[str, Any] | None = None,
             arrays: Mapping[str, np.ndarray] | None = None, timeout_s: float | None = None) -> None:
        frames = wire.encode(self.key, kind, meta, arrays, self.sender)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        if not self.sock.poll(int(timeout * 1000), zmq.POLLOUT):
            raise TransportError(f"send of {kind!r} to {self.address} timed out after {timeout:.1f}s")
        self.sock.send_multipart(frames, copy=False)

    def recv(self, timeout_s: float | None = None) -> wire.Message | None:
        """Next valid message from the orchestrator, or None after the timeout."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        while True:
            remaining = max(0.0, deadline - time.monotonic())
            if not self.sock.poll(int(remaining * 1000), zmq.POLLIN):
                return None
            frames = self.sock.recv_multipart(copy=False)
            try:
                msg = wire.decode(self.key, frames, self.max_bytes)
            except wire.FrameError as exc:
                self._drop(exc.reason, exc.detail)
            else:
                if msg.origin is None or msg.origin.role != ORCHESTRATOR:
                    self._drop("forged", f"a message from {self.address} stamped {msg.origin}")
                elif not self._fresh(b"", msg.origin):
                    self._drop("replayed", f"{msg.origin} was sent before")
                else:
                    return msg
            if time.monotonic() >= deadline:
                return None

    def close(self) -> None:
        self.sock.close(linger=0)
