"""A cluster node is shared with other users' jobs (docs/security.md): each case of issue #30 tried
the way another user, or a stray key holder, would, against real processes and sockets.

The other user is ``nobody`` (``setpriv``: the test runs as root, as CI does); what it runs is a
few lines of Python with no access to the run's secret.
"""
from __future__ import annotations

import datetime
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch.distributed as torch_dist

from pipeline.apps.train import prepare_run_dir
from pipeline.config import RunConfig, TokenflowConfig
from pipeline.generator.receive_post import ReceivePostListener
from pipeline.metrics import MetricsWriter, read_metrics
from pipeline.orchestrator.config import OrchestratorConfig
from pipeline.protocol import messages as m
from pipeline.protocol.links import GeneratorLink, TrainerLink, read_rendezvous
from pipeline.protocol.record import RecordSchema
from pipeline.protocol.sample_batch import SampleBatch
from pipeline.protocol.transport import MessageClient, TransportConfig, TransportError, load_or_create_secret
from pipeline.rollout_log.reader import RolloutLog
from pipeline.tasks import TaskConfig
from support.loadgen import synthetic_group
from test_orchestrator import start_orchestrator, stop, write_spec


def as_nobody(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run Python ``code`` as the unprivileged user ``nobody`` (its stdout: what it managed)."""
    if os.getuid() != 0:
        pytest.skip("switching to the user nobody needs root (CI runs the suite as root)")
    return subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                           sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env={"PATH": os.environ["PATH"], "HOME": "/"})


@pytest.fixture
def shared_dir():
    """A directory every user may enter (as /scratch or a home directory is)."""
    path = Path(tempfile.mkdtemp(prefix="tf-shared-"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_another_user_reads_no_file_of_a_run(shared_dir):
    run_dir = shared_dir / "run"
    cfg = TokenflowConfig(run=RunConfig(name="t", dir=str(run_dir)), task=TaskConfig(name="synthetic"),
                          orchestrator=OrchestratorConfig(group_size=4, groups_per_step=4))
    prepare_run_dir(cfg)  # what `tokenflow train` does first
    orch = start_orchestrator(run_dir)
    try:
        launcher = MetricsWriter(run_dir, "launcher")  # a metrics file surely there
        launcher.log("probe")
        launcher.close()
        names = ["config.yaml", "rendezvous/orchestrator.json", "secret", str(launcher.path.relative_to(run_dir))]
        folders = [str(run_dir / "rollouts"), str(run_dir / "metrics")]
        out = as_nobody(f"""
import os
for name in {names!r}:
    try:
        print(name, open(os.path.join({str(run_dir)!r}, name), 'rb').read(200))
    except OSError as e:
        pass
for folder in {folders!r}:
    try:
        print('listed', os.listdir(folder))
    except OSError:
        pass
""")
    finally:
        stop(orch)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "", f"another user read the run's files:\n{out.stdout}"


def test_another_user_cannot_post_a_receive_to_an_engine_worker():
    started = []
    listener = ReceivePostListener(lambda: started.append(1))
    out = as_nobody(f"""
import msgpack, zmq
s = zmq.Context().socket(zmq.REQ)
s.setsockopt(zmq.LINGER, 0)
s.setsockopt(zmq.RCVTIMEO, 3000)
s.connect({listener.address!r})
s.send(msgpack.packb({{"version": 1}}))
try:
    print(msgpack.unpackb(s.recv()))
except zmq.Again:
    pass
""")
    assert out.returncode == 0, out.stderr
    assert started == [] and out.stdout == "", f"another user started a receive: {out.stdout}"


def _other_address() -> str:
    """An IPv4 address of this node that is not loopback."""
    out = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        address = line.split()[3].split("/")[0]
        if not address.startswith("127."):
            return address
    pytest.skip("this node has no IPv4 address but loopback")


def test_the_weight_store_listens_only_on_its_address_and_another_user_plants_no_value():
    """The weight group's store (`open_store`, as `TorchDistChannel` and `CudaIpcChannel` open it):
    not reachable on another address; reachable on its own, where another user writes the key the
    CUDA IPC receiver takes its plan from. The TCPStore takes the value (it authenticates nobody),
    and an unsigned reader (the channel before `SignedStore`) would have used it; the run's signed
    store refuses it."""
    from pipeline.protocol import codec
    from pipeline.protocol.weight_stream import StoreSignatureError, UpdateHeader
    from pipeline.launch.rendezvous import open_store
    from pipeline.weights.signed_store import SignedStore

    other = _other_address()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = open_store("127.0.0.1", port, 2, True, datetime.timedelta(seconds=20))
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((other, port), timeout=2).close()
    signed = SignedStore(store, b"s" * 32)  # held, as the channels hold theirs
    channel = torch_dist.PrefixStore("tokenflow/ipc/epoch1", signed)
    channel.set("u0/meta", codec.pack(UpdateHeader(1, [])))
    assert codec.unpack(UpdateHeader, channel.get("u0/meta")) == UpdateHeader(1, [])
    planted = codec.pack(UpdateHeader(1, [[1 << 30, 0, []]]))  # a plan of the other user's making
    out = as_nobody(f"""
import datetime, torch.distributed as dist
s = dist.TCPStore("127.0.0.1", {port}, 2, is_master=False, timeout=datetime.timedelta(seconds=20))
s.set("tokenflow/ipc/epoch1/u0/meta", {planted!r})
print("planted")
""")
    assert out.stdout == "planted\n", out.stderr
    assert codec.unpack(UpdateHeader, store.get("tokenflow/ipc/epoch1/u0/meta")).plan == [[1 << 30, 0, []]]
    with pytest.raises(StoreSignatureError, match="not signed with this run's secret"):
        channel.get("u0/meta")


def _fill(link: GeneratorLink, timeout_s: float = 20) -> list:
    deadline = time.monotonic() + timeout_s
    items = []
    while not items and time.monotonic() < deadline:
        items = [i for i in link.poll(0.2) if hasattr(i, "group_id")]
    assert items, "no work was granted"
    return items


def test_a_generator_can_neither_finish_the_run_nor_replay_a_trainer_command(tmp_path):
    write_spec(tmp_path)
    orch = start_orchestrator(tmp_path)
    key = load_or_create_secret(tmp_path)
    address = read_rendezvous(tmp_path, 5)["address"]
    trainer = TrainerLink(tmp_path, RecordSchema())
    sent: list[list[bytes]] = []
    record = trainer.client.sock.send_multipart
    trainer.client.sock.send_multipart = lambda frames, **kw: (sent.append([bytes(f) for f in frames]),
                                                                record(frames, **kw))[1]
    gen = MessageClient(key, address, TransportConfig(), "gen-5")
    try:
        trainer.resume(0)
        for kind in (m.Resume(0), m.Finish()):
            gen.send(*m.encode(kind))
        for frames in sent * 3:  # the trainer's resume, replayed
            record(frames)
        time.sleep(1.5)
        assert orch.poll() is None, "a generator's finish ended the run"
    finally:
        trainer.close()
        gen.close()
        stop(orch)
    last = list(read_metrics(tmp_path, "orchestrator"))[-1]
    assert last.get("count_trainer_resumes") == 1, f"replayed or forged resumes were honoured: {last}"


def test_malformed_evaluations_and_impossible_batch_sizes_do_not_end_the_run(tmp_path):
    write_spec(tmp_path)
    orch = start_orchestrator(tmp_path)
    trainer = TrainerLink(tmp_path, RecordSchema())
    gen = GeneratorLink(tmp_path, 3, 4, RecordSchema())
    try:
        trainer.report_version(0)
        trainer.request_eval(0, 0)
        item = _fill(gen)[0]
        group = synthetic_group(item, 3, RecordSchema(), 8, 8)
        for index in (np.zeros((2, 2), np.int64), np.zeros(4, np.float32), np.arange(50)):
            arrays = dict(group.columns)
            arrays["eval_index"] = index
            gen.send(m.EvalResult(0, arrays))
        for _ in range(4):  # more than the orchestrator's restarts
            trainer.send(m.GetBatch(0, 0, 2**62))
        time.sleep(1.5)
        assert orch.poll() is None, "a malformed message ended the orchestrator"
        assert isinstance(trainer.client.recv(5.0), object)
    finally:
        trainer.close()
        gen.close()
        stop(orch)
    last = list(read_metrics(tmp_path, "orchestrator"))[-1]
    assert last.get("count_bad_message", 0) + last.get("count_invalid_eval_result", 0) >= 7, last


POISONS = {
    "token id 2**31-1": lambda c: c["completion_ids"].__setitem__(0, 2**31 - 1),
    "version 10**6": lambda c: c["versions"].__setitem__(slice(None), 10**6),
    "NaN t_start": lambda c: c["t_start"].__setitem__(0, np.nan),
    "ends before it starts": lambda c: c["t_end"].__setitem__(0, c["t_start"][0] - 10),
}


def test_signed_results_with_impossible_values_are_refused_and_honest_ones_stored(tmp_path):
    write_spec(tmp_path)
    orch = start_orchestrator(tmp_path)
    trainer = TrainerLink(tmp_path, RecordSchema())
    gen = GeneratorLink(tmp_path, 3, 5, RecordSchema())
    try:
        trainer.report_version(0)  # admission opens
        items = _fill(gen)
        while len(items) < len(POISONS) + 1:
            items += _fill(gen)
        for item, name in zip(items, [None, *POISONS]):
            group = synthetic_group(item, 3, RecordSchema(), 8, 16)
            if name is not None:
                cols = {k: np.array(v) for k, v in group.columns.items()}
                POISONS[name](cols)
                group = SampleBatch(cols, RecordSchema(), validate=False)
            gen.queue_result(item, group)
        gen.send_results()  # one message: a good group and the poisoned ones, each judged alone
        deadline = time.monotonic() + 20
        while gen.unacked and time.monotonic() < deadline:
            gen.poll(0.2, send_credit=False)
    finally:
        trainer.close()
        gen.close()
        stop(orch)
    assert gen.outcomes.get("invalid") == len(POISONS), f"impossible values were taken: {gen.outcomes}"
    with RolloutLog.open(tmp_path / "rollouts") as log:
        for batch in log.iter_batches():
            c = batch.columns
            assert c["completion_ids"].max() < 1000 and c["versions"].max() <= 1
            assert np.isfinite(c["t_start"]).all() and (c["t_start"] <= c["t_end"]).all()


def test_a_sender_without_the_secret_gets_no_memory_of_the_orchestrator(tmp_path):
    write_spec(tmp_path)
    orch = start_orchestrator(tmp_path)
    address = read_rendezvous(tmp_path, 5)["address"]
    before = _status_mib(orch.pid, "VmHWM")
    try:  # 16 identities x 24 messages of 4 x 1 MiB: 384 MiB if it were all held
        out = as_nobody(f"""
import os, time, zmq
ctx = zmq.Context()
socks = []
for i in range(16):
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.IDENTITY, b"gen-%d" % i)
    s.setsockopt(zmq.SNDHWM, 1000)
    s.connect({address!r})
    socks.append(s)
frames = [os.urandom(28), b"\\x80"] + [os.urandom(1 << 20)] * 4
for _ in range(24):
    for s in socks:
        try:
            s.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            pass
time.sleep(3)
""")
        assert out.returncode == 0, out.stderr
        assert orch.poll() is None
        grown = _status_mib(orch.pid, "VmHWM") - before
    finally:
        stop(orch)
    assert grown < 48, f"a sender without the secret grew the orchestrator by {grown:.0f} MiB"


def _status_mib(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def test_a_secret_planted_by_another_user_or_through_a_symlink_is_refused(tmp_path):
    planted = tmp_path / "elsewhere"
    planted.write_bytes(b"k" * 32)
    os.chmod(planted, 0o600)
    (tmp_path / "secret").symlink_to(planted)
    with pytest.raises(TransportError, match="symlink"):
        load_or_create_secret(tmp_path)
    (tmp_path / "secret").unlink()
    if os.getuid() != 0:
        pytest.skip("giving a file to another user needs root (CI runs the suite as root)")
    shutil.copy(planted, tmp_path / "secret")
    os.chown(tmp_path / "secret", 65534, 65534)  # nobody's file
    with pytest.raises(TransportError, match="not a regular file owned by this user"):
        load_or_create_secret(tmp_path)
