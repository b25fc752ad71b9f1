"""The raw baselines and the log floor that `bench/ingest.py` measures the orchestrator against
(that module's docstring defines each), on the same messages: `group_message`'s `Result`s of
``groups`` groups of 8 x 1K-token samples.

- `run_raw_zmq`: a receiver that only receives them (this script run twice: ``--raw-receiver``,
  ``--raw-sender``; helpers of a running benchmark, whose own check covers them);
- `run_raw_h5py`: resizable-dataset appends of their columns, synced at the orchestrator's cadence;
- `run_log_floor`: the per-byte work of any orchestrator of this design beyond the receive.

Each returns ``{"cpu_s": ...}``: the CPU seconds (user + system) of that work for ``n_groups``
groups.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pipeline.protocol import wire  # noqa: E402

COMPLETION = 1024
PROMPT = 64
GROUP = 8
"""Completion and prompt tokens of a sample, samples of a group."""
KEY = b"k" * 32
"""The key every message here is signed with."""
MESSAGE_BYTES = 1 << 30
"""The decode's bound on a message's bytes (far above any message here)."""


def cpu_s() -> float:
    """This process's CPU seconds so far (user + system)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def group_message(key: bytes, groups: int) -> list[bytes]:
    """A `Result` of ``groups`` groups of 8 x 1K-token samples, as a generator sends them."""
    rng = np.random.default_rng(0)
    n, t = GROUP * groups, GROUP * groups * COMPLETION
    cols = {"group_id": np.zeros(n, np.int64), "sample_index": np.arange(n, dtype=np.int32),
            "prompt_id": np.zeros(n, np.int64), "attempt": np.zeros(n, np.int32),
            "finish_reason": np.zeros(n, np.uint8), "reward": np.zeros(n, np.float32),
            "generator_id": np.zeros(n, np.int32), "t_start": np.zeros(n), "t_end": np.zeros(n),
            "prompt_len": np.full(n, PROMPT, np.int32), "completion_len": np.full(n, COMPLETION, np.int32),
            "prompt_ids": rng.integers(0, 1000, n * PROMPT, dtype=np.int32),
            "completion_ids": rng.integers(0, 1000, t, dtype=np.int32),
            "logprobs": -rng.random(t, dtype=np.float32), "versions": np.zeros(t, np.int32)}
    header = {"groups": [[g, 0] for g in range(groups)], "credit": None}
    return [bytes(f) for f in wire.encode(key, "result", header, cols)]


def group_columns(groups: int) -> dict[str, np.ndarray]:
    """The columns of `group_message`'s `Result` of ``groups`` groups, decoded as the orchestrator
    decodes them."""
    return dict(wire.decode(KEY, group_message(KEY, groups), MESSAGE_BYTES).arrays)


def raw_receiver(addr_file: str, n_msgs: int) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    port = s.bind_to_random_port("tcp://127.0.0.1")
    Path(addr_file).write_text(str(port))
    s.recv_multipart(copy=False)
    c0 = cpu_s()
    for _ in range(n_msgs - 1):
        s.recv_multipart(copy=False)
    print(json.dumps({"cpu_s": cpu_s() - c0}), flush=True)


def raw_sender(port: int, n_msgs: int, groups_per_message: int) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.connect(f"tcp://127.0.0.1:{port}")
    frames = group_message(KEY, groups_per_message)
    for _ in range(n_msgs):
        s.send_multipart(frames)
    s.close(linger=-1)


def run_raw_zmq(n_groups: int, groups_per_message: int) -> dict:
    """CPU of receiving ``n_groups`` groups as messages of ``groups_per_message`` groups."""
    n_msgs = max(2, round(n_groups / groups_per_message))
    me = [sys.executable, __file__]
    with tempfile.TemporaryDirectory(prefix="tf-raw-zmq-") as work:  # the receiver's port, in a file
        addr = Path(work) / "port"
        rx = subprocess.Popen(me + ["--raw-receiver", str(addr), str(n_msgs)], stdout=subprocess.PIPE, text=True)
        while not addr.exists() or not addr.read_text():
            time.sleep(0.02)
        subprocess.run(me + ["--raw-sender", addr.read_text(), str(n_msgs), str(groups_per_message)], check=True)
        out = json.loads(rx.communicate(timeout=300)[0].strip().splitlines()[-1])
    return {"cpu_s": out["cpu_s"] / (n_msgs - 1) * n_groups / groups_per_message}


