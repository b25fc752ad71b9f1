"""Run real weight syncs from a trainer layout (TP x EP megatron-core ranks) to local receivers.

``run(model_dir, tp, ep, receivers, ..., pp)`` starts ``tp * ep * pp`` trainer ranks (megatron-core on
gloo, `Trainer`) and ``receivers`` receiver processes (a `TorchDistChannel` receiver each, as a
generator worker joins), then syncs the weights ``reps`` times with the roles' own code path:
`ShardedWeights` + `BucketPlan.from_specs` + `send_stream`. Each receiver compares every tensor,
bit for bit, with the checkpoint the trainer loaded (an independent reference) and records what
it got; each trainer rank records which tensors it sent and its streaming-buffer bytes. Returns
the merged JSON-able results. Every process is forked from a zygote that imported torch,
megatron-core and the roles' modules once (`support.zygote`: ~6 CPU s saved per process), dies with
it as the zygote dies with the caller (PR_SET_PDEATHSIG), and is killed on any failure or after
``timeout_s``. Used by the tests and ``bench/weight_sync.py``:

    python tests/support/layout_check.py tiny-moe --tp 2 --ep 2    # prints one JSON object
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # run as a script: the package and the tests' helpers

from pipeline.launch.rendezvous import free_port  # noqa: E402
from support.zygote import TRAINER_ENV, TRAINER_PRELOAD, Zygote  # noqa: E402


PRELOAD = [*TRAINER_PRELOAD, "pipeline.weights.group", "pipeline.weights.adapters", "safetensors",
           "support.layout_check"]
"""What the zygote imports once for every trainer rank and receiver (~6 CPU s, most of a rank's)."""


def start_zygote(log: Path) -> Zygote:
    """A zygote for `run`'s processes (one thread of OpenMP each, warnings off), its stderr to ``log``;
    several runs may share one (``run(..., zygote=...)``)."""
    return Zygote(PRELOAD, log, TRAINER_ENV)


def run(model_dir: str, tp: int = 1, ep: int = 1, receivers: int = 1, bucket_mb: float = 1.0,
        reps: int = 2, timeout_s: float = 300.0, outdir: Path | None = None, lora_rank: int = 0,
        pp: int = 1, zygote: Zygote | None = None) -> dict:
    """Sync ``reps`` times; returns {"trainer": [per rank], "receivers": [per receiver]}.
    ``lora_rank`` > 0: the trainer trains LoRA adapters of that rank (all targets, B = 0 at
    start) and syncs only them; each receiver merges them into the base (``AdapterMerger``) and
    compares the merged weights with the checkpoint (equal: B is 0). The processes are forked from
    ``zygote`` (default: one of this run's, closed at its end)."""
    import tempfile

    world = tp * ep * pp
    out = Path(outdir or tempfile.mkdtemp(prefix="tf-layout-check-"))
    out.mkdir(parents=True, exist_ok=True)
    dist_port, weight_port = free_port("127.0.0.1"), free_port("127.0.0.1")
    common = {"model_dir": str(model_dir), "tp": tp, "ep": ep, "pp": pp, "world": world, "receivers": receivers,
              "bucket_bytes": int(bucket_mb * 2**20), "reps": reps, "dist_port": dist_port,
              "weight_port": weight_port, "timeout_s": timeout_s, "out": str(out), "lora_rank": lora_rank}
    own = zygote is None
    forks = start_zygote(out / "zygote.log") if own else zygote
    workers: dict[int, str] = {}
    try:
        for role, count in (("trainer", world), ("receiver", receivers)):
            for i in range(count):
                pid = forks.start("support.layout_check:serve_role", {"role": role, "index": i, "a": common},
                                  out / f"{role}{i}.log")
                workers[pid] = f"{role}{i}"
        try:
            status = forks.wait(list(workers), timeout_s)
        except TimeoutError:
            left = [name for pid, name in workers.items() if pid not in forks.exited]
            raise RuntimeError(f"{left} did not finish within {timeout_s:.0f} s") from None
        failed = [(workers[pid], rc) for pid, rc in status.items() if rc != 0]
        if failed:
            tails = "\n".join(f"--- {n} (rc {rc})\n" + (out / f"{n}.log").read_text()[-3000:] for n, rc in failed)
            raise RuntimeError(f"layout check tp={tp} ep={ep} failed in {failed}:\n{tails}")
    finally:
        forks.kill_left(list(workers))
        if own:
            forks.close()
    result = {"tp": tp, "ep": ep, "pp": pp,
              "trainer": [json.loads((out / f"trainer{i}.json").read_text()) for i in range(world)],
              "receivers": [json.loads((out / f"receiver{i}.json").read_text()) for i in range(receivers)]}
    if outdir is None:  # a directory of its own (a benchmark's): gone once read; a failure keeps it
        shutil.rmtree(out, ignore_errors=True)
    return result


def serve_role(role: str, index: int, a: dict) -> None:
    """A forked worker: trainer rank or receiver ``index``; its results to ``<out>/<role><index>.json``."""
    result = (_trainer_rank if role == "trainer" else _receiver)(index, a)
    (Path(a["out"]) / f"{role}{index}.json").write_text(json.dumps(result))


def _trainer_rank(rank: int, a: dict) -> dict:
    import torch

    from pipeline.trainer.config import LoraConfig, ParallelConfig, TrainerConfig
    from pipeline.trainer.engine import Trainer
    from pipeline.weights.bucket_plan import BucketPlan
    from pipeline.weights.group import TorchDistChannel
    from pipeline.weights.shards import ShardedWeights

    torch.set_num_threads(1)
    cfg = TrainerConfig(model_dir=a["model_dir"], parallel=ParallelConfig(tp=a["tp"], ep=a["ep"], pp=a.get("pp", 1)),
                        timeout_s=a["timeout_s"], lora=LoraConfig(rank=a.get("lora_rank", 0)))
    trainer = Trainer(cfg, rank=rank, world_size=a["world"], init_method=f"tcp://127.0.0.1:{a['dist_port']}")
    shards = ShardedWeights(trainer.model, trainer.hf_config)
    plan = BucketPlan.from_specs(shards.specs, a["bucket_bytes"])
    channel = None
    if shards.source is not None:
        channel = TorchDistChannel("127.0.0.1", a["weight_port"], shards.source, shards.senders + a["receivers"],
                                   a["timeout_s"], senders=shards.senders, secret=bytes(32))
    sent: list[str] = []
    times, wire = [], []
    for version in range(1, a["reps"] + 1):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        tensors = shards.tensors()
        before = channel.wire.reading() if channel is not None else None
        if channel is not None:
            def named():
                for name, t in tensors:
                    if version == 1:
                        sent.append(name)
                    yield name, t
            channel.send_stream(version, plan, named())
        for _ in tensors:  # a non-sending rank's gathers
            pass
        torch.distributed.barrier()
        times.append(time.perf_counter() - t0)
        counted = channel.wire.since(before) if channel is not None else None
        wire.append([counted.sent, counted.received] if counted is not None else [0, 0])
    result = {"rank": rank, "source": shards.source, "sent": sent, "sync_s": times, "wire": wire,
              "sync_bytes": trainer.sync_bytes,
              "plan_buckets": len(plan.sizes), "plan_bytes": plan.total_bytes, "max_bucket": max(plan.sizes),
              "buffers_allocated": channel.buffers.allocated if channel else 0,
              "buffers_resident": channel.buffers.resident if channel else 0}
    if channel is not None:
        channel.close()
    trainer.close()
    return result


def _receiver(index: int, a: dict) -> dict:
    import torch
    from safetensors import safe_open

    from pipeline.models.tiny import resolve_model
    from pipeline.trainer.model import load_hf_config
    from pipeline.weights.adapters import AdapterMerger
    from pipeline.weights.group import TorchDistChannel

    torch.set_num_threads(1)
    hf = load_hf_config(a["model_dir"])
    merger = AdapterMerger(a["model_dir"]) if a.get("lora_rank") else None
    senders = (a["ep"] if getattr(hf, "num_experts", 0) else 1) * a.get("pp", 1)  # one per stage and EP rank
    files = sorted(resolve_model(a["model_dir"]).glob("*.safetensors"))
    handles = [safe_open(str(f), framework="pt") for f in files]
    where = {n: h for h in handles for n in h.keys()}
    expected = set(where) if merger is None else {  # LoRA with every target: each projection
        n for n in where if re.search(r"(q|k|v|o|gate|up|down)_proj\.weight$", n)}
    channel = TorchDistChannel("127.0.0.1", a["weight_port"], senders + index, senders + a["receivers"],
                               a["timeout_s"], senders=senders, secret=bytes(32))
    versions, times, mismatched, names, wire, planned = [], [], [], [], [], []
    for _ in range(a["reps"]):
        t0 = time.perf_counter()
        before = channel.wire.reading()
        update = channel.receive()
        names = []
        for name, t in (update if merger is None else merger.merged(update)):
            names.append(name)
            ref = where[name].get_tensor(name) if name in where else None
            if ref is None or ref.dtype != t.dtype or not torch.equal(ref, t):
                mismatched.append(name)
        times.append(time.perf_counter() - t0)
        versions.append(update.version)
        counted = channel.wire.since(before)
        wire.append([counted.sent, counted.received])
        planned.append(_planned_wire_bytes(update.version, update.plan))
    result = {"index": index, "versions": versions, "receive_s": times, "tensors": len(names),
              "wire": wire, "planned_wire": planned,
              "unique": len(set(names)), "checkpoint_tensors": len(where), "mismatched": mismatched[:10],
              "mismatched_count": len(mismatched), "missing": sorted(expected - set(names))[:10],
              "buffers_allocated": channel.buffers.allocated, "buffers_resident": channel.buffers.resident}
    channel.close()
    return result


def _planned_wire_bytes(version: int, plan) -> dict[str, int]:
    """What the plan says an update puts on the wire: the metadata (int64 length + the
    `UpdateHeader` record, `pipeline.weights.group`) and each bucket's `segments` (tensors and the
    padding inside packed runs); ``tensor_bytes``: the tensors' own bytes."""
    from pipeline.protocol import codec, weight_stream
    from pipeline.weights.buckets import segments

    meta = len(codec.pack(weight_stream.UpdateHeader(int(version), plan.to_wire())))
    payload = sum(end - start for slots, size in zip(plan.buckets, plan.sizes)
                  for start, end, _ in segments(slots, size))
    tensor_bytes = sum(slot.nbytes for slots in plan.buckets for slot in slots)
    return {"metadata": 8 + meta, "payload": payload, "tensor_bytes": tensor_bytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", default="tiny-moe")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--receivers", type=int, default=1)
    ap.add_argument("--bucket-mb", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    from pipeline.models.tiny import resolve_model

    print(json.dumps(run(str(resolve_model(args.model)), args.tp, args.ep, args.receivers, args.bucket_mb,
                         args.reps, pp=args.pp)))


if __name__ == "__main__":
    main()
