"""Train-inference mismatch on the tiny MoE with and without routing replay, side by side.

A bf16 vLLM engine samples completions and records their routing (``generator.record_routing``);
the fp32 megatron-core trainer then scores the same tokens twice: routing by itself, and replaying
the engine's routing (``trainer.routing_replay``); the trainer process gets the samples once they
exist (no figure here is a time). Reported: mean |trainer - behaviour| logprob over
completion tokens for each (and their ratio); beside each, the fraction of (token, layer) pairs
and of tokens (prompt and completion positions) where the trainer's own router chooses another
expert set than the engine recorded - the ``routing_differ_frac`` / ``routing_differ_token_frac``
of the metrics stream (pipeline/trainer/routing_replay.py); as an independent cross-check of the
first, the pairs where transformers in fp32 routes differently from the engine; and the bytes per
token that routing and a sampling mask add. The model is the
tiny Qwen3-MoE with weights re-drawn at unit scale (``sharpened_checkpoint``): the 0.02-std init
is nearly uniform and would route on noise.

Run alone, or on `bench/shared_engine.py` (in this process beside other engine benchmarks, on an
engine of its own: its engine settings differ from theirs): ``parse(argv)``, ``engine_setup(args)``
(writes the checkpoint into a temporary directory that outlives the engine), ``async measure(gen,
args)``. Alone, the trainer process starts before the engine (it builds its model while the engine
starts); on the shared harness, `measure` starts it. Either way it is killed, and the directory
removed, on any failure.

    python bench/routing_mismatch.py --quick     # < 1 minute on a quiet 2-core CPU
    python bench/routing_mismatch.py --prompts 32 --group-size 4 --max-tokens 48
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]

TRAINER = """
import json, sys, numpy as np, torch
from pipeline.trainer.config import TrainerConfig
from pipeline.trainer.engine import Trainer
from pipeline.trainer.layout import TrainSample
torch.set_num_threads(1)
model_dir, out = sys.argv[1:3]
trainer = Trainer(TrainerConfig(model_dir=model_dir, routing_replay=True, micro_batch_tokens=512))
d = np.load(sys.stdin.readline().strip())  # the samples' file, once the engine has made them
n = int(d["n"])
samples = [TrainSample(d[f"p{i}"], d[f"c{i}"], d[f"lp{i}"], routed_experts=d[f"r{i}"]) for i in range(n)]
replayed = trainer.logprobs(samples, count_routing=True)
differ = {"replayed": trainer.routing_differences()}
trainer.replayer.apply = False  # the same samples, the trainer routing by itself
own = trainer.logprobs(samples, count_routing=True)
differ["own"] = trainer.routing_differences()
np.savez(out, **{f"replayed{i}": replayed[i] for i in range(n)}, **{f"own{i}": own[i] for i in range(n)},
         differ=np.frombuffer(json.dumps(differ).encode(), dtype=np.uint8))
trainer.close()
"""


@contextlib.contextmanager
def trainer_process(workdir: Path):
    """The trainer (`TRAINER`) on the checkpoint in ``workdir``: it imports and builds its model at once,
    then waits for the samples' path on its stdin; killed on leaving the block if still running."""
    from pipeline.launch.rendezvous import free_port

    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port("127.0.0.1")), RANK="0",
               WORLD_SIZE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(workdir / "model"), str(workdir / "out.npz")],
                               env=env, cwd=REPO, stdin=subprocess.PIPE, text=True)
    try:
        yield trainer
    finally:
        if trainer.poll() is None:
            trainer.kill()
        trainer.wait()


async def _generate(gen, args) -> list:
    rng = np.random.default_rng(0)
    prompts = [[0] + rng.integers(3, 500, int(rng.integers(4, 16))).tolist() for _ in range(args.prompts)]
    done = await asyncio.gather(*(gen.complete(p, lambda seg, i=i, j=j: 1000 * i + j)
                                  for i, p in enumerate(prompts) for j in range(args.group_size)))
    return [(p, c) for p, c in zip([p for p in prompts for _ in range(args.group_size)], done)]


def _hf_routing(model_dir: Path, sequences) -> list[np.ndarray]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    seen: list = []
    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(lambda m, i, o: seen.append(o[2]))
    out = []
    with torch.no_grad():
        for ids in sequences:
            seen.clear()
            model(torch.tensor([ids]))
            out.append(torch.stack(seen, 1).numpy())
    return out


def engine_setup(args) -> tuple:
    """(engine config, `Generator` keyword arguments) of this benchmark; writes the sharpened checkpoint
    the engine starts from into ``args.workdir``, a `tempfile.TemporaryDirectory`: `main` removes it
    after the engine's shutdown; on bench/shared_engine.py it goes with this benchmark's options, which
    the harness drops after its engines' shutdown (at exit at the latest, as on any failure)."""
    from pipeline.generator.config import GeneratorConfig

    sys.path.insert(0, str(REPO / "tests"))  # the tests' oracle helpers
    from support.oracle import sharpened_checkpoint

    args.workdir = tempfile.TemporaryDirectory(prefix="routing_mismatch-")
    model_dir = sharpened_checkpoint("moe", Path(args.workdir.name) / "model")
    return GeneratorConfig(model=str(model_dir), max_model_len=256, max_tokens=args.max_tokens,
                           enforce_eager=True, dtype="bfloat16", kv_cache_gib=1, seed=3,
                           prefix_caching=False, record_routing=True), {}