def run_raw_h5py(n_groups: int, groups_per_flush: int, root: Path, groups_per_message: int) -> dict:
    """Appends of ``n_groups`` groups' columns, as messages of ``groups_per_message`` groups
    arrive, synced after every ``groups_per_flush`` groups."""
    cols = group_columns(groups_per_message)
    per_flush = max(1, round(groups_per_flush / groups_per_message))  # messages per flush
    work = Path(tempfile.mkdtemp(prefix="tf-raw-h5py-", dir=root))  # ours alone (no mktemp race)
    path = work / "raw.h5"
    c0 = cpu_s()
    with h5py.File(path, "w", libver="latest") as f:
        ds = {k: f.create_dataset(k, shape=(0,), maxshape=(None,), dtype=v.dtype,
                                  chunks=(65536 if len(v) > GROUP * groups_per_message else 1024,))
              for k, v in cols.items()}
        f.swmr_mode = True
        fd = f.id.get_vfd_handle()
        written = 0
        while written < n_groups:
            k = max(1, min(per_flush, round((n_groups - written) / groups_per_message)))
            written += k * groups_per_message
            for name, d in ds.items():
                a = np.concatenate([cols[name]] * k) if k > 1 else cols[name]
                n0 = d.shape[0]
                d.resize((n0 + len(a),))
                d[n0:] = a
            f.flush()
            os.fdatasync(fd)  # durable as an acknowledged flush of the orchestrator's log
    cpu = (cpu_s() - c0) * n_groups / written
    shutil.rmtree(work)
    return {"cpu_s": cpu}


def run_log_floor(n_groups: int, groups_per_flush: int, root: Path, groups_per_message: int) -> dict:
    """The per-byte work of any orchestrator beyond the receive, with no per-group bookkeeping: each
    received message authenticated and decoded (`wire.decode`), its token values checked
    (`check_token_values`), its frames as received appended to a journal file and ``fdatasync``'d
    after every ``groups_per_flush`` groups; then every column sealed once, as a seal writes it
    (`format.write_sealed_segment`): one ``pwritev`` of its messages' arrays where HDF5 placed the
    dataset, digested (`digests.digest`), the file synced."""
    from pipeline.protocol.record import check_token_values
    from pipeline.rollout_log.digests import block_rows, digest

    frames = group_message(KEY, groups_per_message)
    per_flush = max(1, round(groups_per_flush / groups_per_message))  # messages per flush
    n_msgs = max(1, round(n_groups / groups_per_message))
    work = Path(tempfile.mkdtemp(prefix="tf-log-floor-", dir=root))  # ours alone (no mktemp race)
    journal, sealed = work / "floor.journal", work / "floor.h5"
    c0 = cpu_s()
    held = []
    fd = os.open(journal, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for i in range(n_msgs):
            cols = wire.decode(KEY, frames, MESSAGE_BYTES).arrays
            check_token_values(cols["prompt_ids"], cols["completion_ids"], cols["logprobs"], cols["versions"],
                               cols["completion_len"])
            held.append(cols)
            os.writev(fd, frames)
            if (i + 1) % per_flush == 0 or i + 1 == n_msgs:
                os.fdatasync(fd)
    finally:
        os.close(fd)
    with h5py.File(sealed, "w", libver="latest") as f:
        for name, first in held[0].items():
            parts = [cols[name] for cols in held]
            dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
            dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)  # as a seal: placed now, never filled
            d = f.create_dataset(name, shape=(len(first) * n_msgs, *first.shape[1:]), dtype=first.dtype,
                                 dcpl=dcpl, fill_time="never")
            wrote = os.pwritev(f.id.get_vfd_handle(), parts, d.id.get_offset())  # its rows where they lie
            assert wrote == sum(p.nbytes for p in parts), f"short write of {name}: {wrote} bytes"
            f.create_dataset(f"{name}.digests", data=digest(parts, block_rows(first)))
        f.flush()
        os.fdatasync(f.id.get_vfd_handle())
    cpu = (cpu_s() - c0) * n_groups / (n_msgs * groups_per_message)
    shutil.rmtree(work)
    return {"cpu_s": cpu}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="a raw ZeroMQ end of bench/ingest.py (not run by hand)")
    side = p.add_mutually_exclusive_group(required=True)
    side.add_argument("--raw-receiver", nargs=2, metavar=("ADDR_FILE", "MESSAGES"))
    side.add_argument("--raw-sender", nargs=3, metavar=("PORT", "MESSAGES", "GROUPS_PER_MESSAGE"))
    a = p.parse_args()
    if a.raw_receiver:
        raw_receiver(a.raw_receiver[0], int(a.raw_receiver[1]))
    else:
        raw_sender(int(a.raw_sender[0]), int(a.raw_sender[1]), int(a.raw_sender[2]))
