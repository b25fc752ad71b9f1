"""Pipeline and context parallelism: a training step's time on PP and CP layouts against one rank,
and the measured pipeline bubble.

Each layout trains the same synthetic batches (random tokens, fixed lengths, behaviour logprobs
-5) on a 4-layer, 8-expert tiny MoE (random weights, fp32) in fresh gloo rank processes (real
megatron-core `Trainer`s, forked from one zygote that imported them once, `support.zygote`): one
rank (the reference), then PP2 and CP2 (2 ranks), PP2 x TP2, PP2 x EP2 and CP2 x EP2 (4 ranks), in
one run, side by side. Reported per layout: the median
``step_time_s`` of the steps after the first, ``speedup`` = one rank's median / the layout's
(ranks share the machine's cores, so on 2 cores a 4-rank layout cannot be faster: this measures
the pipeline's overhead, not its scaling), micro-batches per pipeline ``m``, and the bubble: each
rank times megatron's ``forward_step`` and ``backward_step`` inside the 1F1B schedule (compute)
and the schedule call (wall); ``bubble_measured`` = 1 - compute / wall per stage (the stage's
ranks' mean; the idle time and the point-to-point transfers), next to 1F1B's ideal
``bubble_ideal`` = (pp - 1) / (m + pp - 1) for equal stages.

    python bench/pipeline_parallel.py [--quick | --smoke]     # last line: one JSON object

--smoke: one rank and PP2, 2 steps of 4 samples (harness check); --quick: all six layouts, 4
steps of 16 samples; default: 8 steps of 32 samples. Under CP each 47-token sequence is padded to
48 and split into 4 chunks of 12 over the 2 ranks of its group.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # the package, the tests' helpers (support.zygote)

LAYOUTS = {"tp1": (1, {}), "pp2": (2, {"pp": 2}), "pp2tp2": (4, {"pp": 2, "tp": 2}),
           "pp2ep2": (4, {"pp": 2, "ep": 2}), "cp2": (2, {"cp": 2}), "cp2ep2": (4, {"cp": 2, "ep": 2})}


def bench_model() -> Path:
    """The 4-layer, 8-expert tiny MoE, built once and cached beside the tiny models (keyed by its spec)."""
    from pipeline.models.tiny import TinyModelSpec, ensure_tiny_model

    spec = TinyModelSpec(kind="moe", hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32,
                         intermediate_size=256, moe_intermediate_size=64, num_experts=8,
                         experts_per_token=2, vocab_size=512, num_layers=4)
    return ensure_tiny_model("moe", spec=spec)


def rank_main(args: dict) -> None:
    """One trainer rank: train ``steps`` steps, time the schedule's compute and wall."""
    import numpy as np
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import schedules

    from pipeline.trainer.config import ParallelConfig, TrainerConfig
    from pipeline.trainer.engine import Trainer
    from pipeline.trainer.layout import TrainSample

    torch.set_num_threads(1)
    trainer = Trainer(TrainerConfig(model_dir=args["model"], parallel=ParallelConfig(**args["parallel"]),
                                    lr=1e-5, micro_batch_tokens=args["micro_batch_tokens"]))
    timed = {"compute": 0.0, "wall": 0.0}

    def timing(fn, key):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                timed[key] += time.perf_counter() - t0
        return wrapper

    schedules.forward_step = timing(schedules.forward_step, "compute")
    schedules.backward_step = timing(schedules.backward_step, "compute")
    schedules.forward_backward_pipelining_without_interleaving = timing(
        schedules.forward_backward_pipelining_without_interleaving, "wall")
    rng = np.random.default_rng(0)
    steps, compute, wall = [], [], []
    for step in range(args["steps"]):
        samples = [TrainSample(rng.integers(3, 512, 16), rng.integers(3, 512, args["length"]),
                               np.full(args["length"], -5.0), reward=float(i % 2), group_id=i // 4)
                   for i in range(args["samples"])]
        mine = samples[ps.get_data_parallel_rank()::ps.get_data_parallel_world_size()]
        timed.update(compute=0.0, wall=0.0)
        metrics = trainer.train_step(mine)
        steps.append(metrics["step_time_s"])
        compute.append(timed["compute"])
        wall.append(timed["wall"])
    m = len(trainer.layout.micro_batches(mine))  # equal lengths: the same on every rank
    out = {"rank": torch.distributed.get_rank(), "stage": ps.get_pipeline_model_parallel_rank(),
           "step_s": steps, "compute_s": compute, "wall_s": wall, "micro_batches": m}
    Path(args["out"]).write_text(json.dumps(out))
    trainer.close()


def run_layout(name: str, model: Path, workdir: Path, steps: int, samples: int, length: int, zygote) -> dict:
    """One layout's ranks, forked from ``zygote`` (`support.zygote`: torch and megatron-core imported once)."""
    import numpy as np

    from pipeline.launch.rendezvous import free_port

    world, parallel = LAYOUTS[name]
    port = free_port("127.0.0.1")
    pids = []
    try:
        for rank in range(world):
            args = {"model": str(model), "parallel": parallel, "steps": steps, "samples": samples, "length": length,
                    "micro_batch_tokens": 4 * (16 + length), "out": str(workdir / f"{name}-{rank}.json")}
            env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world)}
            pids.append(zygote.start("bench.pipeline_parallel:rank_main", {"args": args},
                                     workdir / f"{name}-{rank}.log", env))
        status = zygote.wait(pids, timeout_s=900)
    finally:
        zygote.kill_left(pids)
    failed = [r for r, pid in enumerate(pids) if status[pid] != 0]
    if failed:
        raise RuntimeError(f"{name}: ranks {failed} failed:\n" + (workdir / f"{name}-{failed[0]}.log").read_text()[-3000:])
    ranks = [json.loads((workdir / f"{name}-{r}.json").read_text()) for r in range(world)]
    pp = parallel.get("pp", 1)
    m = ranks[0]["micro_batches"]
    result = {"ranks": world, "step_s": float(np.median(ranks[0]["step_s"][1:])), "micro_batches": m}
    if pp > 1:
        stages = {}
        for r in ranks:
            c, w = np.sum(r["compute_s"][1:]), np.sum(r["wall_s"][1:])
            stages.setdefault(r["stage"], []).append(1.0 - c / w)
        result["bubble_measured"] = {str(s): round(float(np.mean(v)), 4) for s, v in sorted(stages.items())}
        result["bubble_ideal"] = round((pp - 1) / (m + pp - 1), 4)
    return result


