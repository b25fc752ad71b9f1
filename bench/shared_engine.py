"""Engine benchmarks in one process: ``python bench/shared_engine.py --smoke NAME...``.

A vLLM engine start costs a process importing vLLM beside the driver's own import (about 15 s of
one core on a 2-core CPU machine), far more than a smoke mode's work. Here the named benchmarks
(bench/<name>.py, each with ``parse(argv)``, ``engine_setup(args) -> (GeneratorConfig, Generator
keyword arguments)`` and ``async measure(gen, args) -> report``; ``weight_stall``: weight_sync's stall
part) run in this one process, on as few engine starts as their settings allow:

- each parses the options given (e.g. ``--smoke``: its own smoke sizes);
- benchmarks whose settings fixed at engine start (`ENGINE_FIXED`: model, dtype, eager, prefix
  caching, routing record, seed, tensor parallelism, the cores its threads bind to) are equal form
  a group sharing one `Generator`, started with the group's first config widened to the longest
  ``max_model_len``, the most ``max_num_seqs`` and the largest ``kv_cache_gib`` of them all
  (`shared_config`, which refuses configs that differ in an engine-fixed field: a ValueError);
- the groups' engines start one after another in the order of each group's first benchmark, each
  shut down before the next starts; this process imports vLLM once for all of them (each engine's
  own process imports it again);
- in a group each benchmark runs in turn with its own config (per-request sampling settings: stop
  tokens, ignore_eos, token budgets), record schema and episode runner, exactly as on an engine of
  its own (the benchmarks' requests are all seeded per request); generator's ``engine_start_s`` is
  the shared start. A benchmark that pushes weights into its engine (`PUSHES_WEIGHTS`) runs last in
  its group: those after it would run on weights it loaded (the model's own, but reloaded).

Example: ``--smoke episodes generator weight_stall routing_mismatch``: episodes (``max_model_len``
96, 4 sequences, stop tokens, a tool environment), generator (72, 4 sequences) and weight_stall (68,
4 sequences) on the tiny dense model run on one engine of ``max_model_len`` 96 and 4 sequences;
routing_mismatch (its sharpened tiny MoE in bf16, routing recorded, prefix caching off, seed 3)
then runs on a second engine of its own, started after the first is shut down.
The last line printed is one JSON object, benchmark name -> its report (the keys of its own run).
"""
from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from dataclasses import replace
from pathlib import Path

ENGINE_FIXED = ("model", "dtype", "enforce_eager", "prefix_caching", "record_routing", "seed", "tensor_parallel_size",
                "cpu_cores")
"""GeneratorConfig fields an engine fixes at start: benchmarks sharing an engine agree on them."""
WIDENED = ("max_model_len", "max_num_seqs", "kv_cache_gib")
"""Fields the shared engine takes the largest of (unset in all of them: unset)."""
PUSHES_WEIGHTS = {"weight_stall"}
"""Benchmarks that load weights into their engine: the last of their group."""


def load(name: str):
    """bench/<name>.py as a module (not run as a script)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def shared_config(configs: dict):
    """The first config widened to every benchmark's needs; ValueError if an engine-fixed field differs."""
    first = next(iter(configs.values()))
    for field in ENGINE_FIXED:
        values = {name: getattr(c, field) for name, c in configs.items()}
        if len(set(map(str, values.values()))) > 1:
            raise ValueError(f"these benchmarks cannot share an engine: generator.{field} differs: {values}")
    return replace(first, **{f: max((getattr(c, f) for c in configs.values() if getattr(c, f) is not None), default=None)
                             for f in WIDENED})  # None: the engine's default


def engine_groups(configs: dict) -> list[list[str]]:
    """Benchmark names grouped by equal engine-fixed fields, in the order of each group's first; in a
    group, those pushing weights last."""
    groups: dict[tuple, list[str]] = {}
    for name, c in configs.items():
        groups.setdefault(tuple(str(getattr(c, f)) for f in ENGINE_FIXED), []).append(name)
    return [sorted(names, key=lambda name: name in PUSHES_WEIGHTS) for names in groups.values()]


async def run(names: list[str], argv: list[str]) -> dict:
    from pipeline.generator.engine import Generator
    from pipeline.protocol.record import RecordSchema

    modules = {name: load(name) for name in names}
    args = {name: m.parse(argv) for name, m in modules.items()}
    setups = {name: modules[name].engine_setup(args[name]) for name in names}
    reports = {}
    for group in engine_groups({name: cfg for name, (cfg, _) in setups.items()}):
        gen = Generator(shared_config({name: setups[name][0] for name in group}))
        try:
            await gen.start()
            for name in group:
                config, extra = setups[name]
                gen.config, gen.schema, gen.episodes = config, extra.get("schema", RecordSchema()), extra.get("episodes")
                reports[name] = await modules[name].measure(gen, args[name])
        finally:
            gen.shutdown()
    return reports


def cli() -> None:
    names = [a for a in sys.argv[1:] if not a.startswith("-")]
    if not names:
        sys.exit(f"usage: python {sys.argv[0]} [--smoke | --quick] NAME... (engine benchmarks: generator episodes weight_stall routing_mismatch)")
    print(json.dumps(asyncio.run(run(names, [a for a in sys.argv[1:] if a.startswith("-")]))))


if __name__ == "__main__":
    from leftovers import no_process_left  # bench/ is this script's directory

    with no_process_left():
        cli()
