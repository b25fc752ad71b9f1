"""The other roles' side of the orchestrator protocol: generator and trainer links.

Messages are the typed records of `pipeline.protocol.messages` (one per kind; who sends
which is written there). A starting generator sends `StartProgress` (from its own socket,
`pipeline.generator.start_report`); a generator sends `Hello`, then `Want` credit updates, `Result` and
`EvalResult`, and `Leave` when it departs; it receives `Work`, `Ack`, `EvalWork`, `Update`, `Regroup`, `Stop`. The trainer sends
`TrainerVersion`, `Resume`, `GetBatch`, `EvalRequest`, `WeightsAnnounced`, `ListMembers`,
`Regroup`, `Finish` and receives `Batch` and `Members`. Either may receive an `Error` naming a
message of its own the orchestrator could not take; it is logged and counted (``errors``).

Credits are absolute and idempotent: a generator says how many slots are free and how many work
items it has received from the orchestrator's current incarnation; the orchestrator grants
``free - (granted_this_incarnation - received)``, so a repeated or late ``want`` never over-grants
and an orchestrator restart (new incarnation) starts the count afresh.

Durability: a generator keeps each result until it is acknowledged and re-sends it after
``resend_after_s``; the orchestrator acknowledges only after the flush covering the group, and
deduplicates, so a crash on either side loses no kept group and stores none twice.

Results travel together: a generator queues each finished group (`GeneratorLink.queue_result`)
and its next `GeneratorLink.poll` (the role's loop calls it every iteration) sends every queued
group in one `Result` (more only past ``max_groups_per_result`` groups or ``max_message_mb``
bytes), with one credit; re-sends of groups due together are packed the same way. What it adds
to an acknowledgement's latency is the rest of one loop iteration: the generator role's loop
polls every ~5 ms (a 2 ms poll and a 3 ms sleep), against the orchestrator's 20 ms
``flush_interval_s`` that every acknowledgement waits for anyway; the load generator
(``tests/support/loadgen.py``) polls right after answering a `Work`, so it adds nothing. Worked
example: a `Work` of 4 groups of 8 x 1K-token samples is answered by one ~400 KB `Result` of 4
groups (32 samples) instead of four ~100 KB ones: the orchestrator receives, authenticates,
decodes, role-checks and layout-checks one message, not four.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import zmq

from pipeline.protocol import messages as m
from pipeline.protocol.record import RecordError, RecordSchema
from pipeline.protocol.sample_batch import SampleBatch
from pipeline.protocol.roles import ORCHESTRATOR_SERVES
from pipeline.run_files import ORCHESTRATOR_RENDEZVOUS
from pipeline.protocol.transport import (MessageClient, MessageServer, TransportConfig, TransportError,
                                load_or_create_secret)

log = logging.getLogger(__name__)

HEADER_ROOM = 64 << 10
"""Bytes of a `Result`'s bound left for its header (group pairs, credit, array descriptors)."""


def write_rendezvous(run_dir: Path, info: dict) -> None:
    path = Path(run_dir) / ORCHESTRATOR_RENDEZVOUS
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, path)


def read_rendezvous(run_dir: Path, timeout_s: float) -> dict:
    path = Path(run_dir) / ORCHESTRATOR_RENDEZVOUS
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


Control = m.Regroup | m.Update | m.Stop
"""An instruction to the generator: join weight group ``weight_epoch``, load weights ``version``, stop."""


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


def bind_server(run_dir: Path, cfg: TransportConfig) -> MessageServer:
    """The orchestrator's endpoint: where the previous incarnation listened if possible, so peers
    reconnect by themselves."""
    key = load_or_create_secret(run_dir)
    if cfg.port == 0:
        try:
            prev = int(read_rendezvous(run_dir, 0.0)["address"].rsplit(":", 1)[1])
            return MessageServer(key, replace(cfg, port=prev), ORCHESTRATOR_SERVES)
        except (TransportError, ValueError, KeyError, zmq.ZMQError):
            pass
    return MessageServer(key, cfg, ORCHESTRATOR_SERVES)