def main(argv: list[str] | None = None, zygote=None) -> dict:
    """The benchmark; its report. ``zygote``: the `support.zygote.Zygote` to fork its ranks from
    (preloading `TRAINER_PRELOAD` and this module; None: one of its own)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args(argv)
    mode = "smoke" if a.smoke else "quick" if a.quick else "full"
    steps, samples, length = {"smoke": (2, 4, 8), "quick": (4, 16, 32), "full": (8, 32, 64)}[mode]
    names = ["tp1", "pp2"] if a.smoke else list(LAYOUTS)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tf-bench-pp-") as tmp, ExitStack() as own:
        if zygote is None:
            from support.zygote import TRAINER_ENV, TRAINER_PRELOAD, Zygote

            zygote = own.enter_context(Zygote([*TRAINER_PRELOAD, "bench.pipeline_parallel"], Path(tmp) / "zygote.log",
                                              TRAINER_ENV))
        model = bench_model()
        layouts = {n: run_layout(n, model, Path(tmp), steps, samples, length, zygote) for n in names}
    base = layouts["tp1"]["step_s"]
    for name, r in layouts.items():
        r["speedup"] = round(base / r["step_s"], 3)
        bubble = f"bubble {r['bubble_measured']} (1F1B ideal {r['bubble_ideal']})" if "bubble_ideal" in r else ""
        print(f"{name:7s} {r['ranks']} rank(s): step {r['step_s'] * 1e3:7.1f} ms, {r['speedup']:.2f}x one rank, "
              f"m={r['micro_batches']} {bubble}")
    return {"bench": "pipeline_parallel", "mode": mode, "steps": steps, "samples": samples, "completion_tokens": length,
            "layouts": layouts, "machine_load_1min": os.getloadavg()[0], "wall_s": round(time.monotonic() - t0, 1)}


if __name__ == "__main__":
    from leftovers import no_process_left

    with no_process_left():
        report = main()
    print(json.dumps(report))
