"""The trainer role: megatron-core ranks pulling step batches and pushing weights to the generators.

Rank 0 also prepares the run's starting checkpoint (tiny model + warm-start, cached), starts the
orchestrator beside itself and keeps it alive, and leads the weight broadcast.

Per step k (all ranks): ask the orchestrator for this DP rank's share of step k's batch; train;
push the new weights (version k+1) to every generator (`pipeline.roles.weight_push`); every ``checkpoint_every`` steps save model, optimizer and RNG states. On a
restart the latest checkpoint is loaded and the orchestrator told to roll its step record back to
it (`docs/architecture.md`, "Crash resume").

Invariants:
- a step's samples are the orchestrator's recorded batch for that step; the generators hold the
  weights of version v only after the broadcast of v completed; versions equal optimizer steps;
- a checkpoint directory is complete or absent (written under a temporary name, then renamed);
  with ``run.async_checkpoints`` it is written in the background while the next steps train, and
  completed before the trainer returns (`pipeline.trainer.checkpoint_writer`);
- every wait (batch, rendezvous, broadcast) has a timeout (``run.timeout_s``), and the leader's
  waits on generators (for a batch, for a weight group) end, failing the run, once every
  generator task was abandoned and no generator is a member (checked every `BATCH_POLL_S`);
- the ranks wait for a batch in rounds of `BATCH_POLL_S` that end in an agreement: a generator
  that (re)joined meanwhile gets the current version at once, from any number of ranks, and a stop
  during the wait is taken by all of them at the same step;
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

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from pipeline.config import TokenflowConfig, stored_record_schema
from pipeline.metrics import MetricsWriter
from pipeline.orchestrator.clock import staleness
from pipeline.protocol.links import TrainerLink
from pipeline.roles.common import agree_over_ranks, cpu_cores_for, pin_process
from pipeline.run_dir import load_run_config, model_dir, publish_model
from pipeline.roles.weight_push import WeightPusher
from pipeline.supervise import KeptProcess, die_with_parent
from pipeline.run_files import EXPORT_DIR, LOGS_DIR, checkpoint_name

log = logging.getLogger(__name__)

BATCH_POLL_S = 1.0
"""While the trainer waits for a batch, how often it looks at the generators: a restarted one to
send the weights to, or none left at all (`WeightPusher.check_generators_left`)."""


def warm_start_config(cfg: TokenflowConfig, task):
    """The run's supervised warm-start on `task` (a WarmStartConfig), or None when it has none."""
    steps = cfg.model.warmstart_steps_or_default(task)
    if steps <= 0:
        return None
    from pipeline.models.warmstart import WarmStartConfig
    from pipeline.tasks.prompting import PromptFormat

    return WarmStartConfig(steps=steps, lr=cfg.model.warmstart_lr, prompt_format=PromptFormat.of(cfg.task, task),
                           distractor_fraction=task.warmstart_distractor_fraction)


def prepare_model(run_dir: Path, cfg: TokenflowConfig) -> Path:
    """The run's starting checkpoint (cached build), recorded in RUN/model.json for the other roles."""
    from pipeline.models.tiny import resolve_model

    path = resolve_model(cfg.model.name)
    if cfg.task.name != "synthetic" and cfg.model.warmstart_steps != 0:
        from pipeline.models.warmstart import ensure_warm_start
        from pipeline.tasks import make_task

        task = make_task(cfg.task)
        ws = warm_start_config(cfg, task)
        if ws is not None:
            path = ensure_warm_start(path, task, ws)
    publish_model(run_dir, path)
    return path