class _Link:
    def __init__(self, run_dir: Path, identity: str, cfg: TransportConfig, timeout_s: float):
        self.run_dir = Path(run_dir)
        self.cfg = cfg
        self.key = load_or_create_secret(self.run_dir)
        info = read_rendezvous(self.run_dir, timeout_s)
        self.address, self.orchestrator_incarnation = info["address"], info.get("incarnation")
        self.client = MessageClient(self.key, self.address, cfg, identity)
        self.errors = 0
        """Messages rejected by either end (an `Error` answer, or a malformed message received)."""

    def send(self, msg) -> None:
        self.client.send(*m.encode(msg))

    def recv(self, timeout_s: float):
        """The next well-formed record within ``timeout_s`` (None if none); `Error` answers and
        malformed messages are logged and counted, never returned."""
        deadline = time.monotonic() + timeout_s
        while True:
            raw = self.client.recv(max(0.0, deadline - time.monotonic()))
            if raw is None:
                return None
            try:
                msg = m.decode(raw)
            except m.MessageError as exc:
                self.errors += 1
                log.warning("malformed message from the orchestrator: %s", exc)
                continue
            if isinstance(msg, m.Error):
                self.errors += 1
                log.warning("the orchestrator rejected our %s: %s", msg.kind, msg.detail)
                continue
            return msg

    def refresh_address(self) -> bool:
        """Reconnect if the orchestrator came back on another address; True if it restarted."""
        try:
            info = read_rendezvous(self.run_dir, 0.0)
        except TransportError:
            return False
        addr, restarted = info["address"], info.get("incarnation") != self.orchestrator_incarnation
        self.orchestrator_incarnation = info.get("incarnation")
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
                 timeout_s: float = 60.0, job: str = ""):
        super().__init__(run_dir, f"gen-{generator_id}", cfg or TransportConfig(), timeout_s)
        self.generator_id, self.slots, self.schema, self.job = generator_id, slots, schema, job
        self.left = False
        """Sent `Leave`: no credit updates (nor a new Hello) follow."""
        self.loaded_version: int | None = None
        """Weights version this generator holds, told to the orchestrator with every credit update
        (admission counts a version only once every generator has loaded it); None: not told."""
        self.resend_after_s = resend_after_s
        self.work_incarnation: str | None = None
        """The orchestrator incarnation ``received`` counts in (that of the last `Work`)."""
        self.received = 0
        self.active: set[int] = set()
        self.queued: list[tuple[tuple[int, int], dict[str, np.ndarray]]] = []
        """Finished groups ((group id, attempt), columns) the next `send_results` sends."""
        self.unacked: dict[tuple[int, int], tuple[float, dict]] = {}
        self.outcomes: dict[str, int] = {}
        self.send(m.Hello(generator_id, job))
        self._last_want = 0.0

    def credit(self, open_: bool = True) -> m.Credit:
        free = self.slots - len(self.active) if open_ else 0
        return m.Credit(free, self.received, self.work_incarnation, self.loaded_version)

    def follow_orchestrator(self) -> None:
        """Reconnect to a restarted orchestrator and introduce ourselves again (it then sends the
        weight group and version to load, like to any new generator)."""
        if self.refresh_address() and not self.left:
            self.send(m.Hello(self.generator_id, self.job))

    def send_want(self, open_: bool = True) -> None:
        self.follow_orchestrator()
        self.send(m.Want(self.credit(open_)))
        self._last_want = time.monotonic()

    def poll(self, timeout_s: float, send_credit: bool = True) -> list[WorkItem | EvalItem | Control]:
        """Work granted within ``timeout_s``; handles acks, re-sends and a credit update each second
        (a zero credit while ``send_credit`` is False: the generator is alive but takes no work)."""
        self.send_results()
        now = time.monotonic()
        if now - self._last_want > 1.0 and not self.left:
            self.send_want(send_credit)
        due = [(key, arrays) for key, (t, arrays) in self.unacked.items() if now - t > self.resend_after_s]
        if due:
            self.follow_orchestrator()
            for key, arrays in due:
                self.unacked[key] = (now, arrays)
            self._send_packed(due, None)
        items: list[WorkItem | EvalItem | Control] = []
        deadline = now + timeout_s
        while True:
            msg = self.recv(max(0.0, deadline - time.monotonic()))
            if msg is None:
                return items
            if isinstance(msg, Control):
                items.append(msg)
                return items
            if isinstance(msg, m.EvalWork):
                items.extend(EvalItem(msg.step, idx, p)
                             for idx, p in zip(msg.indices, _split_prompts(msg.arrays)))
                return items
            if isinstance(msg, m.Work):
                if msg.incarnation != self.work_incarnation:
                    self.work_incarnation, self.received = msg.incarnation, 0
                for (gid, attempt, pid, n), prompt in zip(msg.items, _split_prompts(msg.arrays)):
                    self.received += 1
                    self.active.add(gid)
                    items.append(WorkItem(gid, attempt, pid, n, prompt, msg.version))
                return items
            if isinstance(msg, m.Ack):
                for gid, attempt, outcome in msg.groups:
                    self.unacked.pop((gid, attempt), None)
                    self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    def leave(self) -> None:
        """Depart: give back every group not yet sent (the orchestrator re-issues them at once);
        results sent (the queued ones now) stay re-sent until acknowledged."""
        self.send_results()
        self.send(m.Leave(self.generator_id, len(self.active)))
        self.active.clear()
        self.left = True

    def close(self) -> None:
        self.send_results()
        if self.left:  # the Leave (just sent) must reach the orchestrator: a second to deliver it
            self.client.sock.close(linger=1000)
        else:
            super().close()

    def queue_result(self, item: WorkItem, batch: SampleBatch) -> None:
        """A finished group: its slot is free now; it leaves with the others queued at the next
        `poll` (`send_results`)."""
        self.queued.append(((item.group_id, item.attempt), batch_arrays(batch)))
        self.active.discard(item.group_id)

    def send_results(self) -> None:
        """Send the queued groups, packed (module docstring); each stays unacknowledged until its
        `Ack`. The freed slots travel with them: no separate ``want`` message."""
        if not self.queued:
            return
        queued, self.queued = self.queued, []
        now = time.monotonic()
        for key, arrays in queued:
            self.unacked[key] = (now, arrays)
        self._send_packed(queued, self.credit())

    def _send_packed(self, results: list[tuple[tuple[int, int], dict[str, np.ndarray]]],
                     credit: m.Credit | None) -> None:
        """``results`` in order, in as few `Result` messages as ``max_groups_per_result`` and
        ``max_message_mb`` allow (a group alone past the byte bound still goes, and is dropped as
        oversized by the orchestrator's transport, as it would be alone)."""
        limit = int(self.cfg.max_message_mb * 2**20) - HEADER_ROOM
        pack: list[tuple[tuple[int, int], dict[str, np.ndarray]]] = []
        size = 0
        for key, arrays in results:
            nbytes = sum(a.nbytes for a in arrays.values())
            if pack and (len(pack) == self.cfg.max_groups_per_result or size + nbytes > limit):
                self._send_pack(pack, credit)
                pack, size = [], 0
            pack.append((key, arrays))
            size += nbytes
        if pack:
            self._send_pack(pack, credit)

    def _send_pack(self, pack: list[tuple[tuple[int, int], dict[str, np.ndarray]]], credit: m.Credit | None) -> None:
        arrays = pack[0][1] if len(pack) == 1 else {
            name: np.concatenate([cols[name] for _, cols in pack]) for name in pack[0][1]}
        self.send(m.Result([list(key) for key, _ in pack], credit, arrays))

    def send_eval_result(self, step: int, indices: np.ndarray, batch: SampleBatch) -> None:
        arrays = batch_arrays(batch)
        arrays["eval_index"] = np.asarray(indices, np.int64)
        self.send(m.EvalResult(step, arrays))


