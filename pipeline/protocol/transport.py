"""Message transport between roles: ZeroMQ sockets carrying authenticated `wire` messages.

The orchestrator owns one ROUTER socket (`MessageServer`); generators and trainers each hold a
DEALER socket (`MessageClient`). Both sides speak `wire.Message`s signed with the run secret.

Invariants:
- a frame that is malformed, oversized or not signed with the run's secret is dropped, counted by
  reason in ``dropped`` and logged (rate-limited); nothing raises out of `recv` on bad input;
- every blocking call takes a timeout (``recv(timeout_s)`` returns None when it expires; sends
  never block: a full peer queue drops the send and counts it, so a dead peer cannot stall the
  orchestrator's loop);
- the secret lives in ``RUN/secret`` (32 random bytes, file mode 0600, created exclusively once).

Sockets bind to loopback by default; on a cluster, ``TransportConfig.interface`` names the network
interface whose IPv4 address is bound and published to the other roles.
"""
from __future__ import annotations

import fcntl
import logging
import os
import secrets
import socket
import struct
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import zmq

from pipeline.protocol import wire
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
    """Messages larger than this are dropped as oversized."""
    send_hwm: int = 1000
    """Per-peer queue of outgoing messages; beyond it a send is dropped and counted."""
    timeout_s: float = 30.0
    """Default timeout of request/reply calls made by clients."""


class TransportError(RuntimeError):
    """A transport operation failed (timeout, unusable secret or address)."""


def load_or_create_secret(run_dir: Path) -> bytes:
    """The run's secret; created (0600, exclusively) on first use."""
    path = Path(run_dir) / SECRET_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        mode = path.stat().st_mode & 0o777
        if mode & 0o077:
            raise TransportError(f"{path} is readable by others (mode {mode:o}); chmod 600 it")
        data = path.read_bytes()
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


class _Endpoint:
    """What servers and clients share: the context, the key and drop accounting."""

    def __init__(self, key: bytes, max_message_mb: float):
        self.key = key
        self.max_bytes = int(max_message_mb * 2**20)
        self.ctx = zmq.Context.instance()
        self.dropped: Counter[str] = Counter()
        self._last_log = 0.0

    def _drop(self, reason: str, detail: str) -> None:
        self.dropped[reason] += 1
        now = time.monotonic()
        if now - self._last_log > 1.0:  # rate-limited: a flood of garbage must not flood the log
            self._last_log = now
            log.warning("dropped a message (%s): %s [totals: %s]", reason, detail, dict(self.dropped))

    def _configure(self, sock: zmq.Socket, send_hwm: int) -> None:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, send_hwm)
        sock.setsockopt(zmq.RCVHWM, send_hwm)
        # Beyond twice the limit ZeroMQ itself disconnects the sender before buffering the message.
        sock.setsockopt(zmq.MAXMSGSIZE, 2 * self.max_bytes + 4096)


class MessageServer(_Endpoint):
    """The orchestrator's ROUTER socket: receives from any authenticated peer, replies by identity."""

    def __init__(self, key: bytes, cfg: TransportConfig):
        super().__init__(key, cfg.max_message_mb)
        self.sock = self.ctx.socket(zmq.ROUTER)
        self._configure(self.sock, cfg.send_hwm)
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
            remaining = max(0.0, deadline - time.monotonic())
            if not self.poller.poll(int(remaining * 1000)):
                return None
            frames = self.sock.recv_multipart(copy=False)
            identity, payload = frames[0].bytes, frames[1:]
            try:
                return identity, wire.decode(self.key, payload, self.max_bytes)
            except wire.FrameError as exc:
                self._drop(exc.reason, exc.detail)
            if time.monotonic() >= deadline:
                return None

    def send(self, identity: bytes, kind: str, meta: Mapping[str, Any] | None = None,
             arrays: Mapping[str, np.ndarray] | None = None) -> bool:
        """Queue a message for a peer; False (and counted) if the peer is gone or its queue full."""
        frames = wire.encode(self.key, kind, meta, arrays)
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
        super().__init__(key, cfg.max_message_mb)
        self.address = address
        self.timeout_s = cfg.timeout_s
        self.sock = self.ctx.socket(zmq.DEALER)
        self._configure(self.sock, cfg.send_hwm)
        self.sock.setsockopt(zmq.IDENTITY, identity.encode())
        self.sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self.sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        self.sock.connect(address)

    def send(self, kind: str, meta: Mapping[str, Any] | None = None,
             arrays: Mapping[str, np.ndarray] | None = None, timeout_s: float | None = None) -> None:
        frames = wire.encode(self.key, kind, meta, arrays)
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
                return wire.decode(self.key, frames, self.max_bytes)
            except wire.FrameError as exc:
                self._drop(exc.reason, exc.detail)
            if time.monotonic() >= deadline:
                return None

    def close(self) -> None:
        self.sock.close(linger=0)
