"""Every benchmark runs end to end in its smoke mode and reports what its full mode reports.

Each ``bench/*.py --smoke`` runs its real harness (real processes, sockets, engines, files) at its
smallest sizes; a smoke mode only chooses sizes, so its JSON report (the last line of stdout) has
the keys of the full mode's, pinned here (`REPORT_KEYS`): a benchmark whose harness broke, or whose
report lost or renamed a field, fails here. Adding a field to a report: add it here too. The
figures themselves mean nothing at these sizes and are only checked to be well-formed (finite,
positive where they count something); no timing is asserted. Each benchmark checks for processes
it left behind (`bench/leftovers.py`) and exits 1 if it finds one; at the module's end nothing new
may be left in the temp directory (but `TEMP_CACHES`).

The selected ones run `CONCURRENT` at a time (a smoke run is mostly start-ups: one process
importing vLLM or megatron-core after another; three at once keep both cores busy while one
waits), longest first, each under a process marker of its own: started by the module's first test,
each test waits for its own. Shared harnesses (`HARNESSES`) run several in one process tree:
generator, episodes, weight_sync's stall part and routing_mismatch in one process that imports
vLLM once (`bench/shared_engine.py`, `ONE_PROCESS`: two engine starts, one for the tiny dense
model, one for routing_mismatch's tiny MoE), trainer, dp_balance, pipeline_parallel, scorers and
weight_sync's other parts on one import of torch, megatron-core and transformers
(`bench/shared_zygote.py`, `ONE_IMPORT`). The module is CPU-bound on two cores, nearly all of its
CPU start-ups' imports (vLLM twice per engine start: in the driver and in the EngineCore vLLM's CPU
platform spawns; megatron-core per trainer); async_vs_sync alone is two whole `tokenflow train`
runs. Its times and CPU are in bench/results/ (2026-12-07-smoke.md).
The weight_sync bandwidth part at quick sizes is checked in detail (every mode moved every byte)
in `tests/weights/test_weight_sync_bench.py`, not here: this module runs the smoke modes only.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"

INGEST_FILESYSTEM_KEYS = {
    "fstype", "dir", "tokens", "groups", "orchestrator_cpu_s_per_1M_tokens", "raw_zmq_cpu_s_per_1M_tokens",
    "raw_h5py_cpu_s_per_1M_tokens", "log_floor_cpu_s_per_1M_tokens", "efficiency_vs_slower_baseline",
    "orchestrator_wall_tokens_per_s",
    "ack_flush_ms_median", "ack_flush_ms_p99", "seal_s", "seal_mb", "rounds", "groups_per_flush",
    "efficiency_per_round", "groups_per_message"}
"""bench/ingest.py: the figures of one filesystem (`measure`, plus its type)."""

SCORER_ROLE_KEYS = {"samples", "errors", "remote_samples_per_s", "in_process_samples_per_s", "ratio"}

REPORT_KEYS = {
    "ingest": {"benchmark", "mode", "quick", "local", "netfs_measured", "target_cpu_s_per_1M_tokens",
               "target_efficiency", "meets_targets", "digest_cpu_s_per_1M_tokens"},
    "scorers": {"benchmark", "groups", "group_size", "completion_tokens", "roles"},
    "generator": {"bench", "model", "groups", "group_size", "max_tokens", "rounds", "enforce_eager",
                  "engine_start_s", "vllm_tok_s", "driver_tok_s", "ratio", "target"},
    "episodes": {"bench", "groups", "group_size", "max_turns", "max_tokens", "rounds", "mean_model_turns",
                 "env_token_share", "episode_tok_s", "single_tok_s", "episode_model_tok_s", "ratio"},
    "routing_mismatch": {
        "samples", "completion_tokens", "mismatch_own_routing", "mismatch_replayed_routing",
        "mismatch_ratio_replayed_over_own", "trainer_routing_differ_frac_own",
        "trainer_routing_differ_token_frac_own", "trainer_routing_differ_frac_replayed",
        "trainer_routing_differ_token_frac_replayed", "hf_fp32_routed_differently_fraction",
        "routing_bytes_per_prompt_token", "routing_bytes_per_completion_token", "mask_bytes_per_token_width_64"},
    "weight_sync": {"bench", "quick", "model", "bucket_bytes", "bandwidth", "bandwidth_target", "bandwidth_met",
                    "stall", "stall_target", "stall_met", "engine_gap_met", "layouts", "lora",
                    "machine_load_1min", "wall_s"},
    "async_vs_sync": {"bench", "quick", "steps", "workload", "T_sync_s", "T_async_s", "T_sync_process_s",
                      "T_async_process_s", "S", "S_process", "S_per_token", "sum_T_gen_s", "sum_T_train_s",
                      "fill_s", "B", "S_over_B", "target", "met", "trainer_idle_frac_sync",
                      "trainer_idle_frac_async", "shared_prompt_frac", "machine_load_1min", "runs"},
    "recovery": {"bench", "mode", "generators", "two_over_one"},
    "trainer": {"bench", "mode", "throughput", "packing", "memory", "targets", "met"},
    "dp_balance": {"bench", "mode", "dp", "lengths", "cost_model", "fitted_cost", "splits", "token_over_cost_step_time",
                   "flops_over_cost_step_time", "rank_time_error"},
    "pipeline_parallel": {"bench", "mode", "steps", "samples", "completion_tokens", "layouts", "machine_load_1min", "wall_s"},
}
"""Top-level keys of each benchmark's report, in every mode."""


