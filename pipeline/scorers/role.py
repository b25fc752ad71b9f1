"""A scorer process: one service ("reward" or "teacher") for the orchestrator's scorer pool.

Started as a component of the run's plan (``scorer`` for rewards, ``teacher`` for teacher
logprobs; local process or Slurm heterogeneous-job component, restarted in place by its task
supervisor) or by hand: ``python -m pipeline.scorers.role RUN_DIR --service reward --rank 0``.

Invariants:
- it connects to the address in ``RUN/rendezvous/scorers.json`` (the pool rebinds the same port
  after an orchestrator restart; the process re-reads the file when the pool stays silent), says
  hello with its service, rank and slots, and sends a heartbeat every second (the records:
  `pipeline.protocol.scorer_pool`);
- it answers each `Score` request with one `Scored` message: the filled fields as raw arrays
  concatenated over the request's groups (``reward`` [samples], ``token_rewards`` /
  ``teacher_logprobs`` [completion tokens]) plus ``group_rows`` / ``group_tokens``, in request
  order; an exception while scoring is answered as ``error`` (text), never raised; a message that
  is not a well-formed record is logged and dropped (the pool re-sends an unanswered request);
- requests are scored one at a time on a thread of their own, so the loop that owns the socket
  keeps its heartbeat (a long request is not taken for a dead scorer) and forwards weight messages
  while a request is scored;
- a lagged teacher also receives every weight update (`pipeline.scorers.lagged`): it says so in
  its hello (``follows_weights``), and the pool's `WeightsRegroup` {weight_epoch} / `WeightsUpdate`
  {version, weight_epoch} go to its `WeightFollower`, whose own thread joins and receives;
- it exits on `ScorerStop` (the orchestrator closed), on the task's stop request, or after
  ``orphan_after_s`` without hearing from the pool (its orchestrator is gone for good).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from pipeline.protocol.codec import MessageError, encode
from pipeline.protocol.record import RecordSchema
from pipeline.protocol.sample_batch import SampleBatch
from pipeline.protocol.scorer_pool import (SCORER_POOL, Score, Scored, ScorerAlive, ScorerHello, ScorerStop,
                                           ScorerWho, WeightsRegroup, WeightsUpdate)
from pipeline.protocol.transport import MessageClient, TransportConfig, TransportError, load_or_create_secret
from pipeline.scorers.config import ScorersConfig
from pipeline.scorers.pool import SCORERS_RENDEZVOUS

log = logging.getLogger(__name__)

#: Plan component -> the service its processes offer.
ROLE_SERVICES = {"scorer": "reward", "teacher": "teacher"}


def build_scorer(cfg: ScorersConfig, service: str, run_dir: Path, teacher_model: str = ""):
    """The callable ``SampleBatch -> {field: array}`` of this service (``teacher_model``: the
    teacher's checkpoint; a lagged teacher's version 0)."""
    if service == "teacher":
        from pipeline.scorers.teacher import TeacherScorer
        return TeacherScorer(teacher_model, run_dir=run_dir)
    from pipeline.scorers.models import ProcessRewardScorer, RewardModelScorer
    if cfg.reward == "process_reward":
        return ProcessRewardScorer(cfg.reward_model, cfg.step_token_id, cfg.device)
    if cfg.reward == "reward_model":
        return RewardModelScorer(cfg.reward_model, cfg.device)
    raise ValueError(f"scorers.reward={cfg.reward!r} runs in the orchestrator, not in a scorer role")


def _address(run_dir: Path, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return json.loads((run_dir / SCORERS_RENDEZVOUS).read_text())["address"]
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            if time.monotonic() > deadline:
                raise TransportError(f"no scorer pool address in {run_dir / SCORERS_RENDEZVOUS} "
                                     f"after {timeout_s:.0f}s") from None
            time.sleep(0.1)


def weight_follower(run_cfg, rank: int, rendezvous, secret: bytes):
    """A lagged teacher's `WeightFollower` (None for any other service); ``secret``: the run's."""
    if run_cfg.scorers.teacher != "lagged":
        return None
    from pipeline.scorers.lagged import WeightFollower

    return WeightFollower(f"teacher-{rank}", rendezvous, run_cfg.scorers.teacher_lag,
                          run_cfg.run.checkpoint_every, run_cfg.generator.weight_timeout_s, secret)


def serve(run_dir: Path, cfg: ScorersConfig, service: str, rank: int,
          stop: threading.Event | None = None, orphan_after_s: float = 300.0,
          follower=None) -> dict:
    """Answer score requests until told to stop; returns totals (samples, busy seconds).
    ``follower``: a lagged teacher's `WeightFollower` (closed on return)."""
    from pipeline.metrics import MetricsWriter

    run_dir = Path(run_dir)
    teacher_model = cfg.teacher_model
    if service == "teacher" and not teacher_model:  # lagged: starts from the policy's own weights
        from pipeline.run_dir import model_dir
        teacher_model = str(model_dir(run_dir, timeout_s=orphan_after_s))
    scorer = build_scorer(cfg, service, run_dir, teacher_model)
    scorer.follower = follower
    key = load_or_create_secret(run_dir)
    address = _address(run_dir, orphan_after_s)
    identity = f"{service}-{rank}-{os.getpid()}"
    client = MessageClient(key, address, TransportConfig(), identity)
    metrics = MetricsWriter(run_dir, f"{ROLE_OF[service]}.{rank}")
    hello = encode(ScorerHello(service, rank, max(1, cfg.inflight_batches), follower is not None))
    client.send(*hello)
    samples = requests = 0
    busy_s = 0.0
    started = last_alive = last_heard = last_metrics = time.monotonic()
    stop = stop or threading.Event()
    scoring = ThreadPoolExecutor(1, thread_name_prefix="scoring")  # the socket stays on this thread
    answers: deque[Future] = deque()  # in request order
    try:
        while not stop.is_set():
            msg = client.recv(0.05 if answers else 0.5)
            while answers and answers[0].done():
                answer, seconds = answers.popleft().result()
                busy_s += seconds
                client.send(*encode(answer))
                samples += int(answer.arrays["group_rows"].sum()) if "group_rows" in answer.arrays else 0
                requests += 1
            now = time.monotonic()
            if msg is not None:
                last_heard = now
                try:
                    msg = SCORER_POOL.decode(msg)
                except MessageError as exc:
                    log.warning("the scorer pool sent a bad message: %s", exc)
                    msg = None
                if isinstance(msg, ScorerStop):
                    break
                if isinstance(msg, ScorerWho):
                    client.send(*hello)
                elif isinstance(msg, WeightsRegroup) and follower is not None:
                    follower.regroup(msg.weight_epoch)
                elif isinstance(msg, WeightsUpdate) and follower is not None:
                    follower.update(msg.version, msg.weight_epoch)
                elif isinstance(msg, Score):  # scored beside this loop, which keeps heartbeating
                    answers.append(scoring.submit(_timed_answer, scorer, msg))
            elif now - last_heard > orphan_after_s:
                log.warning("no word from the scorer pool for %.0fs: leaving", orphan_after_s)
                break
            elif now - last_heard > 5.0:
                fresh = _address(run_dir, 0.0)
                if fresh != client.address:  # the orchestrator restarted on another port
                    client.close()
                    client = MessageClient(key, fresh, TransportConfig(), identity)
                    client.send(*hello)
                    last_heard = now
            if now - last_alive >= 1.0:
                client.send(*encode(ScorerAlive()), timeout_s=5.0)
                last_alive = now
            if now - last_metrics >= 5.0:
                metrics.log("scorer", service=service, rank=rank, samples=samples, requests=requests,
                            busy_s=busy_s, samples_per_busy_s=samples / max(busy_s, 1e-9),
                            samples_per_s=samples / max(now - started, 1e-9), **_teacher_state(scorer))
                last_metrics = now
    finally:
        scoring.shutdown(wait=False, cancel_futures=True)
        client.close()
        if service == "teacher":
            scorer.close()
        if follower is not None:
            metrics.log("scorer", service=service, rank=rank, samples=samples, requests=requests,
                        busy_s=busy_s, **_teacher_state(scorer))
            follower.close()
        metrics.close()
    return {"service": service, "samples": samples, "requests": requests, "busy_s": busy_s}