class TrainerLink(_Link):
    """The trainer's connection: reports versions and pulls step batches."""

    def __init__(self, run_dir: Path, schema: RecordSchema, cfg: TransportConfig | None = None,
                 timeout_s: float = 60.0, rank: int = 0):
        super().__init__(run_dir, f"trainer-{rank}", cfg or TransportConfig(), timeout_s)
        self.schema = schema

    def report_version(self, version: int) -> None:
        self.send(m.TrainerVersion(version))

    def resume(self, step: int) -> None:
        """Tell the orchestrator the trainer restarted from the checkpoint taken after ``step`` steps."""
        self.send(m.Resume(step))

    def request_eval(self, step: int, version: int) -> None:
        self.send(m.EvalRequest(step, version))

    def announce_weights(self, version: int, weight_epoch: int = 0) -> None:
        """Ask every generator to join the broadcast of ``version`` that follows, into weight group
        ``weight_epoch``."""
        self.send(m.WeightsAnnounced(version, weight_epoch))

    def finish(self) -> None:
        self.send(m.Finish())

    def members(self, timeout_s: float) -> dict[str, int]:
        """Alive generators (identity -> incarnation), as the orchestrator sees them."""
        return self.membership(timeout_s).members

    def membership(self, timeout_s: float) -> m.Members:
        """The orchestrator's `Members`: alive generators and the starting ones."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.send(m.ListMembers())
            msg = self.recv(min(2.0, max(0.0, deadline - time.monotonic())))
            while msg is not None and not isinstance(msg, m.Members):
                msg = self.recv(0.5)  # a stray batch reply of an earlier retry
            if msg is not None:
                return msg
            self.refresh_address()
        raise TransportError(f"the orchestrator did not list the generators within {timeout_s:.0f}s")

    def regroup(self, weight_epoch: int) -> None:
        self.send(m.Regroup(weight_epoch))

    def get_batch(self, step: int, version: int, dp_size: int, timeout_s: float,
                  dp_rank: int | None = None,
                  retry_s: float = 2.0) -> tuple[SampleBatch, np.ndarray]:
        """The batch of ``step`` (only ``dp_rank``'s share if given): (samples, dp rank of each).

        Re-asks every ``retry_s`` (the orchestrator may have restarted); raises TransportError
        after ``timeout_s`` without a batch.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.send(m.GetBatch(step, version, dp_size, dp_rank))
            until = min(deadline, time.monotonic() + retry_s)
            while time.monotonic() < until:
                msg = self.recv(max(0.0, until - time.monotonic()))
                if msg is None:
                    break
                if isinstance(msg, m.Batch) and (msg.step, msg.dp_rank) == (step, dp_rank):
                    try:
                        batch = batch_from_arrays(msg.arrays, self.schema, ("dp_rank",))
                    except RecordError as exc:
                        raise TransportError(f"step {step} batch is invalid: {exc}") from None
                    return batch, msg.arrays["dp_rank"]
            self.refresh_address()
        raise TransportError(f"no batch for step {step} within {timeout_s:.0f}s")


def _split_prompts(arrays: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The flat ``prompt_ids`` frame cut by ``prompt_len``."""
    ids, lens = arrays["prompt_ids"], arrays["prompt_len"]
    off = np.concatenate(([0], np.cumsum(lens)))
    return [ids[off[j]:off[j + 1]] for j in range(len(lens))]


def prompt_arrays(prompts: list[np.ndarray]) -> dict[str, np.ndarray]:
    """Prompts as the ``prompt_ids`` (flat) and ``prompt_len`` frames of `Work` / `EvalWork`."""
    return {"prompt_ids": np.concatenate(prompts), "prompt_len": np.array([len(p) for p in prompts], np.int32)}
