"""The weight channel's failure state machine (`pipeline.weights.guarded_groups`) on gloo, between
real processes: a member that never joins, one killed mid-broadcast, one that hangs mid-broadcast.
Each ends in `WeightSyncError` on the survivors (never a hang, never a teardown of their process)
and the group formed again from the survivors carries the next version; the last survivor
receives exactly the sent weights. The NCCL path is the same code (`tests/weights/test_nccl_channel.py`).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from pipeline.launch.rendezvous import Rendezvous, listen_on
from pipeline.weights.group import TorchDistChannel, WeightSyncError
from pipeline.weights.group_build import GroupBuild

DEADLINE_S = 5.0

RECEIVER = textwrap.dedent("""
    import json, os, signal, sys
    import torch.distributed  # imported before "ready": a first import takes seconds on a loaded machine
    from pipeline.launch.rendezvous import Rendezvous
    from pipeline.weights.group import TorchDistChannel, WeightSyncError
    rdv_dir, me, fault_epoch, fault, deadline = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], float(sys.argv[5])
    rdv = Rendezvous(rdv_dir, 0)
    print(json.dumps({"ready": me}), flush=True)  # imports done: joins within the deadline from now on
    epoch = 0
    while True:
        epoch += 1
        w = rdv.wait(f"weights-{epoch}", 120)
        if me not in w["ranks"]:
            break
        try:
            ch = TorchDistChannel(w["host"], w["port"], w["ranks"][me], w["world_size"], timeout_s=deadline, epoch=epoch)
        except WeightSyncError as e:
            print(json.dumps({"epoch": epoch, "error": str(e)}), flush=True)
            continue
        try:
            update = ch.receive()
            total = 0.0
            for k, (name, t) in enumerate(update):
                total += float(t.double().sum())
                if epoch == fault_epoch and k == 1:  # mid-broadcast: bucket 1 of 6 received
                    os.kill(os.getpid(), signal.SIGKILL if fault == "die" else signal.SIGSTOP)
            print(json.dumps({"epoch": epoch, "version": update.version, "sum": total}), flush=True)
        except WeightSyncError as e:
            print(json.dumps({"epoch": epoch, "error": str(e)}), flush=True)
        ch.close()
""")


def weights(version: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(version)
    return [(f"t{i}", torch.randn(1024, generator=gen)) for i in range(6)]  # 4 KiB each: one bucket each


@pytest.mark.timeout(180)  # a hang fails here instead of holding the suite
def test_a_peer_that_never_joins_dies_or_hangs_ends_in_a_regroup_of_the_survivors(tmp_path):
    rdv = Rendezvous(tmp_path, 0)
    faults = {"steady": (0, "none"), "killed": (2, "die"), "hung": (3, "hang")}
    procs = {name: subprocess.Popen([sys.executable, "-c", RECEIVER, str(tmp_path), name, str(epoch), fault,
                                     str(DEADLINE_S)], stdout=subprocess.PIPE, text=True)
             for name, (epoch, fault) in faults.items()}
    errors: dict[int, str] = {}
    try:
        assert [json.loads(p.stdout.readline()) for p in procs.values()] == [{"ready": n} for n in procs]
        # epoch 1 names a member that never starts; 2 loses "killed" mid-broadcast, 3 "hung";
        # 4 is the survivor alone, then an empty group ends it
        plan = {1: ["steady", "killed", "hung", "ghost"], 2: ["steady", "killed", "hung"], 3: ["steady", "hung"],
                4: ["steady"]}
        version = 0
        for epoch, members in plan.items():
            listener = listen_on("127.0.0.1")
            port = listener.getsockname()[1]
            ranks = {name: 1 + i for i, name in enumerate(members)}
            rdv.publish(f"weights-{epoch}", {"host": "127.0.0.1", "port": port, "world_size": len(members) + 1,
                                             "ranks": ranks})
            build = GroupBuild(epoch, members, lambda: TorchDistChannel(
                "127.0.0.1", port, 0, len(members) + 1, timeout_s=DEADLINE_S, epoch=epoch, listener=listener))
            try:
                channel = build.wait(DEADLINE_S + 30)
            except WeightSyncError as exc:
                errors[epoch] = str(exc)
                continue
            version += 1
            try:
                channel.send_tensors(version, weights(version), 4096)
            except WeightSyncError as exc:
                errors[epoch] = str(exc)
            channel.close()
        rdv.publish("weights-5", {"ranks": {}})
        assert procs["steady"].wait(timeout=60) == 0
        steady = [json.loads(line) for line in procs["steady"].stdout]
        assert procs["killed"].wait(timeout=60) == -signal.SIGKILL
        hung = procs["hung"]
        hung_status = _state(hung.pid)
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait(timeout=30)
    assert hung_status == "T", "the hung member was stopped (SIGSTOP) while the run went on"
    assert set(errors) == {1, 2, 3}, errors
    assert "could not join the weight group" in errors[1] and "forming the weight group" in errors[1]
    assert "bucket" in errors[2] and "version 1" in errors[2]
    assert f"not complete within {DEADLINE_S:g} s (watchdog)" in errors[3] and "version 2" in errors[3]
    # the survivor failed with the group each time, then received the survivors' version exactly
    assert [r["epoch"] for r in steady] == [1, 2, 3, 4]
    assert all("error" in r for r in steady[:3]), steady
    want = sum(float(t.double().sum()) for _, t in weights(3))
    assert steady[3] == {"epoch": 4, "version": 3, "sum": want}


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


BOUND_RECEIVER = textwrap.dedent("""
    import sys
    from pipeline.weights.group import TorchDistChannel
    ch = TorchDistChannel("127.0.0.2", int(sys.argv[1]), 1, 2, timeout_s=60, epoch=1)
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
    listener = listen_on(host)
    port = listener.getsockname()[1]
    receiver = subprocess.Popen([sys.executable, "-c", BOUND_RECEIVER, str(port)], stdout=subprocess.PIPE,
                                text=True, env={**os.environ, **env})
    try:
        channel = TorchDistChannel(host, port, 0, 2, timeout_s=60, epoch=1, listener=listener)
        mine, theirs = _listening(os.getpid()), _listening(receiver.pid)
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