def _teacher_state(scorer) -> dict:
    """A lagged teacher's refreshes by source and what its follower received and holds."""
    f = getattr(scorer, "follower", None)
    if f is None:
        return {}
    return {"teacher_version": scorer.version, **{f"refresh_{k}": n for k, n in scorer.refreshes.items()},
            "weights_received": f.updates, "weights_version": f.received, "snapshots_kept": f.kept,
            "snapshots_held": len(f.held()), "weight_failures": f.failures}


#: Service -> the plan component (and metrics role) offering it.
ROLE_OF = {v: k for k, v in ROLE_SERVICES.items()}


def _timed_answer(scorer, msg: Score) -> tuple[Scored, float]:
    t0 = time.perf_counter()
    answer = _answer(scorer, msg)
    return answer, time.perf_counter() - t0


def _answer(scorer, msg: Score) -> Scored:
    teacher_version = None
    try:
        if msg.teacher_version is not None:  # a lagged teacher: load the snapshot asked for
            teacher_version = int(scorer.use_version(msg.teacher_version))
        batch = SampleBatch(msg.arrays, RecordSchema.from_dict(msg.schema), validate=True)
        gid = batch.columns["group_id"]
        firsts = np.flatnonzero(np.r_[True, gid[1:] != gid[:-1]])
        rows = np.diff(np.r_[firsts, len(batch)]).astype(np.int64)
        clen = batch.columns["completion_len"]
        toks = np.array([clen[a:a + n].sum() for a, n in zip(firsts, rows)], np.int64)
        if len(rows) != len(msg.jobs):
            raise ValueError(f"{len(rows)} groups in the batch for {len(msg.jobs)} jobs")
        fields = scorer(batch)
        return Scored(msg.request, msg.jobs, teacher_version=teacher_version,
                      arrays={**{k: np.asarray(v, np.float32) for k, v in fields.items()},
                              "group_rows": rows, "group_tokens": toks})
    except Exception as exc:  # answered, never raised: the pool fails these groups
        log.exception("scoring request %s failed", msg.request)
        return Scored(msg.request, msg.jobs, error=f"{type(exc).__name__}: {exc}"[:2000],
                      teacher_version=teacher_version)


