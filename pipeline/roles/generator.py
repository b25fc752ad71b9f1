"""The generator role: one vLLM engine serving the orchestrator's work and taking weights in place.

One asyncio loop runs everything: polling the orchestrator link (short timeouts, so the engine's
own tasks keep running), one task per granted group, greedy evaluation batches, and weight
updates, which the trainer announces through the orchestrator and then broadcasts (applied by a
`pipeline.roles.weight_take.WeightTaker`, whose invariants cover weight groups and versions).

Invariants:
- the link (a ZeroMQ socket) is used from the loop's thread only;
- a group's result is sent once all of its samples are complete; the link keeps it until the
  orchestrator acknowledges it (and re-sends it otherwise);
- it takes work (sends credits) only once it loaded a version the trainer sent (`WeightTaker.loaded`);
- a dead engine (its processes killed or crashed) ends the role with an error within a second, so
  the task's supervisor ends what is left of the engine and restarts the role, which joins the
  weight group and takes work only after loading the current weights; a stop signal
  (``task.stop_requested``: preemption, scancel, a generator job's time limit) is a planned
  departure (`_leave`: in-flight groups returned at once, then the engine ended and the role
  returns, well within a second and with no error logged) and so is the end of the run
  (trainer rank 0's result of this attempt exists: a generator restarted after the orchestrator
  said ``stop`` hears it no more); Slurm's SIGKILL follows ``scancel``'s SIGTERM after KillWait,
  long after the ``Leave`` went out;
- a restarted role tells the orchestrator at once that the process before it is gone: its
  supervisor sends a `Leave` on its behalf (`predecessor_left`) as it restarts it, so its leases
  are re-issued and the others' weight group is rebuilt without it at the trainer's next push;
- a generator that joins a running run (a weight group exists: a generator job's, a restarted
  one, unless it is the run's sole generator: nobody trains while it restarts) warms its engine up
  at the run's batch shape before it says Hello (`_warm_up`), so the
  group that takes it in forms with an idle, warm engine, and neither the trainer's first
  broadcast into it nor the ones while it serves its first leases wait for a first engine step.
"""
from __future__ import annotations

import asyncio
import faulthandler
import logging
import os
import signal
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from pipeline.config import record_schema
from pipeline.generator.completion import eval_sample
from pipeline.generator.start_report import StartReporter
from pipeline.launch.generator_jobs import JOB_ENV, RUN_CHECK_S, job_records, run_alive
from pipeline.launch.rendezvous import running_attempt
from pipeline.launch.task import JOINS_RUN
from pipeline.metrics import MetricsWriter
from pipeline.protocol.links import Control, EvalItem, GeneratorLink, WorkItem
from pipeline.protocol.sample_batch import SampleBatch
from pipeline.roles.common import cpu_cores_for, lower_cpu_priority, pin_process, shares_trainer_cores
from pipeline.roles.weight_take import WeightTaker
from pipeline.run_dir import load_run_config, model_dir

log = logging.getLogger(__name__)

WARM_UP_PROMPT_MAX = 256
"""Longest prompt of the warm-up before joining a running run (`GeneratorRole._warm_up`)."""


