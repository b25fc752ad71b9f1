"""The trainer role: megatron-core ranks pulling step batches and pushing weights to the generators.

Rank 0 also prepares the run's starting checkpoint (tiny model + warm-start, cached), starts the
orchestrator beside itself and keeps it alive, and leads the weight broadcast.

Per step k (all ranks): ask the orchestrator for this DP rank's share of step k's batch; train;
gather the new weights (version k+1) and broadcast them, packed in buckets, to every generator;
report the version; every ``checkpoint_every`` steps save model, optimizer and RNG states. On a
restart the latest checkpoint is loaded and the orchestrator told to roll its step record back to
it (`docs/architecture.md`, "Crash resume").

Invariants:
- a step's samples are the orchestrator's recorded batch for that step; the generators hold the
  weights of version v only after the broadcast of v completed; versions equal optimizer steps;
- a checkpoint directory is complete or absent (written under a temporary name, then renamed);
- every wait (batch, rendezvous, broadcast) has a timeout (``run.timeout_s``);
- the orchestrator is a child of rank 0 that dies with it (parent-death signal); when it dies it is
  restarted from the log within a second (`KeptProcess`; the trainer and the generators reconnect to
  the same address), at most ``orchestrator.max_restarts`` times, counted as
  ``orchestrator_restarts`` in every ``train_step`` record; past that the trainer stops with an
  error naming it and the tail of ``logs/orchestrator.out``. It ignores SIGTERM (a preempted job's
  tasks all get one): it serves until the trainer has checkpointed and stops it with SIGINT;
- a stop signal (``task.stop_requested``) ends the run at the next step boundary with a
  checkpoint; a weight broadcast failing meanwhile (generators stopping too) is not retried.
"""
from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from pipeline.config import TokenflowConfig, record_schema
from pipeline.metrics import MetricsWriter
from pipeline.orchestrator.clock import staleness
from pipeline.orchestrator.links import TrainerLink
from pipeline.roles.common import cpu_cores_for, load_run_config, model_dir, pin_process, publish_model
from pipeline.supervise import KeptProcess, die_with_parent
from pipeline.run_files import CHECKPOINTS_DIR, EXPORT_DIR, LOGS_DIR, checkpoint_name

log = logging.getLogger(__name__)


def prepare_model(run_dir: Path, cfg: TokenflowConfig) -> Path:
    """The run's starting checkpoint (cached build), recorded in RUN/model.json for the other roles."""
    from pipeline.models.tiny import resolve_model

    path = resolve_model(cfg.model.name)
    steps = cfg.model.warmstart_steps_or_default()
    if steps > 0:
        from pipeline.tasks import make_task
        from pipeline.models.warmstart import WarmStartConfig, ensure_warm_start
        from pipeline.tasks.prompting import PromptFormat

        task = make_task(cfg.task)
        ws = WarmStartConfig(steps=steps, lr=cfg.model.warmstart_lr, prompt_format=PromptFormat.of(cfg.task, task))
        path = ensure_warm_start(path, task, ws)
    publish_model(run_dir, path)
    return path


def latest_checkpoint(run_dir: Path) -> tuple[int, Path | None]:
    """(steps done, directory) of the newest complete checkpoint, (0, None) if none."""
    best = (0, None)
    for d in (run_dir / CHECKPOINTS_DIR).glob(checkpoint_name("*")):
        if d.is_dir() and (d / "COMPLETE").exists():
            k = int(d.name.split("-")[1])
            if k > best[0]:
                best = (k, d)
    return best


def _orchestrator_preexec() -> None:
    """In the child: SIGINT (a clean stop) when trainer rank 0 dies, however it dies; SIGTERM blocked."""
    die_with_parent(signal.SIGINT)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})


def start_orchestrator(run_dir: Path) -> subprocess.Popen:
    logs = run_dir / LOGS_DIR
    logs.mkdir(exist_ok=True)
    with open(logs / "orchestrator.out", "a") as out:
        return subprocess.Popen([sys.executable, "-m", "pipeline.apps.orchestrator", str(run_dir)],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                preexec_fn=_orchestrator_preexec)