CONCURRENT = 3
"""Smoke runs at once (the CI machine has two cores; the third fills a core while a run waits)."""

LONGEST_FIRST = ("async_vs_sync", "episodes", "generator", "routing_mismatch", "weight_sync", "trainer", "dp_balance",
                 "pipeline_parallel", "scorers", "recovery", "ingest")
"""The order they start in: the longest first, so that the lanes end together (a shared harness
starts at its first benchmark's place): the two `tokenflow train` runs, the shared engine's lane
(two engines one after the other, ~1 core), the shared zygote's; then recovery and ingest."""


CHAINS = {"shared_engine"}
"""Runs that are a chain of one busy process at a time (the shared engine's: its driver's imports,
then each engine's own process, then its benchmarks, one engine after the other): they run at the
default priority, every other run at `NICE`, so that a chain keeps one core to itself and ends with
the others (at equal priority the shared engine's lane got a third of the machine and ended last,
~100 s, when the rest had ended by ~85 s)."""
NICE = 5
"""The priority increment of the runs that are not chains."""


SHARED = {"leftovers", "weight_stall", "shared_engine", "shared_zygote", "ingest_baselines"}
"""bench/ modules that are no benchmark: the leftover-process check, weight_sync's stall part, the
harnesses that run several benchmarks on one engine start or one import, ingest's baselines."""

ONE_PROCESS = {"episodes": "episodes", "generator": "generator", "weight_sync": "weight_stall",
               "routing_mismatch": "routing_mismatch"}
"""Smoke benchmarks, or the engine part of one, run in one process on as few engine starts as their
settings allow (``bench/shared_engine.py --smoke episodes generator weight_stall routing_mismatch``:
the first three on one engine, routing_mismatch's tiny MoE on a second; one vLLM import on the
driver's side instead of three, ~9 CPU s each); weight_sync's stall part (`bench/weight_stall.py`)
runs there, its other parts in the shared zygote (`PARTS`)."""

ONE_IMPORT = {"trainer": "trainer", "dp_balance": "dp_balance", "pipeline_parallel": "pipeline_parallel",
              "weight_sync": "weight_sync", "scorers": "scorers"}
"""Smoke benchmarks, or a part of one, run on one import of torch, megatron-core and transformers
(``bench/shared_zygote.py --smoke trainer dp_balance pipeline_parallel weight_sync scorers``: their
processes forked from one zygote, ~5 CPU s each less)."""

HARNESSES = {"shared_engine": ONE_PROCESS, "shared_zygote": ONE_IMPORT}
"""bench/ script -> the benchmarks it runs together (name -> its name there) when more than one of
them is selected; the others run their own script."""

PARTS = {"weight_sync": {"shared_engine": ("stall",), "shared_zygote": ("bandwidth", "layouts", "lora")}}
"""A benchmark split across harnesses: the parts each runs. Parts whose harness does not run (fewer
than two of its benchmarks selected) run in the benchmark's own script (``--part ...``); the test
checks the reports of its runs as one."""


def test_every_benchmark_has_a_smoke_test():
    benches = {p.stem for p in BENCH.glob("*.py")} - SHARED
    assert benches == set(REPORT_KEYS) == set(LONGEST_FIRST)


def _run_smoke(script: str, env: dict, *extra: str) -> subprocess.CompletedProcess:
    t0 = time.monotonic()
    from pipeline.supervise import die_with_parent

    def start() -> None:
        die_with_parent()  # a killed pytest ends its smoke runs; each benchmark ends its own children
        if script not in CHAINS:
            os.nice(NICE)

    proc = subprocess.run([sys.executable, str(BENCH / f"{script}.py"), "--smoke", *extra], capture_output=True,
                          text=True, timeout=600, env=env, preexec_fn=start)
    print(f"bench/{script}.py --smoke {' '.join(extra)}: {time.monotonic() - t0:.1f} s", flush=True)  # shown with -s
    return proc


