"""A process group's store served on a socket bound before its port was published (no port race).

Under MPI (`pipeline.launch.rendezvous.mpi_bootstrap`) the supervisor of the component's rank 0
binds the socket and broadcasts its port; the role process it starts (and each restart of it)
inherits the socket and serves the store on it (`bootstrap_store`). Here the supervisor is this
test and the role processes are real child processes: a client connecting to the published port
reaches the role's store, twice over a restart, and the role's only listener is that port.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil

from pipeline.launch.rendezvous import bootstrap_store, listen_on
from support.child_env import child_env

ROLE = """
import json, os, sys, time
from pipeline.launch.rendezvous import bootstrap_store
store = bootstrap_store(json.loads(sys.argv[1]), 30)
store.set("served-by", str(os.getpid()))
store.wait(["done-" + str(os.getpid())])
"""


def listening(pid: int) -> set[tuple[str, int]]:
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections("tcp")
            if c.status == psutil.CONN_LISTEN}


def test_the_store_is_served_on_the_published_port_by_every_role_process_in_turn():
    listener = listen_on("127.0.0.1")
    port = listener.getsockname()[1]
    listener.set_inheritable(True)
    fd = listener.detach()  # kept by the "supervisor" (this test) across role restarts, as mpi_bootstrap's
    try:
        for restart in range(2):
            boot = {"rank": 0, "size": 2, "host": "127.0.0.1", "port": port, "listen_fd": fd}
            role = subprocess.Popen([sys.executable, "-c", ROLE, json.dumps(boot)], pass_fds=(fd,), env=child_env())
            try:
                client = bootstrap_store({"rank": 1, "size": 2, "host": "127.0.0.1", "port": port}, 30)
                assert int(client.get("served-by")) == role.pid, f"restart {restart}: another store answered"
                assert listening(role.pid) == {("127.0.0.1", port)}
                client.set(f"done-{role.pid}", "1")
                assert role.wait(timeout=30) == 0
                del client
            finally:
                if role.poll() is None:
                    role.kill()
                    role.wait()
        time.sleep(0.1)
        assert ("127.0.0.1", port) in listening(os.getpid()), "the supervisor's socket closed with its role"
    finally:
        os.close(fd)


def test_free_port_is_below_the_ephemeral_range_so_no_outgoing_connection_takes_it():
    """The benchmarks' lanes failed on ``EADDRINUSE``: a port `free_port` had the kernel pick (port 0,
    from the ephemeral range) was the source port of another process's connection by the time the
    TCPStore bound it. Ports from below the range are never handed out that way."""
    import socket
    from pathlib import Path

    from pipeline.launch.rendezvous import LOWEST_FREE_PORT, free_port

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port("127.0.0.1") for _ in range(20)}
    assert all(LOWEST_FREE_PORT <= p < low for p in ports), (ports, low)
    assert len(ports) > 1  # picked at random, not one fixed port
    with socket.socket() as s:  # and free: the caller can bind it
        s.bind(("127.0.0.1", ports.pop()))
