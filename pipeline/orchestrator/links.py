"""The other roles' side of the orchestrator protocol: generator and trainer links.

Messages (kinds) and their meta; arrays travel as raw frames (see `pipeline.wire`):

==============  =========================  ===================================================
kind            direction                  meta / arrays
==============  =========================  ===================================================
``hello``       generator -> orchestrator  generator_id; (a repeated hello re-issues its leases)
``want``        generator -> orchestrator  free (slots), received (work items got this epoch), epoch
``work``        orchestrator -> generator  epoch, version, items [[group, attempt, prompt, n]];
                                           arrays prompt_ids (flat), prompt_len
``result``      generator -> orchestrator  group_id, attempt, credit (a ``want``'s meta);
                                           arrays: the group's SampleBatch columns
``ack``         orchestrator -> generator  groups [[group, attempt, outcome]]
``get_batch``   trainer -> orchestrator    step, version (loaded by every generator), dp_size
``batch``       orchestrator -> trainer    step, trainer_version; arrays: SampleBatch columns,
                                           dp_rank
``version``     trainer -> orchestrator    version
``resume``      trainer -> orchestrator    step (the trainer restarted from the checkpoint after it)
``eval_request`` trainer -> orchestrator   step, version: run a held-out evaluation round
``eval_work``   orchestrator -> generator  step, indices; arrays prompt_ids (flat), prompt_len
``eval_result`` generator -> orchestrator  step; arrays: SampleBatch columns, eval_index
``weights``     trainer -> orchestrator    version: the trainer is about to broadcast it
``update``      orchestrator -> generator  version: join the broadcast and load it
``members``     trainer <-> orchestrator   (reply: members {identity: incarnation} of alive generators)
``regroup``     trainer -> orchestrator    epoch: a new weight group; forwarded to every generator,
                -> generator               which joins it (ranks and address in the rendezvous)
``finish``      trainer -> orchestrator    the run is over: stop the generators, then exit
``stop``        orchestrator -> generator  no more work will come: finish and exit
==============  =========================  ===================================================

Credits are absolute and idempotent: a generator says how many slots are free and how many work
items it has received from the orchestrator's current epoch; the orchestrator grants
``free - (granted_this_epoch - received)``, so a repeated or late ``want`` never over-grants and an
orchestrator restart (new epoch) starts the count afresh.

Durability: a generator keeps each result until it is acknowledged and re-sends it after
``resend_after_s``; the orchestrator acknowledges only after the flush covering the group, and
deduplicates, so a crash on either side loses no kept group and stores none twice.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.record import RecordError, RecordSchema, SampleBatch
from pipeline.transport import MessageClient, TransportConfig, TransportError, load_or_create_secret

RENDEZVOUS = "rendezvous/orchestrator.json"


def write_rendezvous(run_dir: Path, info: dict) -> None:
    path = Path(run_dir) / RENDEZVOUS
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, path)


def read_rendezvous(run_dir: Path, timeout_s: float) -> dict:
    path = Path(run_dir) / RENDEZVOUS
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            if time.monotonic() > deadline:
                raise TransportError(f"no orchestrator address in {path} after {timeout_s:.0f}s") from None
            time.sleep(0.05)


@dataclass
class EvalItem:
    step: int
    index: int
    """Index of the prompt in the held-out set."""
    prompt_ids: np.ndarray


@dataclass
class Control:
    """An instruction to the generator: ``regroup`` (join weight group ``epoch``), ``update``
    (load weights ``version``) or ``stop``."""
    kind: str
    version: int | None = None
    epoch: int | None = None


@dataclass
class WorkItem:
    group_id: int
    attempt: int
    prompt_id: int
    n: int
    prompt_ids: np.ndarray
    version: int
    """Policy version the orchestrator knew when it granted the item."""


def batch_arrays(batch: SampleBatch) -> dict[str, np.ndarray]:
    return dict(batch.columns)


def batch_from_arrays(arrays: dict[str, np.ndarray], schema: RecordSchema,
                      extra: tuple[str, ...] = ()) -> SampleBatch:
    cols = {k: v for k, v in arrays.items() if k not in extra}
    return SampleBatch(cols, schema, validate=True)


class _Link:
    def __init__(self, run_dir: Path, identity: str, cfg: TransportConfig, timeout_s: float):
        self.run_dir = Path(run_dir)
        self.cfg = cfg
        self.key = load_or_create_secret(self.run_dir)
        info = read_rendezvous(self.run_dir, timeout_s)
        self.address, self.orchestrator_epoch = info["address"], info.get("epoch")
        self.client = MessageClient(self.key, self.address, cfg, identity)

    def refresh_address(self) -> bool:
        """Reconnect if the orchestrator came back on another address; True if it restarted."""
        try:
            info = read_rendezvous(self.run_dir, 0.0)
        except TransportError:
            return False
        addr, restarted = info["address"], info.get("epoch") != self.orchestrator_epoch
        self.orchestrator_epoch = info.get("epoch")
        if addr != self.address:
            self.client.close()
            self.address = addr
            self.client = MessageClient(self.key, addr, self.cfg, self.client.sock.identity.decode())
        return restarted

    def close(self) -> None:
        self.client.close()


class GeneratorLink(_Link):
    """A generator's connection: credits out, work in, results out until acknowledged."""

    def __init__(self, run_dir: Path, generator_id: int, slots: int, schema: RecordSchema,
                 cfg: TransportConfig | None = None, resend_after_s: float = 5.0,
                 timeout_s: float = 60.0):
        super().__init__(run_dir, f"gen-{generator_id}", cfg or TransportConfig(), timeout_s)
        self.generator_id, self.slots, self.schema = generator_id, slots, schema
        self.loaded_version: int | None = None
        """Weights version this generator holds, told to the orchestrator with every credit update
        (admission counts a version only once every generator has loaded it); None: not told."""
        self.resend_after_s = resend_after_s
        self.epoch: str | None = None
        self.received = 0
        self.active: set[int] = set()
        self.unacked: dict[tuple[int, int], tuple[float, dict]] = {}
        self.outcomes: dict[str, int] = {}
        self.client.send("hello", {"generator_id": generator_id})
        self._last_want = 0.0

    def credit(self, open_: bool = True) -> dict:
        free = self.slots - len(self.active) if open_ else 0
        return {"free": free, "received": self.received, "epoch": self.epoch,
                "loaded": self.loaded_version}

    def follow_orchestrator(self) -> None:
        """Reconnect to a restarted orchestrator and introduce ourselves again (it then sends the
        weight group and version to load, like to any new generator)."""
        if self.refresh_address():
            self.client.send("hello", {"generator_id": self.generator_id})

    def send_want(self, open_: bool = True) -> None:
        self.follow_orchestrator()
        self.client.send("want", self.credit(open_))
        self._last_want = time.monotonic()

    def poll(self, timeout_s: float, send_credit: bool = True) -> list[WorkItem | EvalItem | Control]:
        """Work granted within ``timeout_s``; handles acks, re-sends and a credit update each second
        (a zero credit while ``send_credit`` is False: the generator is alive but takes no work)."""
        now = time.monotonic()
        if now - self._last_want > 1.0:
            self.send_want(send_credit)
        for key, (t, arrays) in list(self.unacked.items()):
            if now - t > self.resend_after_s:
                self.follow_orchestrator()
                self.client.send("result", {"group_id": key[0], "attempt": key[1]}, arrays)
                self.unacked[key] = (now, arrays)
        items: list[WorkItem | EvalItem | Control] = []
        deadline = now + timeout_s
        while True:
            msg = self.client.recv(max(0.0, deadline - time.monotonic()))
            if msg is None:
                return items
            if msg.kind in ("update", "stop", "regroup"):
                items.append(Control(msg.kind, msg.meta.get("version"), msg.meta.get("epoch")))
                return items
            if msg.kind == "eval_work":
                ids, lens = msg.arrays["prompt_ids"], msg.arrays["prompt_len"]
                off = np.concatenate(([0], np.cumsum(lens)))
                items.extend(EvalItem(msg.meta["step"], idx, ids[off[j]:off[j + 1]])
                             for j, idx in enumerate(msg.meta["indices"]))
                return items
            if msg.kind == "work":
                if msg.meta["epoch"] != self.epoch:
                    self.epoch, self.received = msg.meta["epoch"], 0
                ids, lens = msg.arrays["prompt_ids"], msg.arrays["prompt_len"]
                off = np.concatenate(([0], np.cumsum(lens)))
                for j, (gid, attempt, pid, n) in enumerate(msg.meta["items"]):
                    self.received += 1
                    self.active.add(gid)
                    items.append(WorkItem(gid, attempt, pid, n, ids[off[j]:off[j + 1]], msg.meta["version"]))
                return items
            if msg.kind == "ack":
                for gid, attempt, outcome in msg.meta["groups"]:
                    self.unacked.pop((gid, attempt), None)
                    self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    def send_result(self, item: WorkItem, batch: SampleBatch) -> None:
        arrays = batch_arrays(batch)
        self.unacked[(item.group_id, item.attempt)] = (time.monotonic(), arrays)
        self.active.discard(item.group_id)
        # the freed slot travels with the result: no separate ``want`` message per group
        self.client.send("result", {"group_id": item.group_id, "attempt": item.attempt,
                                    "credit": self.credit()}, arrays)


    def send_eval_result(self, step: int, indices: np.ndarray, batch: SampleBatch) -> None:
        arrays = batch_arrays(batch)
        arrays["eval_index"] = np.asarray(indices, np.int64)
        self.client.send("eval_result", {"step": step}, arrays)


