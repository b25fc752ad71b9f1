"""The orchestrator's side of the scorer roles: groups out, rewards and teacher logprobs back.

`RemoteScoring` stands where `AsyncScoring` stands (same ``submit`` / ``completed`` / ``close``)
and is pumped by the orchestrator's loop through ``completed()``: it never blocks (socket reads
with a zero timeout). It owns its own ROUTER socket; scorer processes (`pipeline.scorers.role`)
find its address in ``RUN/rendezvous/scorers.json`` and connect as DEALERs. Messages are the
typed records of `pipeline.protocol.scorer_pool` (`wire` messages: msgpack header + raw array
frames, signed with the run secret; no pickle):

  scorer -> pool   `ScorerHello` {service, rank, slots, follows_weights}; `ScorerAlive` every
                   second; `Scored` {request, jobs, error} + one array per filled field
  pool -> scorer   `Score` {request, jobs, schema} + the groups' columns (one SampleBatch)
  pool -> teacher  `WeightsRegroup` {weight_epoch}, `WeightsUpdate` {version, weight_epoch}: the orchestrator's
                   weight-group changes and update announcements, to a lagged teacher (one that
                   said ``follows_weights``; `pipeline.scorers.lagged`)

Invariants:
- a group needs every configured service ("reward": reward model or process rewards; "teacher":
  teacher logprobs); a service's answer for a group is taken ONCE: the first answer wins, a later
  one (a re-sent request answered twice) is counted as ``duplicate`` and ignored;
- a request unanswered after ``timeout_s``, or held by a scorer that is silent for
  ``dead_after_s`` or that says hello again under a new identity (a restarted process), goes back
  to the front of its service's queue and is re-sent to a live scorer: a dying scorer costs no
  group. After ``max_attempts`` sends the group completes with an error (``score_error``);
- a scorer's own error answer (bad input) fails the group at once (retrying would fail again);
- a message that is not a well-formed record is counted (``bad_message``), logged and dropped;
- at most ``inflight_batches`` requests per scorer, each of at most ``batch_groups`` groups;
- a live teacher that follows the weights is a member of the trainer's weight group, named
  ``teacher-<rank>`` with an incarnation that changes only when it restarts (`weight_members`), so
  the trainer builds it into the next group and a dead one (dropped as above) out of it. Weight
  messages go to the newest process of each rank even while it is dropped for silence (a long
  scoring request): it may still be a member of the group the trainer broadcasts into.

Worked example: two reward scorers, ``batch_groups=4``; 6 groups arrive: scorer A gets groups
0-3, scorer B groups 4-5. A is killed: after ``dead_after_s`` without a heartbeat, groups 0-3
return to the queue and go to B (attempt 2); each group's reward is recorded once.
"""
from __future__ import annotations

import itertools
import json
import logging
import os
import time
from collections import Counter, deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import zmq

from pipeline.orchestrator.prompts import PromptItem
from pipeline.orchestrator.scoring import Scorer, Scoring, checked_rewards
from pipeline.protocol.codec import MessageError, encode
from pipeline.protocol.record import RecordSchema
from pipeline.protocol.sample_batch import SampleBatch
from pipeline.protocol.roles import SCORER_POOL_SERVES
from pipeline.protocol.scorer_pool import (SCORER_POOL, Score, Scored, ScorerHello, ScorerStop, ScorerWho,
                                           WeightsRegroup, WeightsUpdate)
from pipeline.protocol.transport import MessageServer, TransportConfig, TransportError, load_or_create_secret
from pipeline.scorers.config import ScorersConfig

log = logging.getLogger(__name__)

#: Where the scorer pool publishes its address, relative to the run directory.
SCORERS_RENDEZVOUS = "rendezvous/scorers.json"
#: Fields each service fills.
SERVICE_FIELDS = {"reward": ("reward", "token_rewards"), "teacher": ("teacher_logprobs",)}


