"""`cluster.network.address` on the real Slurm test cluster: every listener of a run binds it.

A 4-rank PP2 x TP2 run (`experiment=moe-pp2tp2-slurm`: trainer ranks 2 + 2 on two nodes, the
vLLM generator on the third) with ``cluster.network.address=127.0.0.2``, a second loopback address
nothing else uses, and ``cluster.network.interface=lo``, its interface (NCCL_SOCKET_IFNAME and
GLOO_SOCKET_IFNAME=lo, whose own address, 127.0.0.1, gloo would otherwise take). While it runs, the test reads the listening TCP sockets of every Python process
of the run (found by the test's process marker, which Slurm's tasks inherit; `srun`'s own
listeners are Slurm's, not the run's) and requires each to be bound to 127.0.0.2: the trainer's
process-group store, its gloo groups (megatron's, the weight channel's), the weight store, the
orchestrator's ZeroMQ socket, the generator's and vLLM's workers' gloo groups. The ports the run
published in its rendezvous (trainer store, weight store, orchestrator) must be among them, so the
published port is the one that was listening.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from pipeline.metrics import read_metrics
from pipeline.supervise import MARKER_ENV
from support.child_env import child_env
from support.leftovers import marked_processes

REPO = Path(__file__).resolve().parents[2]
ADDRESS = "127.0.0.2"


def listeners_of_the_run(marker: str) -> dict[str, set[tuple[str, int]]]:
    """``"pid command"`` -> listening (address, port) of every Python process carrying ``marker``."""
    me = psutil.Process()
    exclude = {me.pid, *(p.pid for p in me.parents())}
    found = {}
    for pid, cmd in marked_processes(marker, exclude).items():
        try:
            proc = psutil.Process(pid)
            if "python" not in proc.exe():
                continue  # srun: Slurm's I/O and step listeners
            bound = {(c.laddr.ip, c.laddr.port) for c in proc.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if bound:
            found[f"{pid} {cmd[:100]}"] = bound
    return found


@pytest.mark.slurm
@pytest.mark.engine
@pytest.mark.slow  # 52 s measured on 2 cores (a 4-rank job and a vLLM engine): TOKENFLOW_SLOW=1 runs it
@pytest.mark.timeout(900)
def test_every_listener_of_a_slurm_run_binds_the_chosen_address(tmp_path):
    run = tmp_path / "net"
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "train", "experiment=moe-pp2tp2-slurm", "run.name=net",
         f"hydra.run.dir={run}", f"cluster.network.address={ADDRESS}", "cluster.network.interface=lo", "cluster.trainer.time_min=30",
         "cluster.generator.time_min=30", "run.steps=4", "run.eval_every=0", "run.checkpoint_every=4",
         "run.timeout_s=300", "run.progress=false", "logger=[]", "orchestrator.groups_per_step=4",
         "orchestrator.group_size=8", "trainer.micro_batch_tokens=256", "trainer.export=never"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(), cwd=REPO)
    seen: dict[str, set[tuple[str, int]]] = {}
    try:
        deadline = time.monotonic() + 800
        while proc.poll() is None and time.monotonic() < deadline:
            for who, bound in listeners_of_the_run(os.environ[MARKER_ENV]).items():
                seen.setdefault(who, set()).update(bound)
            time.sleep(0.5)
        out = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out[-5000:]
    assert [s["step"] for s in read_metrics(run, "train_step")] == [0, 1, 2, 3]
    report = "\n".join(f"{who}: {sorted(bound)}" for who, bound in sorted(seen.items()))
    print(f"\nlisteners of the run:\n{report}")
    elsewhere = {who: sorted(b for b in bound if b[0] != ADDRESS) for who, bound in seen.items()}
    assert not any(elsewhere.values()), f"listeners not on {ADDRESS}: { {w: b for w, b in elsewhere.items() if b} }"
    ports = {port for bound in seen.values() for _, port in bound}
    attempt = run / "rendezvous" / "attempt-0"
    published = {"trainer store": json.loads((attempt / "trainer_dist.json").read_text()),
                 "weight store": json.loads((attempt / "weights-1.json").read_text()),
                 "orchestrator": json.loads((run / "rendezvous" / "orchestrator.json").read_text())}
    orchestrator = published["orchestrator"]["address"]
    assert orchestrator.startswith(f"tcp://{ADDRESS}:"), orchestrator
    for what, info in published.items():
        port = info["port"] if "port" in info else int(info["address"].rsplit(":", 1)[1])
        assert info.get("host", ADDRESS) == ADDRESS and port in ports, f"{what} published {info}, not seen listening"
    trainers = [who for who in seen if "launch_task" in who]  # the role processes: the 4 trainer ranks listen
    assert len(trainers) >= 4, f"the 4 trainer ranks' gloo groups not all seen: {sorted(seen)}"
    assert any("VLLM" in who for who in seen), f"vLLM's workers' gloo groups not seen: {sorted(seen)}"