async def measure(gen, args, trainer: subprocess.Popen | None = None) -> dict:
    """The report on a started engine (``gen`` as `engine_setup` configures it); ``trainer``: its
    process if already started (`main`: beside the engine's start), else one started here."""
    from pipeline.apps.inspect_log import per_token_bytes
    from pipeline.protocol.record import RecordSchema

    workdir = Path(args.workdir.name)
    with contextlib.ExitStack() as stack:
        trainer = trainer or stack.enter_context(trainer_process(workdir))
        pairs = await _generate(gen, args)
        data = {"n": len(pairs)}
        for i, (p, c) in enumerate(pairs):
            data.update({f"p{i}": np.array(p), f"c{i}": np.array(c.token_ids), f"lp{i}": np.array(c.logprobs),
                         f"r{i}": c.routed_experts})
        np.savez(workdir / "samples.npz", **data)
        await asyncio.to_thread(trainer.communicate, f"{workdir / 'samples.npz'}\n", timeout=600)
    if trainer.returncode != 0:
        raise RuntimeError(f"the trainer exited {trainer.returncode}")
    out = np.load(workdir / "out.npz")
    behaviour = np.concatenate([c.logprobs for _, c in pairs])
    own = np.abs(np.concatenate([out[f"own{i}"] for i in range(len(pairs))]) - behaviour).mean()
    replayed = np.abs(np.concatenate([out[f"replayed{i}"] for i in range(len(pairs))]) - behaviour).mean()
    fp32 = _hf_routing(workdir / "model", [p + c.token_ids[:-1] for p, c in pairs])
    differ = np.concatenate([(np.sort(c.routed_experts, -1) != np.sort(r, -1)).any(-1).ravel()
                             for (_, c), r in zip(pairs, fp32)])
    layers, k = pairs[0][1].routed_experts.shape[1:]
    trainer_differ = json.loads(out["differ"].tobytes())
    bytes_per_token = per_token_bytes(RecordSchema(routed_experts=(layers, k), sampling_mask_k=64))
    print(f"{'':34}{'own routing':>14}{'replayed':>12}")
    print(f"{'mismatch |trainer - engine| / tok':34}{own:>14.4f}{replayed:>12.4f}")
    for key, label in (("routing_differ_frac", "(token, layer) routed differently"),
                       ("routing_differ_token_frac", "tokens routed differently")):
        print(f"{label:34}{trainer_differ['own'][key]:>14.3%}{trainer_differ['replayed'][key]:>12.3%}")
    print(f"transformers fp32 vs engine bf16, (token, layer) pairs: {differ.mean():.3%}")
    return {
        "samples": len(pairs), "completion_tokens": int(len(behaviour)),
        "mismatch_own_routing": float(own), "mismatch_replayed_routing": float(replayed),
        "mismatch_ratio_replayed_over_own": float(replayed / own) if own else None,
        "trainer_routing_differ_frac_own": trainer_differ["own"]["routing_differ_frac"],
        "trainer_routing_differ_token_frac_own": trainer_differ["own"]["routing_differ_token_frac"],
        "trainer_routing_differ_frac_replayed": trainer_differ["replayed"]["routing_differ_frac"],
        "trainer_routing_differ_token_frac_replayed": trainer_differ["replayed"]["routing_differ_token_frac"],
        "hf_fp32_routed_differently_fraction": float(differ.mean()),
        "routing_bytes_per_prompt_token": bytes_per_token["prompt_routed_experts"],
        "routing_bytes_per_completion_token": bytes_per_token["routed_experts"],
        "mask_bytes_per_token_width_64": bytes_per_token["sampling_mask"],
    }


async def main(args) -> dict:
    """The benchmark on an engine of its own; the trainer builds its model while the engine starts."""
    from pipeline.generator.engine import Generator

    config, extra = engine_setup(args)
    with args.workdir, trainer_process(Path(args.workdir.name)) as trainer:
        gen = Generator(config, **extra)
        try:
            await gen.start()
            return await measure(gen, args, trainer)
        finally:
            gen.shutdown()


def parse(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true")
    size.add_argument("--smoke", action="store_true", help="2 prompts x 2 samples of 4 tokens: the report's keys, not its figures")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.group_size, args.max_tokens = 4, 2, 16
    if args.smoke:
        args.prompts, args.group_size, args.max_tokens = 2, 2, 4
    return args


def cli() -> None:
    print(json.dumps(asyncio.run(main(parse()))))


if __name__ == "__main__":
    from leftovers import no_process_left  # bench/ is this script's directory

    with no_process_left():
        cli()