def _selected(request) -> list[str]:
    """The benchmarks whose smoke tests this session runs (selected and not skipped), longest first."""
    tests = {item.name for item in request.session.items
             if item.module is request.module and not item.get_closest_marker("skip")}
    return [name for name in LONGEST_FIRST if f"test_{name}_smoke" in tests]


TEMP_CACHES = ("torchinductor_",)
"""Entries of the temp directory a smoke run may add: caches meant to stay (torch inductor's)."""


@pytest.fixture(scope="module")
def smoke_runs(request, tmp_path_factory):
    """name -> [(the future of a smoke run, the name of its report in that run's or None: the whole)],
    one or two runs (its own, a shared harness's); every run has ended at the module's end, and
    left no process and nothing in the temp directory but `TEMP_CACHES`."""
    from pipeline.supervise import MARKER_ENV
    from support.leftovers import leftovers

    temp_before = set(os.listdir(tempfile.gettempdir()))
    selected = _selected(request)
    used = {script: [name for name in members if name in selected] for script, members in HARNESSES.items()}
    used = {script: names for script, names in used.items() if len(names) > 1}
    jobs: dict[str, tuple[str, ...]] = {}  # run -> script and arguments, longest first
    runs: dict[str, list] = {name: [] for name in selected}  # name -> [(run, its report's name there or None)]
    for name in selected:
        scripts = [script for script, names in used.items() if name in names]
        for script in scripts:
            jobs.setdefault(script, (script, *(HARNESSES[script][n] for n in used[script])))
            runs[name].append((script, HARNESSES[script][name]))
        rest = [part for script, parts in PARTS.get(name, {}).items() if script not in scripts for part in parts]
        if not scripts or rest:
            jobs[name] = (name, "--part", *rest) if scripts else (name,)
            runs[name].append((name, None))
    if "ingest" in jobs:
        jobs["ingest"] += ("--local", str(tmp_path_factory.mktemp("ingest")))
    markers = {name: uuid.uuid4().hex for name in jobs}
    pool = ThreadPoolExecutor(CONCURRENT)
    futures = {name: pool.submit(_run_smoke, job[0], {**os.environ, MARKER_ENV: markers[name]}, *job[1:])
               for name, job in jobs.items()}
    runs = {name: [(futures[job], part) for job, part in parts] for name, parts in runs.items()}
    yield runs
    pool.shutdown(wait=True)
    left = {pid: cmd for marker in markers.values() for pid, cmd in leftovers(marker, wait_s=5.0).items()}
    assert not left, f"smoke benchmarks left processes behind (killed now): {left}"
    litter = sorted(name for name in set(os.listdir(tempfile.gettempdir())) - temp_before
                    if not name.startswith(TEMP_CACHES))
    assert not litter, f"smoke benchmarks left these in {tempfile.gettempdir()}: {litter}"


def _smoke(smoke_runs, name: str) -> dict:
    report: dict = {}
    for future, part in smoke_runs[name]:
        proc = future.result()
        assert proc.returncode == 0, \
            f"{name} --smoke exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        last = json.loads(proc.stdout.strip().splitlines()[-1])
        report.update(last[part] if part else last)
    assert set(report) - {"netfs"} == REPORT_KEYS[name], set(report) ^ REPORT_KEYS[name]
    return report


def _finite(*values) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)


def test_ingest_smoke(smoke_runs):
    """Also the old failure of ``--quick``: its raw ZeroMQ sender, a second copy of the script,
    checked for leftover processes itself, found its sibling receiver and was killed (or killed it)."""
    report = _smoke(smoke_runs, "ingest")
    assert report["mode"] == "smoke"
    for where in ("local", "netfs") if report["netfs_measured"] else ("local",):
        figures = report[where]
        assert set(figures) == INGEST_FILESYSTEM_KEYS, where
        assert figures["groups"] > 0 and figures["tokens"] > 0
        assert _finite(figures["orchestrator_cpu_s_per_1M_tokens"], figures["raw_zmq_cpu_s_per_1M_tokens"],
                       figures["raw_h5py_cpu_s_per_1M_tokens"], figures["ack_flush_ms_p99"])


def test_scorers_smoke(smoke_runs):
    report = _smoke(smoke_runs, "scorers")
    assert set(report["roles"]) == {"reward_model", "process_reward"}
    for role, figures in report["roles"].items():
        assert set(figures) == SCORER_ROLE_KEYS and figures["errors"] == 0, role
        assert figures["samples"] == report["groups"] * report["group_size"]
        assert figures["remote_samples_per_s"] > 0 and figures["in_process_samples_per_s"] > 0, role


