"""The trainer's side of weight sync: the weight group it leads and the push of each new version.

A collective over the trainer ranks (`docs/weight-sync.md`). The leader (trainer rank 0) builds
the weight group of the generators alive now and announces each version to the orchestrator;
every rank gathers its share of the parameters bucket by bucket; each sending rank (the leader,
and one rank per further expert-parallel rank) streams its buckets into the group.

Invariants:
- the generators hold version v only after the push of v returned without error; the leader then
  reports v to the orchestrator, never before;
- a group's members are the generators alive when it was built; a member dying fails the next
  broadcast within ``generator.weight_timeout_s`` (the group's forming, as soon as the
  orchestrator no longer lists it) and the group is rebuilt from the survivors (epoch + 1),
  retried for up to ``run.timeout_s``;
- a change of members the leader sees at a push (a join, a `Leave`, a restart) is never waited
  for: the next group forms on a background thread (`GroupBuild`) while pushes go on into the
  group in use, and the leader switches to it at the first push after it formed; while the group
  in use holds a member that is gone, a push waits up to `LEFT_GROUP_WAIT_S` for the new group to
  form and broadcasts into it, else the version is not broadcast (no broadcast waits on a departed
  member; the others load the next version from the new group), unless no member of it is left or
  the version was sent already (the trainer waits for a batch anyway): then it waits for the new
  group (at most ``generator.weight_timeout_s``);
- each version is announced with the epoch of the group it goes into, and a group gets each
  version at most once;
- a wait for generators (the first group's, or one after every member left) is bounded by their
  engines' start progress (``generator.start_stall_s``, `pipeline.roles.cold_start`), not by
  ``run.timeout_s`` alone, and runs in rounds of `WAIT_ROUND_S` that end in an agreement (`WAITING`),
  so the other ranks never sit in one collective for a whole cold start;
- every decision that changes what a rank does next (failed, stopping, past the deadline, which
  epoch) is agreed by all trainer ranks first, so the ranks never disagree on a collective;
- every rank runs its parameter gathers to the end, whatever happened to its sending;
- ``sent_bytes`` is what the sending ranks' channels counted on the wire for the last version
  pushed (`pipeline.weights.group.WireBytes`), summed over the ranks, failed attempts included.

Example: 2 trainer ranks with expert parallel size 2 (`senders=2`) and 2 generators of tensor
parallel size 2 form a group of 2 + 2 x 2 = 6 ranks: senders 0 and 1, generator workers 2-5.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

from pipeline.roles.cold_start import ColdStartWait
from pipeline.roles.common import agree_over_ranks

log = logging.getLogger(__name__)

SKIP = -1
"""The leader's agreed epoch for "no broadcast of this version" (see the module docstring)."""
WAITING = -2
"""The leader's agreed epoch for "still waiting for the generators; agree again" (see `WAIT_ROUND_S`)."""

WAIT_ROUND_S = 10.0
"""How long the leader waits for the generators of a group in one round: the other ranks wait in
the round's collective, so a cold engine's start (bounded only by its progress,
`pipeline.roles.cold_start`) never outlasts a collective's timeout; each round ends in an agreement."""

LEFT_GROUP_WAIT_S = 1.0
"""How long a push waits for the next group to form when a member of the group in use has left,
before it gives the version up. The group of the remaining members formed 0.1-0.9 s after the
regroup in the local tests; a version given up leaves them on the one before, and at the staleness
bound the trainer's next batch waits for them, while a trainer waiting for a batch checks the
members (and pushes) only every `pipeline.roles.trainer.BATCH_POLL_S` (then 5 s: 5.9 s measured on one departure,
docs/generator-jobs.md)."""


MEMBERS_POLL_S = 0.5
"""While a weight group forms, how often the leader checks that its members are still alive."""