class GeneratorRole:
    def __init__(self, task) -> None:
        self.task = task
        self.run_dir = Path(task.run_dir)
        self.cfg = load_run_config(self.run_dir)
        self.rank = task.rank
        self.schema = record_schema(self.cfg)
        self.metrics = MetricsWriter(self.run_dir, f"generator{self.rank}")
        self.stop = False
        self.tokens = 0
        self.busy_since: float | None = None
        self.busy_s = 0.0
        self.in_flight = 0
        self.job = os.environ.get(JOB_ENV, "")  # the generator job it came with ("": the run's own)

    async def run(self) -> dict:
        from pipeline.generator.engine import Generator
        from pipeline.generator.episodes import episode_runner

        cfg, timeout = self.cfg, self.cfg.run.timeout_s
        cores = cpu_cores_for("generator", self.rank, cfg)
        pin_process(cores)
        if shares_trainer_cores(self.rank, cfg, cores):  # the trainer's cores: use what it leaves idle
            lower_cpu_priority(cfg.cluster.joined_generator_nice)
            log.info("on trainer rank 0's cores %s at nice %d (cluster.joined_generator_nice)", cores, os.nice(0))
        if self._run_over() or self.task.stop_requested.is_set():  # stopped before it had anything to leave
            return {"tokens": 0, "version": None}
        model = str(model_dir(self.run_dir, timeout))
        gcfg = replace(cfg.generator, model=model, seed=cfg.orchestrator.seed,
                       cpu_cores=cfg.generator.cpu_cores or (",".join(map(str, cores)) if cores else ""))
        self.gen = Generator(gcfg, generator_id=self.rank, schema=self.schema, episodes=episode_runner(cfg, model))
        self.weights = WeightTaker(gen=self.gen, rendezvous=self.task.rendezvous, rank=self.rank, timeout_s=timeout,
                                   stop_requested=self.task.stop_requested)
        report = StartReporter(self.run_dir, self.rank, cfg.orchestrator.transport, timeout)
        try:
            report.phase = "engine"
            await self.gen.start()
            slots = max(1, gcfg.max_num_seqs // cfg.orchestrator.group_size)
            if self.weights.newest_published_epoch() and not self._sole_generator():  # a running run: it says Hello
                # once its engine is warm (the sole generator, restarted, has nobody training meanwhile)
                report.phase = "warm-up"
                await self._warm_up(slots * cfg.orchestrator.group_size)
        finally:
            report.stop()
        self.weights.joinable_from = 1 + self.weights.newest_published_epoch()  # read before the Hello
        self.link = self.weights.link = GeneratorLink(self.run_dir, self.rank, slots, self.schema,
                                                      cfg.orchestrator.transport, timeout_s=timeout, job=self.job)
        controls: asyncio.Queue[tuple[Control, float]] = asyncio.Queue()  # with its arrival time
        self.controls_task = asyncio.create_task(self.weights.run(controls, on_stop=self._stop))
        tasks: set[asyncio.Task] = {self.controls_task}
        t_start = last_metrics = last_run_check = time.monotonic()
        while not self.stop:
            if self.task.stop_requested.is_set():
                self._leave(tasks)
                break  # its engine ends now (a broadcast still waiting on it fails: the group is rebuilt)
            # Credits are sent only once weights are loaded: no work before the current version.
            for item in self.link.poll(0.002, send_credit=self.weights.loaded):
                if isinstance(item, Control):
                    self.weights.announced(item)
                    controls.put_nowait((item, time.monotonic()))
                elif isinstance(item, WorkItem):
                    tasks.add(asyncio.create_task(self._group(item)))
                elif isinstance(item, EvalItem):
                    tasks.add(asyncio.create_task(self._eval(item)))
            done = {t for t in tasks if t.done()}
            for t in done:
                if not t.cancelled() and t.exception() is not None and not self.task.stop_requested.is_set():
                    self._end_dead_engine()
                    raise t.exception()  # a failed group or eval must not pass silently
            tasks -= done
            await asyncio.sleep(0.003)
            now = time.monotonic()
            if now - last_metrics >= 1.0:
                if not self.gen.engine_alive() and not self.task.stop_requested.is_set():
                    self._end_dead_engine()
                    raise RuntimeError("a vLLM engine process died")
                self.stop = self.stop or self._run_over()
                if self.task.config.get(JOINS_RUN):
                    if running_attempt(self.run_dir) != self.task.attempt:
                        raise RuntimeError("the run was requeued: this generator's supervisor restarts it "
                                           "to join the new attempt")
                    if now - last_run_check >= RUN_CHECK_S:
                        last_run_check = now
                        if not run_alive(self.task.config):
                            log.warning("the run this generator joined is gone: stopping")
                            self.stop = True
                self._log_metrics(now - t_start)
                last_metrics = now
        for t in tasks:
            t.cancel()
        self._log_metrics(time.monotonic() - t_start)
        self.link.close()
        self.gen.shutdown()  # engine processes vLLM's shutdown leaves behind: ended with the task's tree
        return {"tokens": self.tokens, "version": self.gen.version}

    def _end_dead_engine(self) -> None:
        """A process of the engine died: SIGKILL what is left of it now (`Generator.shutdown`), so the
        role's exit, and its restart by the supervisor, need not wait for them: its workers ignore
        the SIGTERM of the task's `end_tree` while their owner lives (before, 3 s passed from the
        engine's death to the restart, twice on a loaded 2-core machine)."""
        if not self.gen.engine_alive():
            self.gen.shutdown()

    def _leave(self, tasks: set[asyncio.Task]) -> None:
        """A planned departure (the stop signal): abort the groups and evaluations under way and
        tell the orchestrator, which re-issues their leases at once. The engine ends right after
        (`Generator.shutdown`): a broadcast the trainer started before it knew fails at once and
        is retried in a group without this generator."""
        work = [t for t in tasks if t is not self.controls_task]
        for t in work:
            t.cancel()
        self.link.leave()
        self.metrics.log("generator_leave", generator_id=self.rank, job=self.job, aborted=len(work),
                         version=self.gen.version)
        log.info("leaving the run: %d group/eval task(s) aborted, their leases returned", len(work))

    def _stop(self) -> None:
        """The orchestrator said `Stop` (the run is over): the loop ends after its round."""
        self.stop = True

    def _sole_generator(self) -> bool:
        """The run's one generator, and no generator job joined: while it restarts nothing is
        generated, so a warm-up before its Hello would only delay training (by the engine's first
        steps, 5-49 s on a loaded 2-core machine)."""
        return (self.cfg.cluster.generators == 1 and not self.task.config.get(JOINS_RUN)
                and not job_records(self.run_dir))

    def _run_over(self) -> bool:
        """True once trainer rank 0 of this attempt wrote its result (the run ended, well or not)."""
        import json

        from pipeline.launch.task import result_path
        try:
            return json.loads(result_path(self.run_dir, "trainer", 0).read_text())["attempt"] == self.task.attempt
        except (FileNotFoundError, ValueError, KeyError):
            return False

    async def _warm_up(self, sequences: int) -> None:
        """Generate once at the run's batch shape (``sequences`` at a time, as many as its leases
        allow, each ``max_tokens`` long) before saying Hello to a running run.

        Until it has loaded weights a generator takes no work, so its engine is idle when the group
        it joins forms and when the trainer's first broadcast into it comes (the rpc posting the
        receive is handled at once); but its first generation steps are slow (allocations, kernel
        set-up: 5-49 s measured on a loaded 2-core machine), and the switch into a new group (an
        rpc) and the poll of each receive wait for the engine step in progress, so without this
        the first updates after the join waited for them. The weights are whatever the engine started with; the outputs are thrown away."""
        from pipeline.generator.vllm_args import sampling_params

        t0 = time.monotonic()
        gcfg, engine = self.gen.config, self.gen.engine
        budget = gcfg.max_tokens
        prompt_len = max(1, min(WARM_UP_PROMPT_MAX, gcfg.max_model_len - budget - 1))
        vocab = engine.model_config.get_vocab_size()
        rng = np.random.default_rng(self.rank)
        params = sampling_params(replace(gcfg, ignore_eos=True), seed=None, max_tokens=budget)

        async def one(i: int) -> None:
            prompt = {"prompt_token_ids": rng.integers(0, vocab, prompt_len).tolist()}  # distinct: no prefix hits
            async for _ in engine.generate(prompt, params, f"warm-up-{i}"):
                pass

        await asyncio.gather(*(one(i) for i in range(sequences)))
        log.info("engine warmed up: %d sequences of %d + %d tokens in %.2fs", sequences, prompt_len,
                 budget, time.monotonic() - t0)

    def _busy(self, delta: int) -> None:
        now = time.monotonic()
        if self.in_flight == 0 and delta > 0:
            self.busy_since = now
        self.in_flight += delta
        if self.in_flight == 0 and self.busy_since is not None:
            self.busy_s += now - self.busy_since
            self.busy_since = None

    async def _group(self, item: WorkItem) -> None:
        from pipeline.generator.config import GroupRequest

        self._busy(+1)
        try:
            samples = await self.gen.generate_group(GroupRequest(
                group_id=item.group_id, prompt_id=item.prompt_id, attempt=item.attempt,
                prompt_ids=item.prompt_ids.tolist(), n=item.n))
        finally:
            self._busy(-1)
        self.tokens += sum(len(s.completion_ids) for s in samples)
        self.link.queue_result(item, SampleBatch.from_samples(samples, self.schema))

    async def _eval(self, item: EvalItem) -> None:
        """A held-out prompt's greedy answer (sample 0) and `eval.samples` sampled ones (1..k), sent together."""
        from pipeline.generator.config import request_seed

        max_tokens = self.cfg.run.eval_max_tokens or self.cfg.generator.max_tokens
        k, ids = self.cfg.eval.samples, item.prompt_ids.tolist()
        self._busy(+1)
        try:
            (greedy,) = await self.gen.evaluate([ids], max_tokens)
            sampled = await self.gen.evaluate_sampled(
                ids, k, self.cfg.eval.temperature, lambda j, seg: request_seed(
                    self.cfg.orchestrator.seed, -1 - item.index, j, item.step, seg), max_tokens) if k else []
        finally:
            self._busy(-1)
        samples = []
        for j, c in enumerate([greedy, *sampled]):
            if not c.token_ids:  # nothing generated: record the prompt's answer as one pad token
                c.token_ids, c.versions = [0], [self.gen.version]
            samples.append(eval_sample(c, item.index, item.prompt_ids, self.rank, self.schema, sample_index=j))
        self.link.send_eval_result(item.step, np.full(len(samples), item.index),
                                   SampleBatch.from_samples(samples, self.schema))

    def _log_metrics(self, elapsed: float) -> None:
        busy = self.busy_s + (time.monotonic() - self.busy_since if self.busy_since else 0.0)
        self.metrics.log("generator", generator_id=self.rank, version=self.gen.version,
                         tokens=self.tokens, tokens_per_s=self.tokens / max(elapsed, 1e-9),
                         idle_frac=1 - busy / max(elapsed, 1e-9), stall_s=self.weights.stall_s,
                         in_flight_groups=self.in_flight, unacked=len(self.link.unacked),
                         sync_failures=self.weights.sync_failures,
                         sync_bytes_received=self.weights.sync_bytes_received,
                         weight_epoch=self.weights.epoch, restart=self.task.restart,
                         job=self.job)


def predecessor_left(run_dir: Path, rank: int) -> None:
    """Tell the orchestrator that generator ``rank``'s role process died (a `Leave` on its behalf):
    its leases are re-issued now and the trainer rebuilds the weight group of the others at its
    next push, instead of both waiting ``orchestrator.generator_dead_after_s`` for its silence (15 s
    of no training measured when the restarted role said it itself, after its start on a loaded
    2-core machine). Run by the task's supervisor as it restarts the role
    (`pipeline.launch.supervisor`); the orchestrator forgets the leaver's `Stop` once the new
    process says Hello."""
    from pipeline.protocol.links import GeneratorLink

    cfg = load_run_config(run_dir)
    link = GeneratorLink(run_dir, rank, 0, record_schema(cfg), cfg.orchestrator.transport,
                         timeout_s=cfg.run.timeout_s, job=os.environ.get(JOB_ENV, ""))
    link.leave()
    link.close()


def log_stacks_at_sigterm() -> None:
    """Slurm SIGKILLs a cancelled job's tasks KillWait seconds after its SIGTERM (3 s on the test
    cluster), so `Leave` must go out before: at the SIGTERM, every thread's stack goes to the log
    (stderr) from a C-level handler, also if the interpreter could not run the Python one, which
    it then calls (`StopWatcher`: ``task.stop_requested``)."""
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)


def main(task) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s generator %(levelname)s %(message)s")
    log_stacks_at_sigterm()
    return asyncio.run(GeneratorRole(task).run())
