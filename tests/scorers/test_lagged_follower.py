"""A lagged teacher's `WeightFollower` on a real gloo weight group: it receives every version the
trainer's channel broadcasts, keeps exactly the snapshots a lagged teacher can still ask for (the
worked example of `pipeline.scorers.lagged`), hands them out bit-equal to what was sent, follows a
regroup, skips a group that does not list it, and keeps receiving in the group in use while the
next one forms in the background (as the trainer switches groups)."""
from __future__ import annotations

import time

import torch

from pipeline.launch.rendezvous import Rendezvous, free_port
from pipeline.scorers.lagged import WeightFollower
from pipeline.scorers.pool import lagged_teacher_version
from pipeline.weights.group import TorchDistChannel

LAG, EVERY = 2, 3


def _weights(version: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(version)
    return [("model.embed_tokens.weight", torch.randn(64, 8, generator=g)),
            ("model.norm.weight", torch.full((8,), float(version)))]


def _publish(rdv: Rendezvous, epoch: int, ranks: dict[str, int]):
    """Publish weight group ``epoch`` as the trainer does; returns the opener of its sending end (rank 0)."""
    port = free_port()
    world = 1 + len(ranks)
    rdv.publish(f"weights-{epoch}", {"host": "127.0.0.1", "port": port, "world_size": world, "epoch": epoch,
                                     "ranks": ranks, "backend": "gloo", "senders": 1})
    return lambda: TorchDistChannel("127.0.0.1", port, 0, world, timeout_s=30.0, epoch=epoch, secret=bytes(32))


def _group(rdv: Rendezvous, epoch: int, ranks: dict[str, int]) -> TorchDistChannel:
    """Publish weight group ``epoch`` and open its sending end (returns once every member joined)."""
    return _publish(rdv, epoch, ranks)()


def _wait(cond, what: str) -> None:
    deadline = time.monotonic() + 30
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_follower_keeps_the_snapshots_a_lagged_teacher_needs(tmp_path):
    rdv = Rendezvous(tmp_path, 0)
    follower = WeightFollower("teacher-0", rdv, LAG, EVERY, timeout_s=30.0, secret=bytes(32))
    try:
        follower.regroup(1)
        sender = _group(rdv, 1, {"teacher-0": 1})  # returns once the follower joined
        held, taken = {}, set()
        for v in range(1, 10):
            follower.update(v, 1)
            sender.send_tensors(v, _weights(v), bucket_bytes=1024)  # several buckets per version
            _wait(lambda: follower.received == v, f"version {v}")
            held[v] = follower.held()
            assert len(held[v]) <= LAG // EVERY + 2
            # what a request sent while the policy was at v - 1 may ask for is held
            due = lagged_teacher_version(v - 1, LAG, EVERY)
            assert due == 0 or due in held[v] or due in taken, (v, held[v])
            if v == 7:
                snap = follower.take(lagged_teacher_version(7, LAG, EVERY))  # the teacher refreshes to 3
                assert snap is not None
                taken.add(3)
                for name, t in _weights(3):
                    assert torch.equal(snap[name], t), name
        assert held[5] == [3] and held[6] == [3, 6] and held[7] == [3, 6]
        assert held[8] == [6] and held[9] == [6, 9]  # 3 was taken at 7
        assert follower.take(4) is None and follower.held() == [6, 9]  # never kept: the teacher reads its checkpoint
        assert follower.kept == 3 and follower.updates == 9 and follower.failures == 0

        # the trainer regroups without this teacher (it was reported dead): its old channel is
        # closed and the announcement of a broadcast it is not part of is ignored
        sender.close()
        rdv.publish("weights-2", {"host": "127.0.0.1", "port": free_port(), "world_size": 2, "epoch": 2,
                                  "ranks": {"gen-0": 1}, "backend": "gloo", "senders": 1})
        follower.regroup(2)
        follower.update(10, 2)
        _wait(lambda: follower.epoch == 2 and follower._queue.empty(), "the regroup")
        assert follower.channel is None and follower.received == 9

        # and it is a member of the next one again: version 12 (a multiple of M) is kept
        follower.regroup(3)
        sender = _group(rdv, 3, {"teacher-0": 1})
        follower.update(12, 3)
        sender.send_tensors(12, _weights(12), bucket_bytes=1024)
        _wait(lambda: follower.received == 12, "version 12")
        assert follower.held() == [9, 12]  # due at 11: 9
        sender.close()
    finally:
        follower.close()


def test_follower_receives_in_the_group_in_use_while_the_next_one_forms(tmp_path):
    """The trainer's group switch (`pipeline.roles.weight_push`): group 2 is published and forms on
    a background thread while version 2 still goes into group 1, which the follower (already
    joining 2) receives there; version 3, announced into group 2 after the trainer switched, comes
    through group 2. A follower that left group 1 at the regroup would miss version 2 (the
    trainer's broadcast into group 1 would wait for it until its timeout)."""
    from pipeline.weights.group_build import GroupBuild

    rdv = Rendezvous(tmp_path, 0)
    follower = WeightFollower("teacher-0", rdv, lag=1, every=1, timeout_s=30.0, secret=bytes(32))
    try:
        follower.regroup(1)
        old = _group(rdv, 1, {"teacher-0": 1})
        forming = GroupBuild(2, None, _publish(rdv, 2, {"teacher-0": 1}))
        follower.regroup(2)
        for version, epoch in ((1, 1), (2, 1), (3, 2)):
            if epoch == 2:  # the version boundary: the trainer switches to the group formed meanwhile
                channel = forming.wait(40)
                old.close()
            follower.update(version, epoch)
            (channel if epoch == 2 else old).send_tensors(version, _weights(version), bucket_bytes=1024)
            _wait(lambda: follower.received == version, f"version {version}")
            assert follower.epoch == epoch and follower.failures == 0, (version, follower.epoch)
        for version in (2, 3):  # lag 1, every version kept: 2 is due at 3
            snap = follower.take(version)
            for name, t in _weights(version):
                assert torch.equal(snap[name], t), (version, name)
        channel.close()
    finally:
        follower.close()


def test_pool_lists_a_following_teacher_as_a_weight_member_and_forwards_to_it(tmp_path):
    """The scorer pool over real ZeroMQ sockets: a teacher that says ``follows_weights`` is a
    member ``teacher-<rank>`` (the same incarnation after being dropped for silence, a new one
    after a restart), hears regroups and announcements, also while dropped; a teacher that does
    not follow hears neither and is no member."""
    from pipeline.protocol.record import RecordSchema
    from pipeline.scorers.config import ScorersConfig
    from pipeline.scorers.pool import RemoteScoring
    from pipeline.protocol.transport import MessageClient, TransportConfig, load_or_create_secret

    pool = RemoteScoring(tmp_path, ScorersConfig(teacher="lagged"), RecordSchema(teacher_logprobs=True),
                         verifier=object(), transport=TransportConfig(host="127.0.0.1"))
    key = load_or_create_secret(tmp_path)
    clients = []

    def hello(identity: str, rank: int, follows: bool) -> MessageClient:
        c = MessageClient(key, pool.server.address, TransportConfig(), identity)
        c.send("scorer_hello", {"service": "teacher", "rank": rank, "slots": 1, "follows_weights": follows})
        clients.append(c)
        return c

    def next_kind(c: MessageClient, timeout_s: float = 5.0) -> tuple[str, dict] | None:
        msg = c.recv(timeout_s)
        return None if msg is None else (msg.kind, dict(msg.meta))

    try:
        first, other = hello("teacher-0-1", 0, True), hello("teacher-1-2", 1, False)
        _wait(lambda: not list(pool.completed()) and len(pool.peers) == 2, "the hellos")
        members = pool.weight_members()
        assert list(members) == ["teacher-0"]
        pool.regroup(4)
        pool.weights_announced(7)
        assert next_kind(first) == ("weights_regroup", {"weight_epoch": 4})
        assert next_kind(first) == ("weights_update", {"version": 7, "weight_epoch": 0})
        assert next_kind(other, 0.3) is None
        pool.peers.pop(b"teacher-0-1")  # dropped for silence (a long scoring request) ...
        assert pool.weight_members() == {}
        pool.weights_announced(8, 4)  # ... it may still be in the trainer's group: it hears the broadcast
        assert next_kind(first) == ("weights_update", {"version": 8, "weight_epoch": 4})
        first.send("scorer_hello", {"service": "teacher", "rank": 0, "slots": 1, "follows_weights": True})
        _wait(lambda: not list(pool.completed()) and pool.weight_members() == members, "the same incarnation back")
        hello("teacher-0-3", 0, True)  # rank 0 restarted: the old process is dropped
        _wait(lambda: not list(pool.completed()) and len(pool.peers) == 2 and
              pool.weight_members()["teacher-0"] != members["teacher-0"], "the restart")
    finally:
        for c in clients:
            c.close()
        pool.close()