class WeightPusher:
    """Leads (rank 0) or joins (a further sending rank) the weight group and pushes versions into it."""

    def __init__(self, *, cfg, run_dir: Path, rendezvous, link, trainer, rank: int, world: int,
                 host: str, stop_requested) -> None:
        self.cfg, self.run_dir, self.rdv, self.link, self.trainer = cfg, run_dir, rendezvous, link, trainer
        self.leader, self.world, self.host = rank == 0, world, host
        self.stop_requested = stop_requested  # threading.Event: the task's stop signal
        self.channel = None
        self.epoch = 0  # weight group epoch (0: no group yet)
        self.group_members: dict[str, int] = {}
        self.sync_failures = 0
        self.built_epochs = 0  # groups published so far (leader): the next one is built_epochs + 1
        self.pending = None  # the next group, forming in the background (leader; a GroupBuild)
        self.sent_version: int | None = None  # the version the group in use got last (leader)
        self.sent_bytes = 0  # bytes the sending ranks counted for the last version pushed (all ranks)
        self.cold_start: ColdStartWait | None = None  # the wait for generators in progress (leader)

    def push(self, version: int) -> float:
        """Stream version `version` to the generators; seconds it took. A collective over the ranks.

        A failed broadcast or regroup (a generator died: the error arrives within the weight
        timeout) is agreed by all ranks and retried on a group rebuilt from the survivors (and
        restarted generators) for up to ``run.timeout_s``; the run goes on. A stop signal during
        the retries returns without broadcasting (the generators are stopping too).
        """
        from pipeline.weights.bucket_plan import BucketPlan
        from pipeline.weights.group import WeightSyncError
        from pipeline.weights.shards import ShardedWeights

        t0 = time.monotonic()
        shards = ShardedWeights(self.trainer.model, self.trainer.hf_config)
        plan = BucketPlan.from_specs(shards.specs, int(self.cfg.run.weight_bucket_mb * 2**20))
        deadline = time.monotonic() + self.cfg.run.timeout_s  # generators may be restarting meanwhile
        self.sent_bytes = sent = 0
        while True:
            failed, target = False, SKIP
            if self.leader:
                try:
                    target = self._group_for(version, senders=shards.senders)
                    if target != SKIP:
                        self.link.announce_weights(version, target)
                except WeightSyncError as exc:
                    failed = True
                    log.error("weight group for version %d failed (%s)", version, exc)
            epoch = self.agree(0 if failed else target, op="leader")
            if epoch == WAITING:
                continue
            if epoch == SKIP:  # agreed by every rank: no gathers, no broadcast, not reported
                return time.monotonic() - t0
            tensors = shards.tensors()
            channel = before = None
            try:
                if epoch and shards.source is not None:
                    if shards.source > 0:
                        self._join_as_sender(epoch, shards.source)
                    first, t_send = self.sent_version is None, time.monotonic()
                    channel, before = self.channel, self.channel.wire.reading()
                    self.channel.send_stream(version, plan, tensors)
                    if first and self.leader:
                        log.info("first broadcast into weight group epoch %d: version %d sent in %.3fs",
                                 epoch, version, time.monotonic() - t_send)
            except WeightSyncError as exc:
                failed = True
                log.error("weight sync of version %d failed (%s)", version, exc)
            for _ in tensors:  # every rank completes its gathers, whatever happened to the sending
                pass
            if before is not None:
                sent += channel.wire.since(before).sent
            if not self.agree(int(failed or not epoch)):
                self.sent_version = version
                break
            self.sync_failures += 1
            self.close()
            if self.agree(int(self.stop_requested.is_set())):
                log.warning("stop requested: version %d is not broadcast", version)
                return time.monotonic() - t0
            if self.agree(int(time.monotonic() > deadline), op="leader"):
                raise WeightSyncError(f"weight sync of version {version} failed for run.timeout_s="
                                      f"{self.cfg.run.timeout_s:g} s")
            if self.leader:
                log.error("regrouping the survivors")
                self._wait_for_membership_change()
        self.sent_bytes = self.agree(sent, op="sum")
        if self.leader:
            self.link.report_version(version)
        return time.monotonic() - t0

    def generators_changed(self) -> bool:
        """True when a group exists and the alive generators are no longer the members of the group
        in use (leader): a push now starts the next group's build, or switches to it."""
        return self.epoch > 0 and self.link.members(self.cfg.run.timeout_s) not in ({}, self.group_members)

    def agree(self, value: int, op: str = "max") -> int:
        """`agree_over_ranks` over this pusher's trainer ranks."""
        return agree_over_ranks(value, world=self.world, cuda=self.trainer.cuda, op=op)

    def close(self) -> None:
        if self.pending is not None:
            self.pending.abandon()
            self.pending = None
        if self.channel is not None:
            self.channel.close()
            self.channel = None

    # -- the group (leader) ------------------------------------------------------------------
    def await_generators(self, want: int) -> dict[str, int] | None:
        """The members once ``want`` generators are (leader); None after `WAIT_ROUND_S` without
        them (call again: the wait goes on). Bounded by the starting generators' progress
        (`ColdStartWait`), the generators left (`check_generators_left`) and the stop signal."""
        cfg = self.cfg
        if self.cold_start is None:
            self.cold_start = ColdStartWait(cfg.run.timeout_s, cfg.generator.start_stall_s,
                                            f"waiting for {want} generator(s)")
        round_end = time.monotonic() + WAIT_ROUND_S
        try:
            while True:
                reply = self.link.membership(cfg.run.timeout_s)
                if sum(ident.startswith("gen-") for ident in reply.members) >= want:  # a lagged teacher is a member too
                    self.cold_start = None
                    return reply.members
                self.check_generators_left()
                if self.stop_requested.is_set():  # every generator left because the run is stopping
                    from pipeline.weights.group import WeightSyncError
                    raise WeightSyncError("stop requested while no generator is a member")
                self.cold_start.check(reply.starting)
                if time.monotonic() > round_end:
                    return None
                time.sleep(0.5)
        except BaseException:
            self.cold_start = None  # the next wait starts afresh
            raise

    def _ensure_group(self, first: bool, senders: int) -> bool:
        """(Re)build the weight group when the alive generators differ from its members; False
        after a round of waiting for them (`await_generators`).

        At the start it waits for every configured generator; afterwards it builds the group of
        whoever is alive (at least one), so a dead generator costs one failed broadcast, not the run,
        and one that left (`Leave`) none; a generator joining from its own job is a member like any.
        """
        members = self.await_generators(self.cfg.cluster.generators if first else 1)
        if members is None:
            return False
        if self.channel is not None and members == self.group_members:
            return True
        self.close()
        self.pending = self._start_group(members, senders)
        self._switch()
        return True

    def check_generators_left(self) -> None:
        """Raise once every generator task of the run gave up (abandoned after its restarts) and no
        generator (one of a generator job included) is a member any more: nobody to train on.
        Called wherever the leader waits on generators: for a weight group, and for a batch
        (`pipeline.roles.trainer`)."""
        from pipeline.launch.task import abandoned_tasks

        n = self.cfg.cluster.generators
        if abandoned_tasks(self.run_dir, "generator", n) < n:
            return
        if any(ident.startswith("gen-") for ident in self.link.members(self.cfg.run.timeout_s)):
            return  # a generator job's generator still serves the run
        raise RuntimeError(f"all {n} generator(s) died and used up their restarts "
                           f"(cluster.generator.max_restarts): no generator is left to train on; "
                           f"see logs/generator.*.out")

    def _group_for(self, version: int, senders: int) -> int:
        """The epoch to broadcast `version` into, SKIP, or WAITING (leader; see the module docstring)."""
        if self.channel is None:  # the first group, or the one after a failed broadcast: waited for
            return self.epoch if self._ensure_group(first=self.epoch == 0, senders=senders) else WAITING
        members = self.link.members(self.cfg.run.timeout_s)
        if not members:  # nobody to build a group of: wait for a generator, as at the start
            self.close()
            return self.epoch if self._ensure_group(first=False, senders=senders) else WAITING
        if members != (self.pending.members if self.pending is not None else self.group_members):
            if self.pending is not None:
                self.pending.abandon()
            self.pending = self._start_group(members, senders)
        gone = [g for g, inc in self.group_members.items() if members.get(g) != inc]
        if self.pending is not None and (self.pending.ready(LEFT_GROUP_WAIT_S if gone else 0.0)
                                         or len(gone) == len(self.group_members)
                                         or version == self.sent_version):
            self._switch()
        elif gone:
            log.info("version %d not broadcast: %s left the group in use; epoch %d is forming",
                     version, sorted(gone), self.pending.epoch)
            return SKIP
        return SKIP if version == self.sent_version else self.epoch

    def _start_group(self, members: dict[str, int], senders: int):
        """Publish the next group of `members` and start forming it in the background (leader)."""
        from pipeline.launch.rendezvous import listen_on
        from pipeline.weights.group_build import GroupBuild

        cfg = self.cfg
        kind = cfg.generator.weight_channel
        self.built_epochs = epoch = max(self.built_epochs, self.epoch) + 1
        tp = cfg.generator.tensor_parallel_size
        ranks = {ident: senders + i * tp for i, ident in enumerate(sorted(members))}
        world = senders + len(members) * tp
        backend = "nccl" if self.trainer.cuda else "gloo"
        if kind == "cuda_ipc" and (world != 2 or not self.trainer.cuda):
            raise ValueError(f"generator.weight_channel=cuda_ipc needs one trainer sender and one "
                             f"TP-1 generator on its GPU; this run has {senders} sender(s) and "
                             f"{world - senders} generator worker(s){'' if self.trainer.cuda else ', no GPU'}")
        listener = listen_on(self.host)  # bound before its port is published: the store takes it over
        port = listener.getsockname()[1]
        self.rdv.publish(f"weights-{epoch}", {"host": self.host, "port": port, "world_size": world,
                                              "epoch": epoch, "ranks": ranks, "backend": backend,
                                              "senders": senders})
        self.link.regroup(epoch)
        timeout = cfg.generator.weight_timeout_s

        def open_channel():
            if kind == "cuda_ipc":
                from pipeline.weights.cuda_ipc import CudaIpcChannel

                return CudaIpcChannel(self.host, port, rank=0, world_size=world, timeout_s=timeout, epoch=epoch,
                                      device=self.trainer.device, listener=listener, secret=self.link.key)
            from pipeline.weights.group import TorchDistChannel

            return TorchDistChannel(self.host, port, rank=0, world_size=world, timeout_s=timeout,
                                    backend=backend, epoch=epoch, senders=senders, device=self.trainer.device,
                                    listener=listener, secret=self.link.key)

        log.info("weight group epoch %d forming at %s:%d: %s (%d sender(s), world %d)", epoch, self.host, port,
                 sorted(members), senders, world)
        return GroupBuild(epoch, members, open_channel)

    def _switch(self) -> None:
        """Make the pending group the one in use (waits for it to form; leader). A member gone
        meanwhile (dead: its supervisor says `Leave` for it as it restarts it) fails the wait at
        once, not after ``generator.weight_timeout_s``: the group is then rebuilt of the others.
        Measured before: 62 s without training after a kill -9 of one of two generators' engine
        while a group with it formed."""
        from pipeline.weights.group import WeightSyncError

        build, self.pending = self.pending, None
        deadline = time.monotonic() + self.cfg.generator.weight_timeout_s + 5
        while not build.ready(MEMBERS_POLL_S) and time.monotonic() < deadline:
            members = self.link.members(self.cfg.run.timeout_s)
            gone = sorted(g for g, inc in build.members.items() if members.get(g) != inc)
            if gone:
                build.abandon()
                raise WeightSyncError(f"weight group epoch {build.epoch}: {gone} left while it formed")
        channel = build.wait(max(0.0, deadline - time.monotonic()))
        if self.channel is not None:
            self.channel.close()
        self.channel, self.epoch, self.group_members, self.sent_version = channel, build.epoch, build.members, None
        log.info("weight group epoch %d in use: %s (formed in %.3fs, switched %.3fs after its start)",
                 build.epoch, sorted(build.members), build.built_s, time.monotonic() - build.started)

    def _join_as_sender(self, epoch: int, source: int) -> None:
        """A sending rank other than the leader joins the leader's group of `epoch` as `source`."""
        from pipeline.weights.group import TorchDistChannel

        if self.channel is not None and self.epoch == epoch:
            return
        self.close()
        w = self.rdv.wait(f"weights-{epoch}", self.cfg.run.timeout_s)
        self.channel = TorchDistChannel(w["host"], w["port"], rank=source, world_size=w["world_size"],
                                        timeout_s=self.cfg.generator.weight_timeout_s, backend=w["backend"],
                                        epoch=epoch, senders=w["senders"], device=self.trainer.device,
                                        secret=self.link.key)
        self.epoch = epoch

    def _wait_for_membership_change(self) -> None:
        """Give the orchestrator time to notice the dead generator (it reaps silent ones). A leaver's
        `Leave` is there within tens of milliseconds of its signal (for a dead generator, its
        supervisor's `Leave` on its behalf as it restarts it, `pipeline.roles.generator`), its
        engine's end (and so the failed broadcast) right after: polled every 0.1 s, not every
        second."""
        deadline = time.monotonic() + self.cfg.orchestrator.generator_dead_after_s + 10
        while time.monotonic() < deadline:
            if self.link.members(self.cfg.run.timeout_s) != self.group_members:
                return
            time.sleep(0.1)