def latest_checkpoint(run_dir: Path) -> tuple[int, Path | None]:
    """(steps done, directory) of the newest complete checkpoint, (0, None) if none."""
    from pipeline.trainer.checkpoint_writer import complete_checkpoints

    found = complete_checkpoints(run_dir)
    return found[-1] if found else (0, None)


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
        self.weights: WeightPusher | None = None

    # -- set-up --------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg, timeout = self.cfg, self.cfg.run.timeout_s
        pin_process(cpu_cores_for("trainer", self.rank, cfg))
        if self.leader:
            prepare_model(self.run_dir, cfg)
            self.orchestrator = KeptProcess("orchestrator", lambda: start_orchestrator(self.run_dir),
                                            cfg.orchestrator.max_restarts, _interrupt_main)
        store = self._process_group_store(timeout)
        model = model_dir(self.run_dir, timeout)
        from dataclasses import replace

        from pipeline.launch.network import bind_gloo_groups
        from pipeline.trainer.engine import Trainer
        bind_gloo_groups()  # cluster.network.address: the process group and megatron's groups listen there
        tcfg = replace(cfg.trainer, model_dir=str(model), timeout_s=timeout)
        self.trainer = Trainer(tcfg, rank=self.rank, world_size=self.world, store=store)
        self.start_step, ckpt = latest_checkpoint(self.run_dir)
        if ckpt is not None:
            self.trainer.load(ckpt)
            log.info("resumed from %s", ckpt)
        from pipeline.trainer.checkpoint_writer import CheckpointWriter
        keep = cfg.run.keep_checkpoints
        if keep and cfg.scorers.teacher == "lagged":  # its snapshots t(v) outlive its window (docs/scorers.md)
            keep = max(keep, cfg.scorers.teacher_lag // cfg.run.checkpoint_every + 3)
        self.checkpoints = CheckpointWriter(self.trainer, self.run_dir, keep=keep,
                                            asynchronous=cfg.run.async_checkpoints)
        from megatron.core import parallel_state as ps
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.link = TrainerLink(self.run_dir, stored_record_schema(cfg), cfg.orchestrator.transport,
                                timeout_s=timeout, rank=self.rank)
        self.live = cfg.cluster.generators > 0  # else: replay of a recorded log, nobody to sync
        if self.leader:
            self.link.resume(self.start_step)
        self.version = self.start_step
        self.weights = WeightPusher(cfg=cfg, run_dir=self.run_dir, rendezvous=self.rdv, link=self.link,
                                    trainer=self.trainer, rank=self.rank, world=self.world,
                                    host=self._host(), stop_requested=self.task.stop_requested)
        if self.live:
            self.weights.push(self.version)  # generators start from the trainer's weights
        else:
            self.link.report_version(self.version)

    def _process_group_store(self, timeout: float):
        """The TCPStore of the trainer's process group, served by rank 0 on one address only. Its
        address comes from MPI where the launch bootstrapped it (`cluster.mpi`, docs/moe-scale.md:
        rank 0 serves on the socket its supervisor bound), else rank 0 binds `_host`'s (`listen_on`)
        and publishes it in the run's rendezvous: the published port is the one listening."""
        import datetime

        from pipeline.launch.rendezvous import DIST_ENV, bootstrap_store, listen_on, open_store
        if os.environ.get(DIST_ENV):
            boot = json.loads(os.environ[DIST_ENV])
            log.info("process group from MPI: rank %d of %d, master %s:%d", boot["rank"], boot["size"],
                     boot["host"], boot["port"])
            return bootstrap_store(boot, timeout)
        wait = datetime.timedelta(seconds=timeout)
        if self.leader:
            host = self._host()
            listener = listen_on(host)
            self.rdv.publish("trainer_dist", {"host": host, "port": listener.getsockname()[1]})
            return open_store(host, listener.getsockname()[1], self.world, True, wait, listener)
        master = self.rdv.wait("trainer_dist", timeout)
        return open_store(master["host"], master["port"], self.world, False, wait)

    def _host(self) -> str:
        """Address other roles reach this process at: ``cluster.network``'s, else loopback locally
        and the node name on Slurm (`pipeline.launch.network.listen_address`)."""
        from pipeline.launch.network import listen_address
        return listen_address(self.cfg.cluster.network,
                              "127.0.0.1" if self.cfg.cluster.launcher == "local" else self.task.node)

    def run(self) -> dict:
        from pipeline.trainer.layout import train_samples

        cfg = self.cfg
        steps, every = cfg.run.steps, cfg.run.eval_every
        t_run = time.monotonic()
        busy = 0.0
        for step in range(self.start_step, steps):
            if self._stop_agreed():  # checkpoint signal (preemption/time limit): save, return, get requeued
                if step != self.start_step and step % cfg.run.checkpoint_every:
                    self._checkpoint(step)
                self.checkpoints.wait()
                return {"steps": step, "version": self.version, "stopped": True}
            if self.leader and every and step % every == 0:
                self.link.request_eval(step, self.version)
            t0 = time.monotonic()
            batch = self._batch_or_stop(step)
            if batch is None:  # stopped while waiting (generators stop too): nothing more to train on
                if step != self.start_step and step % cfg.run.checkpoint_every:
                    self._checkpoint(step)
                self.checkpoints.wait()
                return {"steps": step, "version": self.version, "stopped": True}
            t1 = time.monotonic()
            samples = train_samples(batch)
            me = cfg.run.mismatch_every
            mismatch = self._mismatch(batch, samples) if me and step % me == 0 else None
            m = self.trainer.train_step(samples)
            t2 = time.monotonic()
            self.version = step + 1
            sync_s = self.weights.push(self.version) if self.live else 0.0
            if self.leader and not self.live:
                self.link.report_version(self.version)
            self.checkpoints.poll()  # a save written in the background completes once written
            if (step + 1) % cfg.run.checkpoint_every == 0 or step + 1 == steps:
                self._checkpoint(step + 1)
            busy += time.monotonic() - t1
            if self.leader:
                stale = staleness(step, batch.min_versions())
                self.metrics.log("train_step", step=step, version=self.version,
                                 reward_mean=float(np.mean(batch.columns["reward"])),
                                 samples=len(batch), staleness_mean=float(stale.mean()),
                                 staleness_max=int(stale.max()), wait_s=t1 - t0, step_s=t2 - t1,
                                 sync_s=sync_s, sync_bytes_sent=self.weights.sent_bytes,
                                 mismatch=mismatch, sync_failures=self.weights.sync_failures,
                                 orchestrator_restarts=self.orchestrator.restarts,
                                 trainer_idle_frac=1 - busy / max(1e-9, time.monotonic() - t_run),
                                 **m)
        self.checkpoints.wait()
        if self.leader and every:
            self.link.request_eval(steps, self.version)
        return {"steps": steps, "version": self.version}

    def _batch_or_stop(self, step: int):
        """Step ``step``'s batch; None if a stop signal came while waiting for it (``run.timeout_s``).

        The ranks wait in rounds of `BATCH_POLL_S` that end in an agreement (a rank holding its
        share waits for the others there), so all of them act together on what the leader sees
        meanwhile: a restarted generator (or one that joined) gets the current version at once,
        with any number of ranks (before, only a one-rank trainer sent it: with more, a sole
        generator restarted never got weights, took no work, and the run failed after
        ``run.timeout_s``), and a stop during the wait is taken by every rank at the same step."""
        from pipeline.protocol.transport import TransportError

        deadline = time.monotonic() + self.cfg.run.timeout_s
        batch = None
        while True:
            left = deadline - time.monotonic()
            if batch is None:
                try:
                    batch = self.link.get_batch(step, self.version, self.dp_size,
                                                min(BATCH_POLL_S, max(left, 0.1)), dp_rank=self.dp_rank)[0]
                except TransportError:
                    pass
            if not self._agree(int(batch is None)):
                return batch
            # A restarted generator takes work only with weights: send them now (a collective).
            if self._agree(int(self.leader and self.live and self.weights.generators_changed()), op="leader"):
                log.info("generators changed while waiting for step %d: resending version %d", step, self.version)
                self.weights.push(self.version)
            if self._agree(int(self.task.stop_requested.is_set())):
                log.warning("stop requested while waiting for the batch of step %d", step)
                return None
            if self.leader and self.live:  # nobody to wait for: the run fails naming it
                self.weights.check_generators_left()
            if self._agree(int(left <= 0)):
                raise TransportError(f"no batch for step {step} within {self.cfg.run.timeout_s:.0f}s")

    def _agree(self, value: int, op: str = "max") -> int:
        """`agree_over_ranks` over the trainer ranks."""
        return agree_over_ranks(value, world=self.world, cuda=self.trainer.cuda, op=op)

    def _stop_agreed(self) -> bool:
        """True on every trainer rank once any rank got the stop signal (so all stop at the same step)."""
        return bool(agree_over_ranks(int(self.task.stop_requested.is_set()), world=self.world,
                                     cuda=self.trainer.cuda))

    def _mismatch(self, batch, samples) -> float | None:
        """Mean |trainer - generator| logprob over the model tokens of samples the current weights
        generated whole (a collective: every rank computes it on its share; None where no rank has
        one). A sequence that crossed a weight swap keeps the old weights' keys and values (`keep_kv`,
        docs/weight-sync.md), so its later tokens differ from a fresh forward by design, not by
        numerics: it is left out; so are an episode's environment tokens (no logprob of the policy)."""
        whole = [bool((batch.tokens("versions", i) == self.version).all()) for i in range(len(batch))]
        current = [np.full(len(samples[i].trained), w) & samples[i].trained for i, w in enumerate(whole)]
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
        """Save (written in the background with run.async_checkpoints; `CheckpointWriter`), and
        export it when trainer.export asks for it."""
        self.checkpoints.save(steps_done)
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
        if self.weights is not None:
            self.weights.close()
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


def skip_wandb_import() -> None:
    """Called before megatron-core is imported, in a trainer rank (which never uses W&B: tokenflow's
    trackers run in the launcher). megatron-core's timers import ``wandb`` when it is installed (it
    is: an optional tracker of ours): ~0.6 CPU s per process, and two temp directories
    (``*wandb-media``, ``*wandb-artifacts``) that a process ending through ``os._exit``, as a role
    does, leaves behind. With ``sys.modules["wandb"] = None`` its ``import wandb`` raises
    ImportError and megatron-core goes on as without W&B."""
    sys.modules.setdefault("wandb", None)


def main(task) -> dict:
    skip_wandb_import()  # before megatron-core's first import
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
