"""The trainer's side of weight sync: the weight group it leads and the push of each new version.

A collective over the trainer ranks (`docs/weight-sync.md`). The leader (trainer rank 0) builds
the weight group of the generators alive now and announces each version to the orchestrator;
every rank gathers its share of the parameters bucket by bucket; each sending rank (the leader,
and one rank per further expert-parallel rank) streams its buckets into the group.

Invariants:
- the generators hold version v only after the push of v returned without error; the leader then
  reports v to the orchestrator, never before;
- a group's members are the generators alive when it was built; a member dying fails the next
  broadcast within ``generator.weight_timeout_s`` and the group is rebuilt from the survivors
  (epoch + 1), retried for up to ``run.timeout_s``;
- every decision that changes what a rank does next (failed, stopping, past the deadline, which
  epoch) is agreed by all trainer ranks first, so the ranks never disagree on a collective;
- every rank runs its parameter gathers to the end, whatever happened to its sending.

Example: 2 trainer ranks with expert parallel size 2 (`senders=2`) and 2 generators of tensor
parallel size 2 form a group of 2 + 2 x 2 = 6 ranks: senders 0 and 1, generator workers 2-5.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

from pipeline.roles.common import agree_over_ranks

log = logging.getLogger(__name__)


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

    def push(self, version: int) -> float:
        """Stream version `version` to the generators; seconds it took. A collective over the ranks.

        A failed broadcast or regroup (a generator died: the error arrives within the weight
        timeout) is agreed by all ranks and retried on a group rebuilt from the survivors (and
        restarted generators) for up to ``run.timeout_s``; the run goes on. A stop signal during
        the retries returns without broadcasting (the generators are stopping too).
        """
        from pipeline.weights.buckets import BucketPlan
        from pipeline.weights.group import WeightSyncError
        from pipeline.weights.shards import ShardedWeights

        t0 = time.monotonic()
        shards = ShardedWeights(self.trainer.model, self.trainer.hf_config)
        plan = BucketPlan.from_specs(shards.specs, int(self.cfg.run.weight_bucket_mb * 2**20))
        deadline = time.monotonic() + self.cfg.run.timeout_s  # generators may be restarting meanwhile
        while True:
            failed = False
            if self.leader:
                try:
                    self._ensure_group(first=self.epoch == 0, senders=shards.senders)
                    self.link.announce_weights(version)
                except WeightSyncError as exc:
                    failed = True
                    log.error("weight group for version %d failed (%s)", version, exc)
            epoch = self.agree(0 if failed else self.epoch, op="leader")
            tensors = shards.tensors()
            try:
                if epoch and shards.source is not None:
                    if shards.source > 0:
                        self._join_as_sender(epoch, shards.source)
                    self.channel.send_stream(version, plan, tensors)
            except WeightSyncError as exc:
                failed = True
                log.error("weight sync of version %d failed (%s)", version, exc)
            for _ in tensors:  # every rank completes its gathers, whatever happened to the sending
                pass
            if not self.agree(int(failed or not epoch)):
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
        if self.leader:
            self.link.report_version(version)
        return time.monotonic() - t0

    def generators_changed(self) -> bool:
        """True when a group exists and the alive generators are no longer its members (leader)."""
        return self.epoch > 0 and self.link.members(self.cfg.run.timeout_s) not in ({}, self.group_members)

    def agree(self, value: int, op: str = "max") -> int:
        """`agree_over_ranks` over this pusher's trainer ranks."""
        return agree_over_ranks(value, world=self.world, cuda=self.trainer.cuda, op=op)

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None

    # -- the group (leader) ------------------------------------------------------------------
    def _ensure_group(self, first: bool, senders: int) -> None:
        """(Re)build the weight group when the alive generators differ from its members.

        At the start it waits for every configured generator; afterwards it builds the group of
        whoever is alive (at least one), so a dead generator costs one failed broadcast, not the run,
        and one that left (`Leave`) none; a generator joining from its own job is a member like any.
        """
        cfg = self.cfg
        want = cfg.cluster.generators if first else 1
        deadline = time.monotonic() + cfg.run.timeout_s
        while True:
            members = self.link.members(cfg.run.timeout_s)
            if sum(ident.startswith("gen-") for ident in members) >= want:  # a lagged teacher is a member too
                break
            self._check_generators_left()
            if self.stop_requested.is_set():  # every generator left because the run is stopping
                from pipeline.weights.group import WeightSyncError
                raise WeightSyncError("stop requested while no generator is a member")
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(members)} of {want} generator(s) alive after "
                                   f"{cfg.run.timeout_s:.0f}s")
            time.sleep(0.5)
        if self.channel is not None and members == self.group_members:
            return
        self._build_group(members, senders)

    def _check_generators_left(self) -> None:
        """Raise once every generator task gave up (abandoned after its restarts): nobody to train on."""
        from pipeline.launch.task import abandoned_tasks

        n = self.cfg.cluster.generators
        if abandoned_tasks(self.run_dir, "generator", n) == n:
            raise RuntimeError(f"all {n} generator(s) died and used up their restarts "
                               f"(cluster.generator.max_restarts); see logs/generator.*.out")

    def _build_group(self, members: dict[str, int], senders: int) -> None:
        from pipeline.launch.rendezvous import free_port

        cfg = self.cfg
        kind = cfg.generator.weight_channel
        self.close()
        self.epoch += 1
        tp = cfg.generator.tensor_parallel_size
        ranks = {ident: senders + i * tp for i, ident in enumerate(sorted(members))}
        world = senders + len(members) * tp
        port = free_port()
        backend = "nccl" if self.trainer.cuda else "gloo"
        self.rdv.publish(f"weights-{self.epoch}", {"host": self.host, "port": port, "world_size": world,
                                                   "epoch": self.epoch, "ranks": ranks, "backend": backend,
                                                   "senders": senders})
        self.link.regroup(self.epoch)
        if kind == "cuda_ipc":
            from pipeline.weights.cuda_ipc import CudaIpcChannel

            if world != 2 or not self.trainer.cuda:
                raise ValueError(f"generator.weight_channel=cuda_ipc needs one trainer sender and one "
                                 f"TP-1 generator on its GPU; this run has {senders} sender(s) and "
                                 f"{world - senders} generator worker(s){'' if self.trainer.cuda else ', no GPU'}")
            self.channel = CudaIpcChannel(self.host, port, rank=0, world_size=world,
                                          timeout_s=cfg.generator.weight_timeout_s, epoch=self.epoch)
        else:
            from pipeline.weights.group import TorchDistChannel

            self.channel = TorchDistChannel(self.host, port, rank=0, world_size=world,
                                            timeout_s=cfg.generator.weight_timeout_s, backend=backend,
                                            epoch=self.epoch, senders=senders)
        self.group_members = members
        log.info("weight group epoch %d: %s (%d sender(s))", self.epoch, sorted(members), senders)

    def _join_as_sender(self, epoch: int, source: int) -> None:
        """A sending rank other than the leader joins the leader's group of `epoch` as `source`."""
        from pipeline.weights.group import TorchDistChannel

        if self.channel is not None and self.epoch == epoch:
            return
        self.close()
        w = self.rdv.wait(f"weights-{epoch}", self.cfg.run.timeout_s)
        self.channel = TorchDistChannel(w["host"], w["port"], rank=source, world_size=w["world_size"],
                                        timeout_s=self.cfg.generator.weight_timeout_s, backend=w["backend"],
                                        epoch=epoch, senders=w["senders"])
        self.epoch = epoch

    def _wait_for_membership_change(self) -> None:
        """Give the orchestrator time to notice the dead generator (it reaps silent ones)."""
        deadline = time.monotonic() + self.cfg.orchestrator.generator_dead_after_s + 10
        while time.monotonic() < deadline:
            if self.link.members(self.cfg.run.timeout_s) != self.group_members:
                return
            time.sleep(1.0)