def test_trainer_smoke(smoke_runs):
    report = _smoke(smoke_runs, "trainer")
    assert set(report["memory"]["peak_bytes"]) == {"100", "200", "400", "800"}
    assert all(v > 0 for v in report["memory"]["peak_bytes"].values())
    assert 0 < report["packing"]["padding_waste"] < 1 and _finite(report["throughput"]["ratio"])


def test_generator_smoke(smoke_runs):
    report = _smoke(smoke_runs, "generator")
    assert report["vllm_tok_s"] > 0 and report["driver_tok_s"] > 0 and _finite(report["ratio"])
    assert report["engine_start_s"] > 0


def test_episodes_smoke(smoke_runs):
    report = _smoke(smoke_runs, "episodes")
    assert report["episode_tok_s"] > 0 and report["single_tok_s"] > 0 and 0 <= report["env_token_share"] < 1
    assert report["mean_model_turns"] >= 1 and _finite(report["ratio"])


def test_routing_mismatch_smoke(smoke_runs):
    report = _smoke(smoke_runs, "routing_mismatch")
    assert report["samples"] == 4 and report["completion_tokens"] > 0
    assert _finite(report["mismatch_own_routing"], report["mismatch_replayed_routing"])
    assert report["routing_bytes_per_completion_token"] > 0


def test_weight_sync_smoke(smoke_runs):
    """Its stall part on the shared engine (`ONE_PROCESS`: a gloo sender beside it), the rest in the
    shared zygote (`ONE_IMPORT`: a gloo sender and megatron-core or gloo processes forked from the
    zygote); the two reports checked as one."""
    report = _smoke(smoke_runs, "weight_sync")
    assert set(report["bandwidth"]["sets"]) == {"tiny-dense", "tiny-moe", "big"}
    assert set(report["layouts"]) >= {"tp1", "tp2xep2"} and set(report["lora"]) >= {"full", "adapters"}
    assert report["lora"]["adapters"]["bytes"] < report["lora"]["full"]["bytes"]
    default = report["stall"][report["stall"]["default"]]
    assert default["updates"] >= 1 and _finite(default["stall_decode_steps"])


def test_async_vs_sync_smoke(smoke_runs):
    """Two `tokenflow train` runs of one step at once (each a launcher, a trainer, an orchestrator and a
    vLLM engine's two processes; 38 s alone on a 2-core machine, 71 CPU s, most of it their imports)."""
    report = _smoke(smoke_runs, "async_vs_sync")
    assert report["steps"] == 1 and set(report["runs"]) == {"sync", "async"}
    assert all(r["steps"] == 1 for r in report["runs"].values())
    assert _finite(report["S"], report["B"]) and report["T_sync_s"] > 0 and report["T_async_s"] > 0


def test_recovery_smoke(smoke_runs):
    """28 s alone on a 2-core machine (29 CPU s): a one-generator run, trained until its orchestrator
    is killed at step 3 and trains again. Also the old failure of the script itself: it put tests/support/ first on its path, so its
    ``leftovers`` was the tests' module (no ``no_process_left``) and it exited 1 at once."""
    report = _smoke(smoke_runs, "recovery")
    pauses = report["generators"]["1"]
    assert report["mode"] == "smoke" and _finite(pauses["orchestrator"]) and pauses["orchestrator"] > 0


def test_dp_balance_smoke(smoke_runs):
    report = _smoke(smoke_runs, "dp_balance")
    assert [c["tokens"] for c in report["cost_model"]] == sorted(c["tokens"] for c in report["cost_model"])
    assert all(c["seconds"] > 0 and _finite(c["cost_ratio"]) for c in report["cost_model"])
    for split in report["splits"].values():
        assert 0 < len(split["rank_seconds"]) <= report["dp"] and split["max_s"] == max(split["rank_seconds"])
    assert _finite(report["token_over_cost_step_time"]) and set(report["splits"]) == {"tokens", "flops", "fitted"}
    assert all(v >= 0 for k, v in report["fitted_cost"].items() if k != "fixed_s")


def test_pipeline_parallel_smoke(smoke_runs):
    report = _smoke(smoke_runs, "pipeline_parallel")
    assert set(report["layouts"]) == {"tp1", "pp2"}
    pp2 = report["layouts"]["pp2"]
    assert pp2["step_s"] > 0 and set(pp2["bubble_measured"]) == {"0", "1"}
    assert all(0 <= b < 1 for b in pp2["bubble_measured"].values())
