"""The weight channel's failure scenario, on gloo (tests/weights/test_weight_group_failures.py) or
NCCL (the same test on 4 GPUs, and scripts/gpu_check.py's ``nccl_channel`` section).

This process is the sender (rank 0) and leads the groups as `pipeline.roles.weight_push` does; three
receiver processes join each epoch they are named in, and on `WeightSyncError` go on to the next:

- epoch 1 names a fourth member that never starts: forming fails on every member at the deadline;
- epoch 2: "killed" kills itself (SIGKILL) after receiving bucket 1 of 6 of version 1;
- epoch 3: "hung" stops itself (SIGSTOP) after bucket 1 of version 2: the others fail at the deadline;
- epoch 4: "steady" alone receives version 3, which must equal what was sent.
`run` returns what happened; the caller asserts it (`check`).
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

RECEIVER = textwrap.dedent("""
    import json, os, signal, sys
    import torch.distributed  # imported before "ready": a first import takes seconds on a loaded machine
    from pipeline.launch.rendezvous import Rendezvous
    from pipeline.weights.group import TorchDistChannel, WeightSyncError
    rdv_dir, me, fault_epoch, fault, deadline, backend, device = sys.argv[1:8]
    fault_epoch, deadline = int(fault_epoch), float(deadline)
    rdv = Rendezvous(rdv_dir, 0)
    print(json.dumps({"ready": me}), flush=True)
    epoch = 0
    while True:
        epoch += 1
        w = rdv.wait(f"weights-{epoch}", 120)
        if me not in w["ranks"]:
            break
        try:
            ch = TorchDistChannel(w["host"], w["port"], w["ranks"][me], w["world_size"], timeout_s=deadline,
                                  backend=backend, epoch=epoch, device=None if device == "cpu" else device, secret=bytes(32))
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
FAULTS = {"steady": (0, "none"), "killed": (2, "die"), "hung": (3, "hang")}
PLAN = {1: ["steady", "killed", "hung", "ghost"], 2: ["steady", "killed", "hung"], 3: ["steady", "hung"],
        4: ["steady"]}


def weights(version: int, device: str = "cpu"):
    import torch

    gen = torch.Generator().manual_seed(version)
    return [(f"t{i}", torch.randn(1024, generator=gen).to(device)) for i in range(6)]  # 4 KiB: a bucket each


def run(rdv_dir: Path, backend: str, deadline_s: float) -> dict:
    """The scenario (module docstring): {"errors": epoch -> the sender's error, "steady": the survivor's
    lines, "killed_status", "hung_state", "sent_sum": what version 3 sums to}."""
    import os

    import torch

    from pipeline.launch.rendezvous import Rendezvous, listen_on
    from pipeline.weights.group import TorchDistChannel, WeightSyncError
    from pipeline.weights.group_build import GroupBuild

    rdv = Rendezvous(rdv_dir, 0)
    devices = {name: ("cpu" if backend == "gloo" else f"cuda:{i + 1}") for i, name in enumerate(FAULTS)}
    mine = None if backend == "gloo" else torch.device("cuda", 0)
    procs = {name: subprocess.Popen([sys.executable, "-c", RECEIVER, str(rdv_dir), name, str(epoch), fault,
                                     str(deadline_s), backend, devices[name]], stdout=subprocess.PIPE, text=True)
             for name, (epoch, fault) in FAULTS.items()}
    errors: dict[int, str] = {}
    try:
        ready = [json.loads(p.stdout.readline()) for p in procs.values()]
        if ready != [{"ready": n} for n in procs]:
            raise RuntimeError(f"the receivers did not start: {ready}")
        version = 0
        for epoch, members in PLAN.items():
            listener = listen_on("127.0.0.1")
            port = listener.getsockname()[1]
            ranks = {name: 1 + i for i, name in enumerate(members)}
            rdv.publish(f"weights-{epoch}", {"host": "127.0.0.1", "port": port, "world_size": len(members) + 1,
                                             "ranks": ranks})
            build = GroupBuild(epoch, members, lambda: TorchDistChannel(
                "127.0.0.1", port, 0, len(members) + 1, timeout_s=deadline_s, backend=backend, epoch=epoch,
                device=mine, listener=listener, secret=bytes(32)))
            try:
                channel = build.wait(deadline_s + 30)
            except WeightSyncError as exc:
                errors[epoch] = str(exc)
                continue
            version += 1
            try:
                channel.send_tensors(version, weights(version, "cpu" if mine is None else "cuda:0"), 4096)
            except WeightSyncError as exc:
                errors[epoch] = str(exc)
            channel.close()
        rdv.publish("weights-5", {"ranks": {}})
        steady_status = procs["steady"].wait(timeout=60)
        steady = [json.loads(line) for line in procs["steady"].stdout]
        killed_status = procs["killed"].wait(timeout=60)
        with open(f"/proc/{procs['hung'].pid}/stat") as f:
            hung_state = f.read().rsplit(")", 1)[1].split()[0]
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait(timeout=30)
    return {"errors": errors, "steady": steady, "steady_status": steady_status, "killed_status": killed_status,
            "hung_state": hung_state, "sent_sum": sum(float(t.double().sum()) for _, t in weights(3))}


def check(outcome: dict, deadline_s: float) -> list[str]:
    """What is wrong with a scenario's outcome (empty: each fault ended in a regroup of the survivors)."""
    errors, steady = outcome["errors"], outcome["steady"]
    wrong = []
    if set(errors) != {1, 2, 3}:
        wrong.append(f"the sender failed at epochs {sorted(errors)}, not 1-3: {errors}")
    else:
        if "could not join the weight group" not in errors[1] or "forming the weight group" not in errors[1]:
            wrong.append(f"epoch 1 (a member never joins): {errors[1]}")
        if "bucket" not in errors[2] or "version 1" not in errors[2]:
            wrong.append(f"epoch 2 (a member killed): {errors[2]}")
        if f"not complete within {deadline_s:g} s (watchdog)" not in errors[3] or "version 2" not in errors[3]:
            wrong.append(f"epoch 3 (a member hangs): {errors[3]}")
    if outcome["killed_status"] != -signal.SIGKILL:
        wrong.append(f"the killed member ended with {outcome['killed_status']}, not SIGKILL (it missed its group)")
    if outcome["hung_state"] != "T":
        wrong.append(f"the hung member is in state {outcome['hung_state']}, not stopped")
    if outcome["steady_status"] != 0 or [r["epoch"] for r in steady] != [1, 2, 3, 4] or \
            not all("error" in r for r in steady[:3]):
        wrong.append(f"the survivor: exit {outcome['steady_status']}, {steady}")
    elif steady[3] != {"epoch": 4, "version": 3, "sum": outcome["sent_sum"]}:
        wrong.append(f"the survivor's version 3 is not what was sent: {steady[3]}, sum {outcome['sent_sum']}")
    return wrong
