"""The weight channel's failure state machine (`pipeline.weights.guarded_groups`) on gloo, between
real processes: a member that never joins, one killed mid-broadcast, one that hangs mid-broadcast.
Each ends in `WeightSyncError` on the survivors (never a hang, never a teardown of their process)
and the group formed again from the survivors carries the next version; the last survivor
receives exactly the sent weights. The NCCL path is the same code, the same test on 4 GPUs (gpu marker).
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from pipeline.launch.rendezvous import listen_on
from pipeline.weights.group import TorchDistChannel
from support import weight_group_faults

DEADLINE_S = 5.0


@pytest.mark.timeout(240)  # a hang fails here instead of holding the suite
@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=pytest.mark.gpu)])
def test_a_peer_that_never_joins_dies_or_hangs_ends_in_a_regroup_of_the_survivors(tmp_path, backend):
    """`support.weight_group_faults`: a member that never joins (epoch 1), one killed mid-broadcast
    (2), one stopped mid-broadcast (3): the sender's error names each (the hang: our watchdog at
    the deadline), the survivor fails with each group, then alone receives exactly version 3; the
    killed member died by its own SIGKILL inside its group, the hung one is still stopped."""
    if backend == "nccl" and torch.cuda.device_count() < 4:
        pytest.skip(f"NCCL needs a GPU per member (4); this machine has {torch.cuda.device_count()}")
    outcome = weight_group_faults.run(tmp_path, backend, DEADLINE_S)
    assert weight_group_faults.check(outcome, DEADLINE_S) == []


BOUND_RECEIVER = textwrap.dedent("""
    import sys
    from pipeline.weights.group import TorchDistChannel
    ch = TorchDistChannel("127.0.0.2", int(sys.argv[1]), 1, 2, timeout_s=60, epoch=1, secret=bytes(32))
    print(sum(float(t.sum()) for _, t in ch.receive()), flush=True)
    ch.close()
""")


def test_the_store_and_the_gloo_groups_listen_on_the_chosen_address(monkeypatch):
    """``cluster.network.address`` (here a second loopback address) reaches the channel as
    TOKENFLOW_NETWORK_ADDRESS: the store and both ends' gloo groups listen there and nowhere else
    (read from /proc/net/tcp, the sockets of each process)."""
    from pipeline.launch.network import NetworkConfig, listen_address, network_env

    net = NetworkConfig(address="127.0.0.2")
    env = network_env(net)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    host = listen_address(net, "127.0.0.1")
    before = _listening(os.getpid())  # (an earlier test's failed groups may still be ending here)
    listener = listen_on(host)
    port = listener.getsockname()[1]
    receiver = subprocess.Popen([sys.executable, "-c", BOUND_RECEIVER, str(port)], stdout=subprocess.PIPE,
                                text=True, env={**os.environ, **env})
    try:
        channel = TorchDistChannel(host, port, 0, 2, timeout_s=60, epoch=1, listener=listener, secret=bytes(32))
        mine, theirs = _listening(os.getpid()) - before, _listening(receiver.pid)
        channel.send_tensors(1, [("w", torch.ones(10))], 4096)
        assert receiver.stdout.readline().strip() == "10.0"
        channel.close()
        assert receiver.wait(timeout=60) == 0
    finally:
        receiver.kill()
        receiver.wait(timeout=30)
    assert ("127.0.0.2", port) in mine, "the store"
    assert len(mine) >= 2 and len(theirs) >= 1, (mine, theirs)  # the store and a gloo device each
    assert {a for a, _ in mine | theirs} == {"127.0.0.2"}, (mine, theirs)


def _listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of the IPv4/IPv6 TCP sockets process ``pid`` listens on."""
    import ipaddress

    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                    continue
                hexaddr, hexport = cols[1].split(":")
                raw = bytes.fromhex(hexaddr)
                if table == "tcp":
                    address = str(ipaddress.IPv4Address(raw[::-1]))
                else:  # four little-endian 32-bit words
                    address = str(ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))))
                    address = address.removeprefix("::ffff:")
                found.add((address, int(hexport, 16)))
    return found


LATE_SENDER_RECEIVER = textwrap.dedent("""
    import sys
    from pipeline.weights.group import TorchDistChannel
    ch = TorchDistChannel("127.0.0.1", int(sys.argv[1]), 2, 3, timeout_s=30, epoch=1, senders=2, secret=bytes(32))
    print("formed", flush=True)
    ch.close()
""")


def test_a_second_sender_joining_after_the_leaders_group_formed_completes_the_group():
    """With expert parallelism the leader's group forms first and sender 1 joins only after it
    (`WeightPusher._join_as_sender`, once the ranks agreed the epoch): each group's handshake comes
    right after that group formed, so the receiver's first group never waits for the second."""
    listener = listen_on("127.0.0.1")
    port = listener.getsockname()[1]
    receiver = subprocess.Popen([sys.executable, "-c", LATE_SENDER_RECEIVER, str(port)], stdout=subprocess.PIPE,
                                text=True)
    try:
        leader = TorchDistChannel("127.0.0.1", port, 0, 3, timeout_s=30, epoch=1, senders=2, listener=listener, secret=bytes(32))
        second = TorchDistChannel("127.0.0.1", port, 1, 3, timeout_s=30, epoch=1, senders=2, secret=bytes(32))
        assert receiver.stdout.readline().strip() == "formed"
        assert receiver.wait(timeout=60) == 0
        leader.close()
        second.close()
    finally:
        receiver.kill()
        receiver.wait(timeout=30)