def lagged_teacher_version(policy_version: int, lag: int, every: int) -> int:
    """The snapshot a lagged teacher uses while the policy is at ``policy_version``: the newest
    multiple of ``every`` (the refresh interval, ``run.checkpoint_every``) at most ``lag`` behind, so it lies in
    [v - lag - every + 1, v - lag]; before the policy reaches ``lag``, version 0 (the initial
    weights). Example: lag 2, every 3: v = 2..4 -> 0, v = 5..7 -> 3, v = 8 -> 6."""
    return max(0, (policy_version - lag) // every * every)


def generation_schema(schema: RecordSchema) -> RecordSchema:
    """What generators send: the stored schema without the fields scorers fill."""
    return replace(schema, token_rewards=False, teacher_logprobs=False)


@dataclass
class _Job:
    key: Any
    group: SampleBatch
    needs: set[str]
    results: dict[str, np.ndarray] = field(default_factory=dict)
    attempts: Counter = field(default_factory=Counter)
    error: str | None = None


@dataclass
class _Peer:
    service: str
    rank: int
    slots: int
    last_seen: float
    follows_weights: bool = False
    requests: set[int] = field(default_factory=set)


@dataclass
class _Request:
    peer: bytes
    service: str
    jobs: list[int]
    sent: float


class RemoteScoring(Scoring):
    """Sends groups to scorer processes and collects their answers (see the module docstring)."""

    def __init__(self, run_dir: Path, cfg: ScorersConfig, schema: RecordSchema,
                 verifier: Scorer | None, transport: TransportConfig, refresh_every: int = 1):
        """``refresh_every``: M, the steps between a lagged teacher's refreshes (the trainer's
        checkpoint interval, so a teacher that missed a broadcast finds that version on disk)."""
        self.cfg, self.schema, self.verifier = cfg, schema, verifier
        self.refresh_every = refresh_every
        self.policy_version: Callable[[], int] = lambda: 0
        self.services = cfg.services()
        if ("reward" in self.services) == (verifier is not None):
            raise ValueError("rewards come either from a reward scorer role or from the verifier")
        self.wire_schema = generation_schema(schema).to_dict()
        self.server = _bind(Path(run_dir), transport)
        _publish(Path(run_dir), {"address": self.server.address})
        self.jobs: dict[int, _Job] = {}
        self.queues: dict[str, deque[int]] = {s: deque() for s in self.services}
        self.peers: dict[bytes, _Peer] = {}
        self.requests: dict[int, _Request] = {}
        self._ids = itertools.count()
        self.counts: Counter[str] = Counter()
        self.followers: dict[int, bytes] = {}  # rank -> the newest teacher process following the weights
        self.incarnations: dict[bytes, int] = {}  # scorer identity -> its incarnation number
        self.samples: Counter[str] = Counter()

    # -- the Scoring interface ------------------------------------------------------------------
    def submit(self, key: Any, group: SampleBatch, prompt: PromptItem) -> None:
        job = _Job(key, group, set(self.services))
        if self.verifier is not None:  # rewards from the task's verifier, the rest from scorers
            try:
                job.results["reward"] = checked_rewards(self.verifier.score(group, prompt), len(group))
            except Exception as exc:  # reported as the group's error, like AsyncScoring
                job.error = f"verifier: {exc}"
        jid = next(self._ids)
        self.jobs[jid] = job
        for s in (job.needs if job.error is None else ()):
            self.queues[s].append(jid)

    def completed(self) -> Iterator[tuple[Any, SampleBatch, np.ndarray | None, BaseException | None]]:
        self._pump()
        for jid in [j for j, job in self.jobs.items() if job.error or not job.needs]:
            job = self.jobs.pop(jid)
            if job.error:
                yield job.key, job.group, None, RuntimeError(job.error)
            else:
                yield job.key, self._filled(job), job.results["reward"], None

    def bind_clock(self, clock) -> None:
        """Follow the orchestrator's policy clock: the trainer's last reported version."""
        self.policy_version = lambda: clock.reported or 0

    def weight_members(self) -> dict[str, int]:
        """Live teachers that receive the weights: ``teacher-<rank>`` -> incarnation."""
        return {f"teacher-{p.rank}": self.incarnations[peer] for peer, p in self.peers.items() if p.follows_weights}

    def regroup(self, weight_epoch: int) -> None:
        """The trainer built weight group ``weight_epoch``: tell the teachers that receive weights."""
        self._to_followers(WeightsRegroup(int(weight_epoch)))

    def weights_announced(self, version: int, weight_epoch: int = 0) -> None:
        """The trainer is about to broadcast ``version`` into weight group ``weight_epoch``: the followers
        receive it too."""
        self._to_followers(WeightsUpdate(int(version), int(weight_epoch)))

    def _to_followers(self, msg: WeightsRegroup | WeightsUpdate) -> None:
        for peer in list(self.followers.values()):
            if not self.server.send(peer, *encode(msg)):
                self.counts["send_failed"] += 1
                if peer in self.peers:
                    self._drop_peer(peer)

    def metrics(self) -> dict[str, float]:
        live = Counter(p.service for p in self.peers.values())
        return {**{f"scorer_{k}": v for k, v in self.counts.items()},
                **{f"scorers_live_{s}": live[s] for s in self.services},
                **{f"scored_samples_{s}": n for s, n in self.samples.items()},
                "scoring_queued": sum(len(q) for q in self.queues.values())}

    def close(self) -> None:
        """The run is over: every scorer is told to leave."""
        for peer in self.peers:
            self.server.send(peer, *encode(ScorerStop()))
        time.sleep(0.1)  # let ZeroMQ hand the stops over before the socket closes (linger 0)
        self.server.close()

    # -- the loop -------------------------------------------------------------------------------
    def _pump(self) -> None:
        got = self.server.recv(0)
        while got is not None:
            self._handle(*got)
            got = self.server.recv(0)
        now = time.monotonic()
        for peer in [p for p, info in self.peers.items() if now - info.last_seen > self.cfg.dead_after_s]:
            log.warning("scorer %r silent for %.0fs: its requests are re-sent", peer, self.cfg.dead_after_s)
            self.counts["lost"] += 1
            self._drop_peer(peer)
        for rid in [r for r, req in self.requests.items() if now - req.sent > self.cfg.timeout_s]:
            self.counts["timeouts"] += 1
            self._requeue(rid)
        self._dispatch(now)

    def _handle(self, peer: bytes, raw) -> None:
        now = time.monotonic()
        try:
            msg = SCORER_POOL.decode(raw)
        except MessageError as exc:
            log.warning("scorer %r sent a bad message: %s", peer, exc)
            self.counts["bad_message"] += 1
            if peer in self.peers:  # still alive
                self.peers[peer].last_seen = now
            return
        if isinstance(msg, ScorerHello):
            service, rank = msg.service, msg.rank
            if service not in self.queues:
                log.warning("scorer %r offers %r, which this run does not use", peer, service)
                return
            for old in [p for p, info in self.peers.items() if (info.service, info.rank) == (service, rank)
                        and p != peer]:  # the same rank restarted: the old process is gone
                self.counts["restarted"] += 1
                self._drop_peer(old)
            if peer not in self.peers:
                follows = msg.follows_weights
                self.peers[peer] = _Peer(service, rank, msg.slots, now, follows)
                self.incarnations.setdefault(peer, next(self._ids))
                if follows:
                    self.followers[rank] = peer
        elif peer not in self.peers:
            self.server.send(peer, *encode(ScorerWho()))  # we restarted (or it was dropped): say hello again
            return
        elif isinstance(msg, Scored):
            self._on_scored(peer, msg)
        self.peers[peer].last_seen = now

    def _on_scored(self, peer: bytes, msg: Scored) -> None:
        rid, jids, error = msg.request, msg.jobs, msg.error
        req = self.requests.pop(rid, None)
        service = req.service if req else self.peers[peer].service
        self.peers[peer].requests.discard(rid)
        live = [j for j in jids if j in self.jobs and service in self.jobs[j].needs]
        self.counts["duplicate"] += len(jids) - len(live)
        if not live:
            return
        if error:
            for j in live:
                self.jobs[j].error = f"{service} scorer: {error}"
            return
        try:
            parts = self._split(msg.arrays, service, jids)
        except ValueError as exc:
            for j in live:
                self.jobs[j].error = f"{service} scorer answered badly: {exc}"
            return
        for j in live:
            job = self.jobs[j]
            job.results.update(parts[j])
            if service == "teacher":
                job.results["teacher_version"] = -1 if msg.teacher_version is None else msg.teacher_version
            job.needs.discard(service)
            self.samples[service] += len(job.group)
            self._unqueue(service, j)

    def _split(self, arrays: dict[str, np.ndarray], service: str, jids: list[int]) -> dict[int, dict]:
        """Per job, the fields of ``service`` cut from the answer's concatenated arrays."""
        rows, toks = arrays.get("group_rows"), arrays.get("group_tokens")
        if rows is None or toks is None or rows.shape != (len(jids),) or toks.shape != (len(jids),):
            raise ValueError("group_rows / group_tokens missing or of the wrong length")
        for j, n, t in zip(jids, rows.tolist(), toks.tolist()):
            if j in self.jobs and (n, t) != (len(self.jobs[j].group), self.jobs[j].group.num_completion_tokens):
                raise ValueError(f"sizes of job {j} differ from the group sent")
        rows, toks = rows.tolist(), toks.tolist()
        out: dict[int, dict] = {j: {} for j in jids}
        for name in SERVICE_FIELDS[service]:
            if name == "reward" and self.verifier is not None:
                continue
            if name == "token_rewards" and not self.schema.token_rewards:
                continue
            per_token = name != "reward"
            arr = arrays.get(name)
            sizes = toks if per_token else rows
            if arr is None or arr.shape != (sum(sizes),):
                raise ValueError(f"{name}: expected {sum(sizes)} values, got "
                                 f"{None if arr is None else arr.shape}")
            if not np.isfinite(arr).all():
                raise ValueError(f"{name} holds a non-finite value")
            for j, piece in zip(jids, np.split(arr, np.cumsum(sizes)[:-1])):
                out[j][name] = piece.astype(np.float32)
        return out

    def _dispatch(self, now: float) -> None:
        for peer in list(self.peers):
            info = self.peers[peer]
            queue = self.queues[info.service]
            while queue and len(info.requests) < min(info.slots, self.cfg.inflight_batches):
                jids = [queue.popleft() for _ in range(min(self.cfg.batch_groups, len(queue)))]
                batch = SampleBatch.concat([self.jobs[j].group for j in jids])
                rid = next(self._ids)
                teacher_version = None
                if info.service == "teacher" and self.cfg.teacher == "lagged":
                    teacher_version = lagged_teacher_version(
                        self.policy_version(), self.cfg.teacher_lag, self.refresh_every)
                request = Score(rid, jids, self.wire_schema, teacher_version, batch.columns)
                if not self.server.send(peer, *encode(request)):
                    # gone (ZeroMQ no longer routes to it) or its queue is full: not an attempt
                    self.counts["send_failed"] += 1
                    queue.extendleft(reversed(jids))
                    self._drop_peer(peer)
                    break
                for j in jids:
                    self.jobs[j].attempts[info.service] += 1
                self.requests[rid] = _Request(peer, info.service, jids, now)
                info.requests.add(rid)
                self.counts["requests"] += 1

    def _requeue(self, rid: int) -> None:
        req = self.requests.pop(rid)
        if req.peer in self.peers:
            self.peers[req.peer].requests.discard(rid)
        back = []
        for j in req.jobs:
            job = self.jobs.get(j)
            if job is None or req.service not in job.needs or job.error:
                continue
            if job.attempts[req.service] >= self.cfg.max_attempts:
                job.error = f"{req.service} scoring failed {job.attempts[req.service]} times"
                continue
            back.append(j)
        self.counts["resent_groups"] += len(back)
        self.queues[req.service].extendleft(reversed(back))

    def _drop_peer(self, peer: bytes) -> None:
        info = self.peers.pop(peer)
        for rid in sorted(info.requests):
            if rid in self.requests:
                self._requeue(rid)

    def _unqueue(self, service: str, jid: int) -> None:
        q = self.queues[service]
        if jid in q:
            q.remove(jid)

    def _filled(self, job: _Job) -> SampleBatch:
        cols = dict(job.group.columns)
        for name in ("token_rewards", "teacher_logprobs"):
            if name in self.schema.token_fields():
                cols[name] = job.results[name]
        if "teacher_version" in self.schema.scalar_columns():
            cols["teacher_version"] = np.full(len(job.group), job.results["teacher_version"], np.int32)
        return SampleBatch(cols, self.schema, validate=True)


def _bind(run_dir: Path, transport: TransportConfig) -> MessageServer:
    """Bind where the previous incarnation listened if possible, so scorers reconnect by themselves."""
    key = load_or_create_secret(run_dir)
    try:
        prev = int(json.loads((run_dir / SCORERS_RENDEZVOUS).read_text())["address"].rsplit(":", 1)[1])
        return MessageServer(key, replace(transport, port=prev), SCORER_POOL_SERVES)
    except (OSError, ValueError, KeyError, zmq.ZMQError, TransportError):
        return MessageServer(key, replace(transport, port=0), SCORER_POOL_SERVES)


def _publish(run_dir: Path, info: dict) -> None:
    path = run_dir / SCORERS_RENDEZVOUS
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, path)