def _interrupt_main(why: str) -> None:
    import _thread
    _thread.interrupt_main()  # the main thread may wait in a batch request: wake it with KeyboardInterrupt


class TrainerRole:
    def __init__(self, task) -> None:
        self.task = task
        self.run_dir = Path(task.run_dir)
        self.cfg = load_run_config(self.run_dir)
        self.rank, self.world = task.rank, task.role_size
        self.leader = self.rank == 0
        self.rdv = task.rendezvous
        self.metrics = MetricsWriter(self.run_dir, "trainer") if self.leader else None
        self.orchestrator: KeptProcess | None = None
        self.channel = None
        self.epoch = 0  # weight group epoch (leader)
        self.group_members: dict[str, int] = {}
        self.sync_failures = 0

    # -- set-up --------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg, timeout = self.cfg, self.cfg.run.timeout_s
        pin_process(cpu_cores_for("trainer", self.rank, cfg))
        if self.leader:
            prepare_model(self.run_dir, cfg)
            self.orchestrator = KeptProcess("orchestrator", lambda: start_orchestrator(self.run_dir),
                                            cfg.orchestrator.max_restarts, _interrupt_main)
            from pipeline.launch.rendezvous import free_port
            self.rdv.publish("trainer_dist", {"host": self._host(), "port": free_port()})
        dist = self.rdv.wait("trainer_dist", timeout)
        model = model_dir(self.run_dir, timeout)
        from dataclasses import replace

        from pipeline.trainer.engine import Trainer
        tcfg = replace(cfg.trainer, model_dir=str(model), timeout_s=timeout)
        self.trainer = Trainer(tcfg, rank=self.rank, world_size=self.world,
                               init_method=f"tcp://{dist['host']}:{dist['port']}")
        self.start_step, ckpt = latest_checkpoint(self.run_dir)
        if ckpt is not None:
            self.trainer.load(ckpt)
            log.info("resumed from %s", ckpt)
        from megatron.core import parallel_state as ps
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.link = TrainerLink(self.run_dir, record_schema(cfg), cfg.orchestrator.transport,
                                timeout_s=timeout, rank=self.rank)
        self.live = cfg.cluster.generators > 0  # else: replay of a recorded log, nobody to sync
        if self.leader:
            self.link.resume(self.start_step)
        self.version = self.start_step
        if self.live:
            self.push_weights(self.version)  # generators start from the trainer's weights
        else:
            self.link.report_version(self.version)

    def _host(self) -> str:
        """Address other roles reach this process at: loopback locally, the node name on Slurm."""
        return "127.0.0.1" if self.cfg.cluster.launcher == "local" else self.task.node

    # -- weight group (leader) --------------------------------------------------------------
    def _ensure_group(self, first: bool, senders: int) -> None:
        """(Re)build the weight group when the alive generators differ from its members.

        At the start it waits for every configured generator; afterwards it builds the group of
        whoever is alive (at least one), so a dead generator costs one failed broadcast, not the run.
        """
        cfg = self.cfg
        want = cfg.cluster.generators if first else 1
        deadline = time.monotonic() + cfg.run.timeout_s
        while True:
            members = self.link.members(cfg.run.timeout_s)
            if len(members) >= want:
                break
            self._check_generators_left()
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
        self._close_channel()
        self.epoch += 1
        tp = cfg.generator.tensor_parallel_size
        ranks = {ident: senders + i * tp for i, ident in enumerate(sorted(members))}
        world = senders + len(members) * tp
        host = self._host()
        port = free_port()
        backend = "nccl" if self.trainer.cuda else "gloo"
        self.rdv.publish(f"weights-{self.epoch}", {"host": host, "port": port, "world_size": world,
                                                   "epoch": self.epoch, "ranks": ranks, "backend": backend,
                                                   "senders": senders})
        self.link.regroup(self.epoch)
        if kind == "cuda_ipc":
            from pipeline.weights.cuda_ipc import CudaIpcChannel

            if world != 2 or not self.trainer.cuda:
                raise ValueError(f"generator.weight_channel=cuda_ipc needs one trainer sender and one "
                                 f"TP-1 generator on its GPU; this run has {senders} sender(s) and "
                                 f"{world - senders} generator worker(s){'' if self.trainer.cuda else ', no GPU'}")
            self.channel = CudaIpcChannel(host, port, rank=0, world_size=world,
                                          timeout_s=cfg.generator.weight_timeout_s, epoch=self.epoch)
        else:
            from pipeline.weights.group import TorchDistChannel

            self.channel = TorchDistChannel(host, port, rank=0, world_size=world,
                                            timeout_s=cfg.generator.weight_timeout_s, backend=backend,
                                            epoch=self.epoch, senders=senders)
        self.group_members = members
        log.info("weight group epoch %d: %s (%d sender(s))", self.epoch, sorted(members), senders)

    def _join_as_sender(self, epoch: int, source: int) -> None:
        """A sending rank other than the leader joins the leader's group of `epoch` as `source`."""
        from pipeline.weights.group import TorchDistChannel

        if self.channel is not None and self.epoch == epoch:
            return
        self._close_channel()
        w = self.rdv.wait(f"weights-{epoch}", self.cfg.run.timeout_s)
        self.channel = TorchDistChannel(w["host"], w["port"], rank=source, world_size=w["world_size"],
                                        timeout_s=self.cfg.generator.weight_timeout_s, backend=w["backend"],
                                        epoch=epoch, senders=w["senders"])
        self.epoch = epoch

    def _close_channel(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None

    def _agree(self, value: int, op: str = "max") -> int:
        """The max (or, with op='leader', rank 0's value) of `value` over the trainer ranks."""
        if self.world == 1:
            return value
        import torch
        import torch.distributed as td

        t = torch.tensor([value], dtype=torch.int64, device="cuda" if self.trainer.cuda else "cpu")
        if op == "leader":
            td.broadcast(t, src=0)
        else:
            td.all_reduce(t, op=td.ReduceOp.MAX)
        return int(t.item())

    def push_weights(self, version: int) -> float:
        """Stream the new weights to the generators: a collective over the trainer ranks.

        Every rank gathers its groups' parameters bucket by bucket (`ShardedWeights`: model dtype,
        no expert leaves its expert-parallel group); each sending rank (the leader, and one rank
        per further expert-parallel rank) streams its buckets. A failed broadcast or regroup (a
        generator died: the error arrives within the weight timeout) is agreed by all ranks, whose
        gathers run to the end regardless, and retried on a group rebuilt from the survivors (and
        restarted generators) for up to ``run.timeout_s``; the run goes on.
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
            epoch = self._agree(0 if failed else self.epoch, op="leader")
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
            if not self._agree(int(failed or not epoch)):
                break
            self.sync_failures += 1
            self._close_channel()
            if self._agree(int(self.task.stop_requested.is_set())):  # stopping: generators stop too
                log.warning("stop requested: version %d is not broadcast", version)
                return time.monotonic() - t0
            if self._agree(int(time.monotonic() > deadline), op="leader"):
                raise WeightSyncError(f"weight sync of version {version} failed for run.timeout_s="
                                      f"{self.cfg.run.timeout_s:g} s")
            if self.leader:
                log.error("regrouping the survivors")
                self._wait_for_membership_change()
        if self.leader:
            self.link.report_version(version)
        return time.monotonic() - t0

    def _wait_for_membership_change(self) -> None:
        """Give the orchestrator time to notice the dead generator (it reaps silent ones)."""
        deadline = time.monotonic() + self.cfg.orchestrator.generator_dead_after_s + 10
        while time.monotonic() < deadline:
            if self.link.members(self.cfg.run.timeout_s) != self.group_members:
                return
            time.sleep(1.0)

    def run(self) -> dict:
        from pipeline.trainer.layout import TrainSample

        cfg = self.cfg
        steps, every = cfg.run.steps, cfg.run.eval_every
        t_run = time.monotonic()
        busy = 0.0
        for step in range(self.start_step, steps):
            if self._stop_agreed():  # checkpoint signal (preemption/time limit): save, return, get requeued
                if step != self.start_step and step % cfg.run.checkpoint_every:
                    self._checkpoint(step)
                return {"steps": step, "version": self.version, "stopped": True}
            if self.leader and every and step % every == 0:
                self.link.request_eval(step, self.version)
            t0 = time.monotonic()
            batch = self._batch_or_stop(step)
            if batch is None:  # stopped while waiting (generators stop too): nothing more to train on
                if self.world == 1 and step != self.start_step and step % cfg.run.checkpoint_every:
                    self._checkpoint(step)
                return {"steps": step, "version": self.version, "stopped": True}
            t1 = time.monotonic()
            samples = [TrainSample(prompt_ids=batch.prompt(i), completion_ids=batch.tokens("completion_ids", i),
                                   behaviour_logprobs=batch.tokens("logprobs", i),
                                   reward=float(batch.columns["reward"][i]),
                                   group_id=int(batch.columns["group_id"][i]),
                                   sampling_mask=batch.tokens("sampling_mask", i)
                                   if "sampling_mask" in batch.columns else None) for i in range(len(batch))]
            me = cfg.run.mismatch_every
            mismatch = self._mismatch(batch, samples) if me and step % me == 0 else None
            m = self.trainer.train_step(samples)
            t2 = time.monotonic()
            self.version = step + 1
            sync_s = self.push_weights(self.version) if self.live else 0.0
            if self.leader and not self.live:
                self.link.report_version(self.version)
            if (step + 1) % cfg.run.checkpoint_every == 0 or step + 1 == steps:
                self._checkpoint(step + 1)
            busy += time.monotonic() - t1
            if self.leader:
                stale = staleness(step, batch.min_versions())
                self.metrics.log("train_step", step=step, version=self.version,
                                 reward_mean=float(np.mean(batch.columns["reward"])),
                                 samples=len(batch), staleness_mean=float(stale.mean()),
                                 staleness_max=int(stale.max()), wait_s=t1 - t0, step_s=t2 - t1,
                                 sync_s=sync_s, mismatch=mismatch, sync_failures=self.sync_failures,
                                 orchestrator_restarts=self.orchestrator.restarts,
                                 trainer_idle_frac=1 - busy / max(1e-9, time.monotonic() - t_run),
                                 **m)
        if self.leader and every:
            self.link.request_eval(steps, self.version)
        return {"steps": steps, "version": self.version}

    def _batch_or_stop(self, step: int):
        """Step ``step``'s batch; None if a stop signal came while waiting for it (``run.timeout_s``).

        With several ranks a stop during the wait is not agreed collectively: the run then resumes
        from the last periodic checkpoint (the orchestrator returns later steps' groups)."""
        from pipeline.transport import TransportError

        deadline = time.monotonic() + self.cfg.run.timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                return self.link.get_batch(step, self.version, self.dp_size, min(5.0, max(left, 0.1)),
                                           dp_rank=self.dp_rank)[0]
            except TransportError:
                # A restarted generator takes work only with weights: resend them now. The sync is a
                # collective over the trainer ranks, so only a one-rank trainer can do it here; with
                # several ranks the generator loads the next step's weights.
                if self.world == 1 and self.live and self.epoch > 0 and \
                        self.link.members(self.cfg.run.timeout_s) not in ({}, self.group_members):
                    log.info("generators changed while waiting for step %d: resending version %d",
                             step, self.version)
                    self.push_weights(self.version)
                if self.task.stop_requested.is_set():
                    log.warning("stop requested while waiting for the batch of step %d", step)
                    return None
                if left <= 0:
                    raise TransportError(f"no batch for step {step} within {self.cfg.run.timeout_s:.0f}s") from None

    def _stop_agreed(self) -> bool:
        """True on every trainer rank once any rank got the stop signal (so all stop at the same step)."""
        stop = self.task.stop_requested.is_set()
        if self.world > 1:
            import torch
            import torch.distributed as td
            flag = torch.tensor([int(stop)], device="cuda" if self.trainer.cuda else "cpu")
            td.all_reduce(flag, op=td.ReduceOp.MAX)
            stop = bool(flag.item())
        return stop

    def _mismatch(self, batch, samples) -> float | None:
        """Mean |trainer - generator| logprob over tokens the current weights generated (a
        collective: every rank computes it on its share; None where no rank has such tokens)."""
        current = [batch.tokens("versions", i) == self.version for i in range(len(batch))]
        pick = [i for i, c in enumerate(current) if c.any()] or [0]
        lps = self.trainer.logprobs([samples[i] for i in pick])  # every rank runs the forward
        diff = sum(float(np.abs(lp[current[i]] - samples[i].behaviour_logprobs[current[i]]).sum())
                   for lp, i in zip(lps, pick))
        count = sum(int(current[i].sum()) for i in pick)
        if self.world > 1:
            import torch
            import torch.distributed as td
            t = torch.tensor([diff, float(count)], dtype=torch.float64,
                             device="cuda" if self.trainer.cuda else "cpu")
            td.all_reduce(t)
            diff, count = float(t[0]), int(t[1])
        return diff / count if count else None

    def _checkpoint(self, steps_done: int) -> None:
        final = self.run_dir / CHECKPOINTS_DIR / checkpoint_name(steps_done)
        tmp = final.with_name(final.name + ".partial")
        if self.leader:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        import torch.distributed as td
        td.barrier()
        self.trainer.save(tmp)
        td.barrier()
        if self.leader:
            (tmp / "COMPLETE").write_text(str(steps_done))
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
        export = self.cfg.trainer.export
        if export == "checkpoints" or (export == "end" and steps_done == self.cfg.run.steps):
            self.trainer.export_hf(self.run_dir / EXPORT_DIR / checkpoint_name(steps_done))  # collective

    def finish(self) -> None:
        if self.leader:
            self._wait_for_final_eval()
            self.orchestrator.release()  # it exits after `finish`: no restart
            self.link.finish()
            try:
                self.orchestrator.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                log.warning("the orchestrator did not stop within 60s of finish")
            if self.channel is not None:
                self.channel.close()
        self.link.close()
        self.trainer.close()

    def abort(self) -> None:
        """Leave nothing running behind (after a failure, or after `finish`)."""
        if self.orchestrator is not None:
            self.orchestrator.stop(signal.SIGINT)

    def _wait_for_final_eval(self) -> None:
        from pipeline.metrics import read_metrics
        if not self.cfg.run.eval_every:
            return
        deadline = time.monotonic() + self.cfg.run.timeout_s
        while time.monotonic() < deadline:
            if any(r["step"] == self.cfg.run.steps for r in read_metrics(self.run_dir, "eval")):
                return
            time.sleep(0.2)
        log.warning("the final evaluation did not finish within %.0fs", self.cfg.run.timeout_s)


def main(task) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s trainer %(levelname)s %(message)s")
    role = TrainerRole(task)
    try:
        role.setup()
        result = role.run()
        if not result.get("stopped"):
            role.finish()
        return result
    except KeyboardInterrupt:  # the orchestrator's keeper gave up (see `_interrupt_main`)
        failure = role.orchestrator.failure if role.orchestrator is not None else None
        if failure is None:
            raise
        tail = "\n".join((role.run_dir / "logs" / "orchestrator.out").read_text(errors="replace")
                         .splitlines()[-20:])
        raise RuntimeError(f"{failure}; the run stops.\n--- logs/orchestrator.out:\n{tail}") from None
    finally:
        role.abort()
