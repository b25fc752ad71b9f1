"""Ingest benchmark: orchestrator CPU per 1M tokens against raw ZeroMQ receive and raw h5py appends,
with the run directory on a local disk and on a network filesystem.

Producer processes send groups of 1K-token samples (ids, logprobs, versions) over real ZeroMQ
sockets into a real orchestrator, which authenticates, validates, scores, logs (a journal entry
``fdatasync``'d before each acknowledgement, sealed into HDF5 segments) and buffers them. Measured
side by side in one run, on the same bytes, for each filesystem:

- ``orchestrator``: the orchestrator process's own CPU time from its first metrics record that
  saw a stored group (getrusage, in the record) to its exit (``os.wait4``), over the tokens it
  ingested in between: the window ends after its close seals the journal into an HDF5 segment, so
  writing every byte a second time (sealed, digested) is in it, as it is in a long run's (the
  rounds are smaller than the default ``log_seal_bytes``, and an earlier window that ended at the
  last record before the stop left every seal out). The orchestrator runs its defaults but for
  admission (no bound, no trainer consumes) and the metrics interval: its buffer holds
  ``memory_token_budget`` (4M tokens, ~470 groups) in memory and keeps the rest as log rows, as a
  run's does (an earlier window held every group in memory, a state no run reaches, and paid the
  page faults of an ever-growing heap);
- ``(a) zmq``: CPU time of a process that only receives the same multipart messages: `Result`s
  of ``groups_per_message`` groups each (the orchestrator's measured groups per message, from its
  ``count_result_groups`` / ``count_result_messages`` metrics: generators send the groups finished
  together in one message, `pipeline.protocol.links`);
- ``(b) h5py``: CPU time of resizable-dataset appends of the same arrays (those messages' columns)
  into a file on that filesystem, durable at the orchestrator's own cadence: after every ``groups_per_flush`` groups
  (the orchestrator's measured groups per journal flush, from its ``log_flush_seq`` metric) an
  HDF5 flush and an ``fdatasync`` of the file. That is the honest raw baseline: the cheapest way to
  give each acknowledged group the durability the orchestrator gives it (a raw writer that never
  syncs does less work, one that syncs per group does more). The raw writer writes each byte once;
  the orchestrator journals it and later seals it, and that difference is part of its cost;
- ``log floor`` (reported, not a baseline): CPU time of the per-byte work every orchestrator of
  this design does beyond the receive, with none of its per-group bookkeeping (`run_log_floor`):
  the same messages authenticated and decoded, their token values checked, their frames journaled
  at the same sync cadence, then sealed once as a seal writes them, with digests. The orchestrator
  less this and the raw receive is what its own per-group work costs; (slower baseline) / (raw
  receive + floor) is the efficiency an orchestrator with no per-group cost would reach;
- ``ack latency``: wall time of the log writer's durable flush of one 8-sample group (what an
  acknowledgement waits for), median and p99, and the time of one seal.

The machine is shared, so its load moves every figure several-fold between runs. The three are
therefore measured in ``rounds`` (3; 1 in ``--smoke``), each round running all three back to
back in a rotated order; every figure reported is the median over the rounds, and the efficiency
is the median of the per-round ratios (a round's three measurements saw about the same load).

Targets (local disk): <= 1 s orchestrator CPU per 1M tokens; efficiency = CPU(slower baseline) /
CPU(orchestrator) >= 0.5. The network filesystem (``--netfs DIR``, default the first mount of
``scripts/netfs.sh``) is reported, not held to targets. The last line printed is one JSON object,
with the same keys in every mode (`MODES`: full, ``--quick``, ``--smoke``); each filesystem's
figures are the keys `measure` returns.

The raw baselines and the floor are in `bench/ingest_baselines.py`; its raw ZeroMQ receiver and
sender are that script run as processes of their own. They are parts of the benchmark, so only the
benchmark's own process checks for leftover processes (`bench/leftovers.py`). A helper that checked
too would find its sibling still running, wait for it while the sibling waited for it, and after 15
s kill it (the sender exited 1 or was SIGKILLed).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ingest_baselines import (COMPLETION, GROUP, cpu_s, group_columns, run_log_floor,  # noqa: E402
                              run_raw_h5py, run_raw_zmq)  # bench/ is this script's directory
from pipeline.metrics import read_metrics  # noqa: E402
from pipeline.run_files import ORCHESTRATOR_RENDEZVOUS  # noqa: E402

MODES = {"full": {"groups": 2400, "ack_flushes": 500, "rounds": 3},
         "quick": {"groups": 1000, "ack_flushes": 100, "rounds": 3},
         "smoke": {"groups": 40, "ack_flushes": 10, "rounds": 1}}
"""Groups ingested per filesystem and round (of 8 x 1K tokens: ~20M, ~8.7M, ~0.3M tokens), durable
flushes timed, and rounds of the three side-by-side measurements, per mode. The orchestrator
ingests ~4M tokens a second here: a quick round of 200 groups was ~0.4 s, two metrics records,
and its efficiency swung 0.21-0.54 between rounds; 1000 groups make each round's window ~2 s."""


