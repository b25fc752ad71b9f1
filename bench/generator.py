"""Generator driver throughput against vLLM's AsyncLLM alone, side by side on one engine.

Both sides run the same requests (G samples per prompt, one request each) with identical
SamplingParams (same per-request seeds, logprob of the sampled token requested, no detokenization,
fixed length via ignore_eos so both produce the same number of tokens). The driver side goes
through `Generator.generate_group` (versions, logprob extraction, `RolloutSample` construction);
the baseline calls ``engine.generate`` directly and only collects the outputs. Rounds alternate
(baseline, driver, baseline, driver, ...) after a warm-up, so drift on a shared machine hits both.

Prints per-round figures, then one JSON line: output tokens/s of each side and their ratio
(target >= 0.95).

    python bench/generator.py --quick          # < 1 minute on a 2-core CPU, tiny dense model
    python bench/generator.py --smoke          # seconds after the engine starts: checks the harness
    python bench/generator.py --model DIR --groups 64 --group-size 8 --max-tokens 256 --rounds 3
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time


def _prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(8, 24))] for _ in range(n)]


async def _baseline(gen, prompts, group_size: int, round_id: int) -> int:
    """vLLM alone: the driver's requests, submitted straight to AsyncLLM."""
    from pipeline.generator.config import request_seed
    from pipeline.generator.vllm_args import sampling_params

    async def one(i, prompt, s):
        params = sampling_params(gen.config, request_seed(gen.config.seed, i, s, round_id), gen.config.max_tokens)
        final = None
        async for out in gen.engine.generate({"prompt_token_ids": prompt}, params, f"base-{round_id}-{i}-{s}"):
            final = out
        return len(final.outputs[0].token_ids)

    counts = await asyncio.gather(*(one(i, p, s) for i, p in enumerate(prompts) for s in range(group_size)))
    return sum(counts)


async def _driver(gen, prompts, group_size: int, round_id: int) -> int:
    from pipeline.generator.config import GroupRequest

    groups = await asyncio.gather(*(gen.generate_group(GroupRequest(i, i, round_id, p, group_size))
                                    for i, p in enumerate(prompts)))
    return sum(len(s.completion_ids) for g in groups for s in g)


def engine_setup(args) -> tuple:
    """(engine config, `Generator` keyword arguments) of this benchmark."""
    from pipeline.generator.config import GeneratorConfig
    from pipeline.models.tiny import ensure_tiny_model

    model = args.model or str(ensure_tiny_model("dense"))
    return GeneratorConfig(model=model, max_model_len=args.max_tokens + 64, max_tokens=args.max_tokens,
                           ignore_eos=True, enforce_eager=args.eager, kv_cache_gib=args.kv_cache_gib,
                           max_num_seqs=args.groups * args.group_size, seed=0), {}


async def measure(gen, args) -> dict:
    """The benchmark on a started engine (``gen`` as `engine_setup` configures it)."""
    vocab = gen.engine.model_config.get_vocab_size()
    prompts = _prompts(args.groups, vocab, seed=1)
    await _driver(gen, prompts[:2], args.group_size, 0)  # warm-up
    totals = {"vllm": [0, 0.0], "driver": [0, 0.0]}
    for r in range(args.rounds):
        for side, fn in (("vllm", _baseline), ("driver", _driver)):
            t0 = time.perf_counter()
            n = await fn(gen, prompts, args.group_size, r + 1)
            dt = time.perf_counter() - t0
            totals[side][0] += n
            totals[side][1] += dt
            print(f"round {r} {side:>6}: {n} tokens in {dt:.2f} s = {n / dt:,.0f} tok/s", flush=True)
    rates = {side: n / dt for side, (n, dt) in totals.items()}
    return {"bench": "generator", "model": gen.config.model, "groups": args.groups, "group_size": args.group_size,
            "max_tokens": args.max_tokens, "rounds": args.rounds, "enforce_eager": args.eager,
            "engine_start_s": round(gen.start_s, 1), "vllm_tok_s": round(rates["vllm"], 1),
            "driver_tok_s": round(rates["driver"], 1),
            "ratio": round(rates["driver"] / rates["vllm"], 4), "target": 0.95}


async def main(args) -> dict:
    from pipeline.generator.engine import Generator

    config, extra = engine_setup(args)
    gen = await Generator(config, **extra).start()
    try:
        return await measure(gen, args)
    finally:
        gen.shutdown()


def parse(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="small workload, eager engine (< 1 minute)")
    size.add_argument("--smoke", action="store_true", help="tiny workload, eager engine: the report's keys, not its figures")
    p.add_argument("--model", default="", help="HF checkpoint directory (default: the tiny dense model)")
    p.add_argument("--groups", type=int, default=32)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kv-cache-gib", type=int, default=2)
    p.add_argument("--eager", action="store_true", help="enforce_eager (skip torch.compile)")
    args = p.parse_args(argv)
    if args.quick:
        args.groups, args.group_size, args.max_tokens, args.rounds, args.eager = 12, 8, 64, 2, True
    if args.smoke:
        args.groups, args.group_size, args.max_tokens, args.rounds, args.eager, args.kv_cache_gib = 2, 2, 8, 1, True, 1
    return args


def cli() -> None:
    print(json.dumps(asyncio.run(main(parse()))))


if __name__ == "__main__":
    from leftovers import no_process_left  # bench/ is this script's directory

    with no_process_left():
        cli()