class TrainerLink(_Link):
    """The trainer's connection: reports versions and pulls step batches."""

    def __init__(self, run_dir: Path, schema: RecordSchema, cfg: TransportConfig | None = None,
                 timeout_s: float = 60.0, rank: int = 0):
        super().__init__(run_dir, f"trainer-{rank}", cfg or TransportConfig(), timeout_s)
        self.schema = schema

    def report_version(self, version: int) -> None:
        self.client.send("version", {"version": version})

    def resume(self, step: int) -> None:
        """Tell the orchestrator the trainer restarted from the checkpoint taken after ``step`` steps."""
        self.client.send("resume", {"step": step})

    def request_eval(self, step: int, version: int) -> None:
        self.client.send("eval_request", {"step": step, "version": version})

    def announce_weights(self, version: int) -> None:
        """Ask every generator to join the broadcast of ``version`` that follows."""
        self.client.send("weights", {"version": version})

    def finish(self) -> None:
        self.client.send("finish", {})

    def members(self, timeout_s: float) -> dict[str, int]:
        """Alive generators (identity -> incarnation), as the orchestrator sees them."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.client.send("members", {})
            msg = self.client.recv(min(2.0, max(0.0, deadline - time.monotonic())))
            while msg is not None and msg.kind != "members":
                msg = self.client.recv(0.5)  # a stray batch reply of an earlier retry
            if msg is not None:
                return {str(k): int(v) for k, v in msg.meta["members"].items()}
            self.refresh_address()
        raise TransportError(f"the orchestrator did not list the generators within {timeout_s:.0f}s")

    def regroup(self, epoch: int) -> None:
        self.client.send("regroup", {"epoch": epoch})

    def get_batch(self, step: int, version: int, dp_size: int, timeout_s: float,
                  dp_rank: int | None = None,
                  retry_s: float = 2.0) -> tuple[SampleBatch, np.ndarray]:
        """The batch of ``step`` (only ``dp_rank``'s share if given): (samples, dp rank of each).

        Re-asks every ``retry_s`` (the orchestrator may have restarted); raises TransportError
        after ``timeout_s`` without a batch.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.client.send("get_batch", {"step": step, "version": version, "dp_size": dp_size,
                                           "dp_rank": dp_rank})
            until = min(deadline, time.monotonic() + retry_s)
            while time.monotonic() < until:
                msg = self.client.recv(max(0.0, until - time.monotonic()))
                if msg is None:
                    break
                if msg.kind == "batch" and msg.meta.get("step") == step:
                    try:
                        batch = batch_from_arrays(msg.arrays, self.schema, ("dp_rank",))
                    except RecordError as exc:
                        raise TransportError(f"step {step} batch is invalid: {exc}") from None
                    return batch, msg.arrays["dp_rank"]
            self.refresh_address()
        raise TransportError(f"no batch for step {step} within {timeout_s:.0f}s")