def run_orchestrator(groups: int, producers: int, root: Path) -> dict:
    run = Path(tempfile.mkdtemp(prefix="tf-ingest-", dir=root))
    from pipeline.config import RunConfig, TokenflowConfig
    from pipeline.orchestrator.config import OrchestratorConfig
    from pipeline.run_dir import save_run_config
    from pipeline.tasks import TaskConfig
    save_run_config(run, TokenflowConfig(
        run=RunConfig(name="bench", dir=str(run)), task=TaskConfig(name="synthetic"),
        orchestrator=OrchestratorConfig(group_size=GROUP, groups_per_step=1, max_async=10**6,
                                        metrics_interval_s=0.2)))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(run / "orchestrator.out", "w") as out:  # its log, named in a failure
        orch = subprocess.Popen([sys.executable, "-m", "pipeline.apps.orchestrator", str(run)],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 120
    while not (run / ORCHESTRATOR_RENDEZVOUS).exists():
        if orch.poll() is not None or time.monotonic() > deadline:
            orch.kill()
            raise RuntimeError(f"the orchestrator did not start in 120 s (exit status {orch.wait()}; "
                               f"its log: {run}/orchestrator.out)")
        time.sleep(0.05)
    # a trainer that reports version 0 opens admission; it takes no batches
    from pipeline.protocol.links import TrainerLink
    from pipeline.protocol.record import RecordSchema
    trainer = TrainerLink(run, RecordSchema())
    trainer.report_version(0)
    t0 = time.monotonic()
    loadgen = Path(__file__).resolve().parents[1] / "tests" / "support" / "loadgen.py"
    gens = [subprocess.Popen([sys.executable, str(loadgen), "generator", str(run),
                              f"--id={i}", "--slots=8", f"--min-len={COMPLETION}",
                              f"--max-len={COMPLETION}", "--duration=600"],
                             stdout=subprocess.PIPE, text=True, env=env) for i in range(producers)]
    while True:
        m = list(read_metrics(run, "orchestrator"))
        if m and m[-1].get("count_stored", 0) >= groups:
            break
        if time.monotonic() - t0 > 300 or orch.poll() is not None:
            for p in (*gens, orch):
                p.kill()
            raise RuntimeError(f"ingest did not finish in 300 s (orchestrator exit status {orch.wait()}; "
                               f"its log: {run}/orchestrator.out)")
        time.sleep(0.2)
    wall = time.monotonic() - t0
    for g in gens:
        g.terminate()
    for g in gens:
        g.wait(30)
    orch.terminate()
    cpu_at_exit = _exit_cpu(orch, 60)
    trainer.close()
    # CPU per token from the first record that saw ingest (excludes start-up, which does not scale
    # with tokens) to the exit (includes the close's seal of everything ingested: docstring); the
    # close writes a last record with every ingested token
    m = [r for r in read_metrics(run, "orchestrator") if r.get("count_stored", 0) > 0]
    stored = m[-1]["count_stored"] - m[0]["count_stored"]
    flushes = m[-1]["log_flush_seq"] - m[0]["log_flush_seq"]
    tokens = m[-1]["ingested_tokens"] - m[0]["ingested_tokens"]
    shutil.rmtree(run, ignore_errors=True)
    if not tokens:
        raise RuntimeError(f"all {groups} groups were stored within one metrics interval: ingest more")
    return {"cpu_s": cpu_at_exit - m[0]["cpu_s"], "tokens": tokens, "wall_s": wall,
            "groups": stored, "groups_per_flush": max(1, round(stored / max(1, flushes))),
            "groups_per_message": (m[-1].get("count_result_groups", 0) - m[0].get("count_result_groups", 0))
            / max(1, m[-1].get("count_result_messages", 0) - m[0].get("count_result_messages", 0))}


def _exit_cpu(proc: subprocess.Popen, timeout_s: float) -> float:
    """CPU seconds (user + system, all threads) of ``proc`` over its life, once it has exited
    (killed, and an error, after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return ru.ru_utime + ru.ru_stime
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"the orchestrator did not exit within {timeout_s} s of SIGTERM")
        time.sleep(0.02)


def run_ack_latency(n_flushes: int, root: Path) -> dict:
    """Durable flush of one group (8 x 1K-token samples + its group row), as the orchestrator
    does before acknowledging; then one seal of everything flushed."""
    from pipeline.protocol.record import RecordSchema
    from pipeline.protocol.sample_batch import SampleBatch
    from pipeline.rollout_log.writer import RolloutLogWriter
    group = SampleBatch(group_columns(1), RecordSchema(), validate=True)
    log_dir = Path(tempfile.mkdtemp(prefix="tf-acklat-", dir=root))
    lat = []
    with RolloutLogWriter(log_dir, RecordSchema(), "bench", {}, seal_interval_s=3600) as w:
        for i in range(n_flushes):
            rows = w.append_samples(group)
            w.append_groups(i, 0, 0, rows[0], GROUP, 0, 0.0)
            t = time.perf_counter()
            w.flush()
            lat.append(time.perf_counter() - t)
        t = time.perf_counter()
        w.seal()
        seal_s = time.perf_counter() - t
    shutil.rmtree(log_dir, ignore_errors=True)
    ms = np.array(lat) * 1e3
    return {"ack_flush_ms_median": round(float(np.median(ms)), 3),
            "ack_flush_ms_p99": round(float(np.percentile(ms, 99)), 3),
            "seal_s": round(seal_s, 3), "seal_mb": round(n_flushes * GROUP * COMPLETION * 12 / 1e6, 1)}


def measure(root: Path, groups: int, producers: int, ack_flushes: int, rounds: int) -> dict:
    """The three measurements ``rounds`` times, side by side (module docstring): medians."""
    per_round = []
    for r in range(rounds):
        orch = run_orchestrator(groups, producers, root)
        n, gpf = orch["groups"], orch["groups_per_flush"]
        gpm = max(1, round(orch["groups_per_message"]))  # the raw baselines' messages: as many groups
        raws = [lambda: run_raw_zmq(n, gpm), lambda: run_raw_h5py(n, gpf, root, gpm)]
        zmq_raw, h5_raw = (f() for f in (raws if r % 2 == 0 else raws[::-1]))  # rotated order
        floor = run_log_floor(n, gpf, root, gpm)
        mtok = orch["tokens"] / 1e6
        per_round.append({"orch": orch["cpu_s"] / mtok, "zmq": zmq_raw["cpu_s"] / mtok,
                          "h5py": h5_raw["cpu_s"] / mtok, "floor": floor["cpu_s"] / mtok,
                          "tokens": orch["tokens"], "groups": n,
                          "groups_per_flush": gpf, "groups_per_message": orch["groups_per_message"],
                          "wall_tokens_per_s": orch["tokens"] / orch["wall_s"]})
        per_round[-1]["efficiency"] = max(per_round[-1]["zmq"], per_round[-1]["h5py"]) / per_round[-1]["orch"]

    def med(k: str) -> float:
        return float(np.median([x[k] for x in per_round]))
    return {
        "dir": str(root), "rounds": rounds, "tokens": int(med("tokens")), "groups": int(med("groups")),
        "groups_per_flush": med("groups_per_flush"), "groups_per_message": round(med("groups_per_message"), 2),
        "orchestrator_cpu_s_per_1M_tokens": round(med("orch"), 4),
        "raw_zmq_cpu_s_per_1M_tokens": round(med("zmq"), 4),
        "raw_h5py_cpu_s_per_1M_tokens": round(med("h5py"), 4),
        "log_floor_cpu_s_per_1M_tokens": round(med("floor"), 4),
        "efficiency_vs_slower_baseline": round(med("efficiency"), 3),
        "efficiency_per_round": [round(x["efficiency"], 3) for x in per_round],
        "orchestrator_wall_tokens_per_s": round(med("wall_tokens_per_s")),
        **run_ack_latency(ack_flushes, root)}


def digest_cpu_s_per_1m_tokens() -> float:
    """CPU of the sealed segments' digests (`pipeline.rollout_log.digests`) per 1M tokens: the
    three per-token columns (ids, logprobs, versions: 12 bytes a token), part of every seal."""
    from pipeline.rollout_log.digests import block_rows, digest
    column = np.arange(1_000_000, dtype=np.int32)
    c0 = cpu_s()
    for _ in range(3):
        digest([column], block_rows(column))
    return round(cpu_s() - c0, 4)


def _default_netfs() -> str | None:
    ready = Path(os.environ.get("TOKENFLOW_NETFS", "/var/tmp/tokenflow-netfs")) / "ready"
    return ready.read_text().split()[0] if ready.is_file() else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="~8.7M tokens per filesystem and round instead of ~20M (about a minute)")
    size.add_argument("--smoke", action="store_true", help="~0.3M tokens per filesystem (seconds): the report's keys, "
                      "not its figures")
    p.add_argument("--producers", type=int, default=2)
    p.add_argument("--local", help="local-disk directory for the run (default: the temp dir)")
    p.add_argument("--netfs", help="network-filesystem directory (default: scripts/netfs.sh's mount)")
    return p.parse_args(argv)


def main(a: argparse.Namespace) -> None:
    from pipeline.rollout_log.format import filesystem_type
    mode = "smoke" if a.smoke else "quick" if a.quick else "full"
    sizes = MODES[mode]
    local = Path(a.local or tempfile.gettempdir())
    results = {"local": {"fstype": filesystem_type(local),
                         **measure(local, sizes["groups"], a.producers, sizes["ack_flushes"], sizes["rounds"])}}
    netfs = a.netfs or _default_netfs()
    if netfs:
        results["netfs"] = {"fstype": filesystem_type(Path(netfs)),
                            **measure(Path(netfs), sizes["groups"], a.producers, sizes["ack_flushes"],
                                    sizes["rounds"])}
    r = results["local"]
    ok = (r["orchestrator_cpu_s_per_1M_tokens"] <= 1.0 and r["efficiency_vs_slower_baseline"] >= 0.5)
    for where, x in results.items():
        print(f"{where} ({x['fstype']}): orchestrator {x['orchestrator_cpu_s_per_1M_tokens']:.3f} s CPU"
              f" / 1M tokens ({x['groups']} groups); raw zmq {x['raw_zmq_cpu_s_per_1M_tokens']}, raw "
              f"h5py {x['raw_h5py_cpu_s_per_1M_tokens']} (synced every {x['groups_per_flush']} groups, "
              f"{x['groups_per_message']} groups a message); "
              f"log floor {x['log_floor_cpu_s_per_1M_tokens']}; "
              f"efficiency {x['efficiency_vs_slower_baseline']} (rounds {x['efficiency_per_round']}); ack flush median {x['ack_flush_ms_median']} ms, "
              f"p99 {x['ack_flush_ms_p99']} ms; seal of {x['seal_mb']} MB {x['seal_s']} s")
    if not netfs:
        print("network filesystem: not measured (no --netfs and no scripts/netfs.sh mount)")
    print(json.dumps({"benchmark": "ingest", "mode": mode, "quick": a.quick, **results,
                      "digest_cpu_s_per_1M_tokens": digest_cpu_s_per_1m_tokens(),
                      "netfs_measured": bool(netfs), "target_cpu_s_per_1M_tokens": 1.0,
                      "target_efficiency": 0.5, "meets_targets": bool(ok)}))


if __name__ == "__main__":
    from leftovers import no_process_left  # bench/ is this script's directory

    with no_process_left():
        main(parse_args())