def main(task) -> dict:
    """Plan entry: ``pipeline.scorers.role:main`` for the ``scorer`` and ``teacher`` components."""
    from pipeline.run_dir import load_run_config

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {task.role} %(levelname)s %(message)s")
    cfg = load_run_config(task.run_dir)
    service = ROLE_SERVICES[task.role]
    follower = (weight_follower(cfg, task.rank, task.rendezvous, load_or_create_secret(task.run_dir))
                if service == "teacher" else None)
    return serve(task.run_dir, cfg.scorers, service, task.rank, task.stop_requested, follower=follower)


def cli(argv: list[str] | None = None) -> int:
    from pipeline.run_dir import load_run_config
    from pipeline.supervise import die_with_parent

    ap = argparse.ArgumentParser(prog="python -m pipeline.scorers.role")
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--service", choices=sorted(ROLE_OF), required=True)
    ap.add_argument("--rank", type=int, default=0)
    args = ap.parse_args(argv)
    die_with_parent()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args.service} %(levelname)s %(message)s")
    cfg = load_run_config(args.run_dir)
    follower = None
    if args.service == "teacher" and cfg.scorers.teacher == "lagged":  # only it joins the run's weight group
        from pipeline.launch.rendezvous import Rendezvous, running_attempt

        follower = weight_follower(cfg, args.rank, Rendezvous(args.run_dir, running_attempt(args.run_dir, 300.0)),
                                   load_or_create_secret(args.run_dir))
    serve(args.run_dir, cfg.scorers, args.service, args.rank, follower=follower)
    return 0


if __name__ == "__main__":
    raise SystemExit(cli())
