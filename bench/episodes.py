"""Episode throughput against single-turn samples of the same token count, side by side on one engine.

The episode side runs G x S multi-turn episodes through `Generator.generate_group` with an
environment that answers every model turn with a calculator tool turn (17 tokens) until the turn
limit; model turns end at a stop token (every even token id is one, so turns are a few tokens
long on the untrained tiny model). The single-turn side then generates, for each episode, one
sample of the same prompt with exactly as many tokens as the episode's completion (model and
environment tokens: ``ignore_eos``, no stop tokens, ``max_tokens`` = that count). Rounds alternate
(episodes, single-turn, episodes, ...) so drift on a shared machine hits both.

What the ratio measures: an episode pays one request (scheduling, prefix-cache lookup of the
sequence so far, prefill of the observation) per turn plus the environment step, where a single
sample decodes straight through; environment tokens are prefilled, not decoded. Prints per-round
figures, then one JSON line: completion tokens/s of each side, their ratio, and model tokens/s.

    python bench/episodes.py --quick        # < 1 minute on a 2-core CPU, tiny dense model
    python bench/episodes.py --groups 32 --group-size 8 --turns 6 --rounds 3
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import replace


def _prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(8, 24))] for _ in range(n)]


async def _episodes(gen, prompts, group_size: int, round_id: int):
    from pipeline.generator.config import GroupRequest

    groups = await asyncio.gather(*(gen.generate_group(GroupRequest(i, i, round_id, p, group_size))
                                    for i, p in enumerate(prompts)))
    return [s for g in groups for s in g]


async def _single(gen, episodes, round_id: int) -> int:
    """One sample per episode: its prompt, exactly its completion's token count, straight through."""
    from pipeline.generator.config import request_seed

    straight = replace(gen.config, stop_token_ids=[], ignore_eos=True)
    plain, gen.config, gen.episodes = (gen.config, gen.episodes), straight, None
    try:
        done = await asyncio.gather(*(gen.complete(
            e.prompt_ids.tolist(), lambda seg, i=i: request_seed(0, i, 0, round_id, seg), len(e.completion_ids))
            for i, e in enumerate(episodes)))
    finally:
        gen.config, gen.episodes = plain
    return sum(len(c.token_ids) for c in done)


def engine_setup(args) -> tuple:
    """(engine config, `Generator` keyword arguments) of this benchmark: the tool environment's runner."""
    from pipeline.envs import ENVIRONMENTS, Environment, EpisodeConfig, Step
    from pipeline.envs.calculator import tool_turn
    from pipeline.generator.config import GeneratorConfig
    from pipeline.generator.episodes import EpisodeRunner
    from pipeline.models.tiny import ensure_tiny_model
    from pipeline.protocol.record import RecordSchema

    class ToolEveryTurn(Environment):
        def step(self, message):
            return Step(tool_turn("=1234"), 0.0, False)

    ENVIRONMENTS["bench_tool"] = ToolEveryTurn
    from transformers import AutoTokenizer

    model = str(ensure_tiny_model("dense"))
    tokenizer = AutoTokenizer.from_pretrained(model)
    cfg = GeneratorConfig(model=model, max_model_len=args.max_tokens + 64, max_tokens=args.max_tokens,
                          enforce_eager=args.eager, kv_cache_gib=args.kv_cache_gib,
                          max_num_seqs=args.groups * args.group_size, seed=0,
                          stop_token_ids=list(range(0, len(tokenizer), 2)))
    runner = EpisodeRunner("bench_tool", EpisodeConfig(max_turns=args.turns), tokenizer)
    return cfg, {"schema": RecordSchema(model_mask=True), "episodes": runner}


async def measure(gen, args) -> dict:
    """The benchmark on a started engine (``gen`` as `engine_setup` configures it)."""
    prompts = _prompts(args.groups, len(gen.episodes.tokenizer), seed=1)
    await _episodes(gen, prompts[:2], args.group_size, 0)  # warm-up
    totals = {"episodes": [0, 0.0], "single": [0, 0.0]}
    model_tokens, turns = 0, []
    for r in range(args.rounds):
        t0 = time.perf_counter()
        eps = await _episodes(gen, prompts, args.group_size, r + 1)
        dt = time.perf_counter() - t0
        n = sum(len(e.completion_ids) for e in eps)
        model_tokens += sum(int(e.model_mask.sum()) for e in eps)
        turns += [int(e.model_mask[0] + ((e.model_mask[1:] == 1) & (e.model_mask[:-1] == 0)).sum())
                  for e in eps]
        totals["episodes"][0] += n
        totals["episodes"][1] += dt
        print(f"round {r} episodes: {n} tokens in {dt:.2f} s = {n / dt:,.0f} tok/s", flush=True)
        t0 = time.perf_counter()
        m = await _single(gen, eps, r + 1)
        dt = time.perf_counter() - t0
        totals["single"][0] += m
        totals["single"][1] += dt
        print(f"round {r}   single: {m} tokens in {dt:.2f} s = {m / dt:,.0f} tok/s", flush=True)
    rates = {side: n / dt for side, (n, dt) in totals.items()}
    return {"bench": "episodes", "groups": args.groups, "group_size": args.group_size,
            "max_turns": args.turns, "max_tokens": args.max_tokens, "rounds": args.rounds,
            "mean_model_turns": round(sum(turns) / len(turns), 2),
            "env_token_share": round(1 - model_tokens / totals["episodes"][0], 3),
            "episode_tok_s": round(rates["episodes"], 1), "single_tok_s": round(rates["single"], 1),
            "episode_model_tok_s": round(model_tokens / totals["episodes"][1], 1),
            "ratio": round(rates["episodes"] / rates["single"], 4)}


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
    p.add_argument("--groups", type=int, default=32)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--turns", type=int, default=6, help="episode.max_turns")
    p.add_argument("--max-tokens", type=int, default=192, help="token budget per episode")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kv-cache-gib", type=int, default=2)
    p.add_argument("--eager", action="store_true", help="enforce_eager (skip torch.compile)")
    args = p.parse_args(argv)
    if args.quick:
        args.groups, args.group_size, args.turns, args.max_tokens, args.rounds, args.eager = 8, 4, 4, 128, 2, True
    if args.smoke:
        args.groups, args.group_size, args.turns, args.max_tokens, args.rounds, args.eager = 2, 2, 2, 32, 1, True
        args.kv_cache_gib = 1
    return args


def cli() -> None:
    print(json.dumps(asyncio.run(main(parse()))))


if __name__ == "__main__":
    from leftovers import no_process_left  # bench/ is this script's directory

    with no_process_left():
        cli()
