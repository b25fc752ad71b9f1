"""Weight sync: streamed packed buckets against one flat broadcast, sync memory, generator stall, layouts.

(a) Bandwidth. Two local processes join one `TorchDistChannel` (gloo): this process receives
(rank 1), a child process sends (rank 0). For each weight set the sender alternates, repetition
after repetition, between
  - packed:  ``send_tensors(version, named, bucket_bytes)``: plan, then stream the buckets (bucket
             k+1 is packed while bucket k is on the wire, two buffers on the sender; the receiver
             receives bucket k+1 while it unpacks views of bucket k, two buffers), and
  - single:  ``send_stream(version, plan of one uint8 tensor, [that tensor])``: the same bytes,
             already flat, as one broadcast (the tensor's own bytes, uncopied) through the same
             channel and protocol;
and, for reference, ``unbatched`` (bucket_bytes = 1: one broadcast per tensor, still copied).
Before each timed transfer both sides exchange a 1-byte update, so they start together; the
receiver times ``receive()`` up to its last tensor. Every mode receives into memory already
touched by the warm-up round (single: one buffer of the set's size, kept by the channel; packed:
its bucket buffers and the reassembly memory of the split embedding, both kept by the channel
between streamed updates), so none pays for page faults the others do not. Reported: median
seconds and GB/s per mode, and ratio = packed GB/s / single GB/s of the medians; the target
(>= 0.8, ``bandwidth_met``) is the big set's ratio with at least 1 B parameters. Beside it
``paired_ratio_median``: the median of each repetition's own ratio (its packed and single
transfers run back to back, so a drift of a shared machine's load cancels in it). Weight sets: the tiny
dense and MoE models' safetensors (their dtypes), and a locally built Qwen3-shaped model with
random bf16 weights (`--big-layers`, default 20 layers = 1.32 B parameters, 2.6 GB, the issue's
set; --quick 6 layers = 0.61 B, 1.2 GB, to stay within a minute: ``big_params`` in the JSON says
which ran), built lazily in the sender as views of one flat buffer and freed after its set.
Bucket size 64 MiB (``run.weight_bucket_mb``'s default).
Sync memory: on the big set, one packed transfer runs with fresh `BufferRing`s on both ends; the
bytes they allocated (counted by the code) are reported against their bound: two buckets on
either end, a bucket being at most the largest bucket of the plan
(64 MiB; the 151936 x 2048 embedding travels in 64 MiB pieces). The receiver's reassembly memory
of split tensors (the embedding, 622 MB) is counted apart (`Assembly`) and not in these figures.

(b) Generator stall (`bench/weight_stall.py`): a real `Generator` decodes continuously while a sender
pushes updates of the model's own weights; reported per update kind: the stall in seconds and
decode steps (target <= 1 for the default kind), its share of generator time, the throughput lost.

(c) Layouts. `tests/support/layout_check.py` syncs the tiny MoE model from megatron-core trainer
ranks at TP2 x EP2 (two senders, one per expert-parallel rank) and at TP1 to one receiver, which
checks every tensor against the checkpoint; reported: median sync time of each and their ratio.

(d) LoRA. The same tool syncs the tiny MoE model from one trainer rank with full weights and with
LoRA adapters only (rank 8 on every attention, expert projection; ``pipeline/weights/adapters.py``):
reported: bytes per sync, trainer sync time and receive (+ merge into the base) time of each, and
the ratios adapters / full. The full sync is (c)'s TP1 run (the same command: one run serves
both, run right before the adapters').

    python bench/weight_sync.py --quick                  # < 1 minute on an idle 2-core machine
    python bench/weight_sync.py --quick --part bandwidth # (a) only
    python bench/weight_sync.py                          # full: more repetitions, the 1.3 B set
    python bench/weight_sync.py --smoke                  # the report's keys: every part at its smallest,
                                                         # (c) and (d)'s runs at once beside (a) and (b)
    python bench/weight_sync.py --smoke --part bandwidth layouts lora  # all but (b), which
                                                         # bench/shared_engine.py runs as weight_stall

In `bench/shared_zygote.py` (``main(argv, zygote)``) (c) and (d) fork from its zygote, and the parts
default to `SHARED_ZYGOTE_PARTS`: the report has the keys of ``--part bandwidth layouts lora``.

The last line printed is one JSON object. The machine may be shared with other work: both sides of
every ratio are measured alternately so drift hits both, but single figures vary between runs.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the package and bench/, the tests' helpers

from bench import weight_stall  # noqa: E402
from bench.weight_stall import BUCKET_BYTES, TIMEOUT_S, finish_sender, model_weights, stall_sender  # noqa: E402

MODES = ("packed", "single", "unbatched")
PARTS = ("bandwidth", "stall", "layouts", "lora")
"""(a) to (d); ``--part`` names some of them (default all; given a zygote, `SHARED_ZYGOTE_PARTS`)."""
SHARED_ZYGOTE_PARTS = ("bandwidth", "layouts", "lora")
"""The default parts given a zygote (`bench/shared_zygote.py`): all but (b), which needs an engine."""


def big_model_weights(layers: int, vocab: int):
    """A Qwen3-shaped model with random bf16 weights, HF names, as views of one flat buffer:
    hidden 2048, 16 heads x 128 (8 KV heads), MLP 6144, tied embeddings; 50.3 M parameters per
    layer + 2048 x vocab (151936: 311 M; 20 layers: 1.32 B)."""
    import torch

    h, heads, kv, hd, inter = 2048, 16, 8, 128, 6144
    shapes = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [(p + "input_layernorm.weight", (h,)), (p + "self_attn.q_proj.weight", (heads * hd, h)),
                   (p + "self_attn.k_proj.weight", (kv * hd, h)), (p + "self_attn.v_proj.weight", (kv * hd, h)),
                   (p + "self_attn.o_proj.weight", (h, heads * hd)), (p + "self_attn.q_norm.weight", (hd,)),
                   (p + "self_attn.k_norm.weight", (hd,)), (p + "post_attention_layernorm.weight", (h,)),
                   (p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
                   (p + "mlp.down_proj.weight", (h, inter))]
    shapes.append(("model.norm.weight", (h,)))
    sizes = [int(torch.Size(shape).numel()) for _, shape in shapes]
    flat = torch.empty(sum(sizes), dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    for start in range(0, flat.numel(), 1 << 26):
        flat[start:start + (1 << 26)].normal_(0, 0.02, generator=g)
    named, offset = [], 0
    for (name, shape), n in zip(shapes, sizes):
        named.append((name, flat[offset:offset + n].view(shape)))
        offset += n
    return named, flat.view(torch.uint8)


def weight_sets(big_layers: int, big_vocab: int):
    """(name, thunk) per set: each set is built when its turn comes and dropped after it."""
    return [("tiny-dense", lambda: (model_weights("tiny-dense"), None)),
            ("tiny-moe", lambda: (model_weights("tiny-moe"), None)),
            ("big", lambda: big_model_weights(big_layers, big_vocab))]


def _flat_plan(total: int):
    from pipeline.weights.bucket_plan import BucketPlan

    return BucketPlan.from_specs([("flat", "uint8", (total,))], total)


def _one_per_bucket(named):
    """The "unbatched" plan: every tensor whole in a bucket of its own (no packing, no splitting)."""
    from pipeline.weights.bucket_plan import BucketPlan, TensorSlot, dtype_name

    slots = [TensorSlot(n, dtype_name(t.dtype), tuple(t.shape), 0) for n, t in named]
    return BucketPlan(tuple((s,) for s in slots), tuple(s.nbytes for s in slots))


def _as_flat(named, flat):
    """The set's bytes as one flat uint8 tensor (the big set already is one)."""
    import torch

    if flat is not None:
        return flat
    return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for _, t in named])


def _sync(channel, rank: int) -> None:
    """A 1-byte update: both sides leave it together."""
    import torch

    if rank == 0:
        channel.send_tensors(-1, [("sync", torch.zeros(1, dtype=torch.uint8))], 64)
    else:
        for _ in channel.receive():
            pass


# -- (a) bandwidth ---------------------------------------------------------------------------------
def bandwidth_sender(host: str, port: int, big_layers: int, big_vocab: int, reps: int) -> None:
    """Child process: rank 0 of the channel, sends every mode `reps` times per weight set, then
    one packed transfer of the last set with fresh buffers (sync memory), reporting its bytes."""
    import torch

    from pipeline.weights.buckets import BufferRing
    from pipeline.weights.group import TorchDistChannel

    torch.set_num_threads(1)
    channel = TorchDistChannel(host, port, rank=0, world_size=2, timeout_s=TIMEOUT_S, secret=bytes(32))
    try:
        for _, build in weight_sets(big_layers, big_vocab):
            named, flat = build()
            flat = _as_flat(named, flat)
            for _ in range(reps + 1):  # the first round warms up
                for mode in MODES:
                    _sync(channel, 0)
                    if mode == "packed":
                        channel.send_tensors(0, named, BUCKET_BYTES)
                    elif mode == "unbatched":
                        channel.send_stream(0, _one_per_bucket(named), named)
                    else:
                        channel.send_stream(0, _flat_plan(flat.numel()), [("flat", flat)])
        _sync(channel, 0)
        channel.buffers = BufferRing(channel.device, channel.buffers.slots)  # the last (big) set, from zero
        channel.send_tensors(1, named, BUCKET_BYTES)
        allocated = channel.buffers.allocated
        _sync(channel, 0)
        channel.send_tensors(2, [("sender_allocated", torch.tensor([allocated]))], 64)
    finally:
        channel.close()


def bandwidth(big_layers: int, big_vocab: int, reps: int) -> dict:
    from pipeline.launch.rendezvous import free_port
    from pipeline.weights.buckets import BufferRing
    from pipeline.weights.group import TorchDistChannel

    import torch

    torch.set_num_threads(1)
    port = free_port()
    sender = subprocess.Popen([sys.executable, __file__, "--_sender", "bandwidth", "--_port", str(port),
                               "--reps", str(reps), "--big-layers", str(big_layers),
                               "--big-vocab", str(big_vocab)])
    results: dict = {}
    try:
        channel = TorchDistChannel("127.0.0.1", port, rank=1, world_size=2, timeout_s=TIMEOUT_S, secret=bytes(32))
        for name, _ in weight_sets(big_layers, big_vocab):
            times: dict[str, list[float]] = {m: [] for m in MODES}
            total = tensors = buckets = 0
            for rep in range(reps + 1):
                for mode in MODES:
                    _sync(channel, 1)
                    t0 = time.perf_counter()
                    update = channel.receive()
                    got = n = 0
                    for _, t in update:
                        got += t.numel() * t.element_size()
                        n += 1
                    dt = time.perf_counter() - t0
                    if mode == "single":
                        total = got
                    elif mode == "packed":
                        tensors, buckets, packed_bytes = n, len(update.plan.sizes), got
                    if rep:
                        times[mode].append(dt)
            if packed_bytes != total:
                raise RuntimeError(f"{name}: packed moved {packed_bytes} bytes, single {total}")
            med = {m: statistics.median(v) for m, v in times.items()}
            gbps = {m: total / s / 1e9 for m, s in med.items()}
            paired = [single / packed for single, packed in zip(times["single"], times["packed"])]
            results[name] = {"bytes": total, "params": total // 2 if name == "big" else None, "tensors": tensors, "buckets": buckets, "reps": reps,
                             **{f"{m}_s": med[m] for m in MODES}, **{f"{m}_GBps": gbps[m] for m in MODES},
                             "ratio": gbps["packed"] / gbps["single"],
                             "paired_ratio_median": statistics.median(paired), "paired_ratios": paired}
            print(f"{name}: {total / 2**20:.1f} MiB in {tensors} tensors -> {buckets} bucket(s); median "
                  + ", ".join(f"{m} {med[m] * 1e3:.1f} ms ({gbps[m]:.2f} GB/s)" for m in MODES)
                  + f"; packed/single {results[name]['ratio']:.2f} (of the medians), "
                  f"{results[name]['paired_ratio_median']:.2f} (median of the {reps} repetitions' own ratios: "
                  + " ".join(f"{r:.2f}" for r in paired) + ")", flush=True)
        _sync(channel, 1)
        channel.buffers = BufferRing(channel.device, channel.buffers.slots)  # one streamed sync's, from zero
        update = channel.receive()
        for _ in update:
            pass
        receiver_allocated, largest = channel.buffers.allocated, max(update.plan.sizes)
        _sync(channel, 1)
        sender_allocated = int(next(iter(channel.receive()))[1][0])
        channel.close()
    except BaseException:
        sender.kill()  # our own child; it would otherwise wait out its channel timeout
        raise
    finish_sender(sender, "bandwidth")
    memory = {"sender_bytes": sender_allocated, "receiver_bytes": receiver_allocated,
              "sender_bound_bytes": 2 * largest, "receiver_bound_bytes": 2 * largest,
              "largest_bucket_bytes": largest,
              "within_bound": sender_allocated <= 2 * largest and receiver_allocated <= 2 * largest,
              "model_bytes": results["big"]["bytes"]}
    print(f"streamed sync memory (big set): sender {sender_allocated / 2**20:.0f} MiB (bound 2 buckets "
          f"= {2 * largest / 2**20:.0f} MiB), receiver {receiver_allocated / 2**20:.0f} MiB (bound 2 buckets "
          f"= {2 * largest / 2**20:.0f} MiB); model {memory['model_bytes'] / 2**20:.0f} MiB", flush=True)
    return {"sets": results, "sync_memory": memory, "big_params": results["big"]["params"]}


# -- (c) layouts -----------------------------------------------------------------------------------
LAYOUT_RUNS = {"layouts": ((2, 2, 0), (1, 1, 0)), "lora": ((1, 1, 0), (1, 1, 8))}
"""The `support.layout_check` runs, (tp, ep, lora rank), of parts (c) and (d): (1, 1, 0), the TP1
full-weight sync, serves as layout (c)'s tp1 and as LoRA (d)'s full."""


def layout_check(zygote, reps: int, tp: int, ep: int, lora: int) -> dict:
    """`support.layout_check.run` of the tiny MoE to one receiver, forked from ``zygote``; raises on a
    wrong or missing tensor."""
    from pipeline.models.tiny import resolve_model
    from support.layout_check import run

    r = run(str(resolve_model("tiny-moe")), tp=tp, ep=ep, receivers=1, reps=reps + 1, lora_rank=lora, zygote=zygote)
    recv = r["receivers"][0]
    if recv["mismatched_count"] or recv["missing"]:
        raise RuntimeError(f"tp={tp} ep={ep} lora={lora}: the receiver got wrong or missing tensors: {recv}")
    return r


def layout_run(done: dict, reps: int, tp: int = 1, ep: int = 1, lora: int = 0) -> dict:
    """`layout_check`, once per (tp, ep, lora) in ``done`` (its processes forked from ``done["zygote"]``)."""
    if (tp, ep, lora) not in done:
        done[tp, ep, lora] = layout_check(done["zygote"], reps, tp, ep, lora)
    return done[tp, ep, lora]


def layouts(reps: int, done: dict) -> dict:
    """Sync time of the tiny MoE model from TP2 x EP2 and from TP1 trainer ranks (one receiver)."""
    out: dict = {"model": "tiny-moe"}
    for name, (tp, ep, _) in zip(("tp2xep2", "tp1"), LAYOUT_RUNS["layouts"]):
        lead = layout_run(done, reps, tp, ep)["trainer"]
        out[name] = {"sync_median_s": statistics.median(lead[0]["sync_s"][1:]),
                     "senders": sum(1 for t in lead if t["source"] is not None),
                     "bytes": lead[0]["plan_bytes"], "buckets": lead[0]["plan_buckets"]}
        print(f"{name}: sync median {out[name]['sync_median_s'] * 1e3:.1f} ms from "
              f"{out[name]['senders']} sender(s), {lead[0]['plan_bytes'] / 2**20:.1f} MiB", flush=True)
    out["ratio_tp2xep2_over_tp1"] = out["tp2xep2"]["sync_median_s"] / out["tp1"]["sync_median_s"]
    return out


# -- (d) LoRA: adapter-only sync against full sync ----------------------------------------------
def lora_sync(reps: int, done: dict) -> dict:
    """Full-weight sync against adapter-only sync (LoRA rank 8, every target) of the tiny MoE model
    from one trainer rank; the receiver of the adapter sync merges them into the base."""
    rank = LAYOUT_RUNS["lora"][1][2]
    out: dict = {"model": "tiny-moe", "lora_rank": rank}
    for name, lora in (("full", 0), ("adapters", rank)):
        r = layout_run(done, reps, lora=lora)
        recv, lead = r["receivers"][0], r["trainer"][0]
        out[name] = {"sync_median_s": statistics.median(lead["sync_s"][1:]),
                     "receive_median_s": statistics.median(recv["receive_s"][1:]),
                     "bytes": lead["plan_bytes"], "tensors": recv["tensors"]}
        print(f"lora {name}: {lead['plan_bytes'] / 2**20:.2f} MiB per sync, trainer sync median "
              f"{out[name]['sync_median_s'] * 1e3:.1f} ms, receive{' + merge' if lora else ''} "
              f"{out[name]['receive_median_s'] * 1e3:.1f} ms", flush=True)
    out["bytes_ratio_adapters_over_full"] = out["adapters"]["bytes"] / out["full"]["bytes"]
    out["time_ratio_adapters_over_full"] = out["adapters"]["sync_median_s"] / out["full"]["sync_median_s"]
    return out


def main(argv: list[str] | None = None, zygote=None) -> dict:
    """The benchmark; its report (``--_sender``: a sender, which exits). ``zygote``: the
    `support.zygote.Zygote` to fork (c) and (d)'s processes from (the parts then default to
    `SHARED_ZYGOTE_PARTS`); None: one of this run's, started when they run."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="< 1 minute; reports only")
    size.add_argument("--smoke", action="store_true", help="every part at its smallest (one repetition, a "
                      "one-layer set, one update, short windows): the report's keys, not its figures")
    ap.add_argument("--part", nargs="+", choices=PARTS + ("all",),
                    help="the parts to run (default all; in bench/shared_zygote.py all but stall)")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions per mode (a) and layout (c)")
    ap.add_argument("--big-layers", type=int, default=None, help="layers of the Qwen3-shaped random set (a); "
                    "default 20 (1.32 B parameters), --quick 6 (0.61 B)")
    ap.add_argument("--big-vocab", type=int, default=151936, help="vocabulary of the random set (a)")
    weight_stall.add_arguments(ap)
    ap.add_argument("--_sender", choices=("bandwidth", "stall"), help=argparse.SUPPRESS)
    ap.add_argument("--_port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--_store-port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.part = args.part or (SHARED_ZYGOTE_PARTS if zygote is not None else ["all"])
    args.part = set(PARTS) if "all" in args.part else set(args.part)
    if args.smoke:
        args.reps, args.big_layers, args.big_vocab = 1, 1, 4096
    args.reps = args.reps or (2 if args.quick else 7)
    args.big_layers = args.big_layers or (6 if args.quick else 20)
    weight_stall.sizes(args)
    if args._sender == "bandwidth":
        bandwidth_sender("127.0.0.1", args._port, args.big_layers, args.big_vocab, args.reps)
        sys.exit(0)
    if args._sender == "stall":
        stall_sender("127.0.0.1", args._port, args._store_port, args.model, args.updates, pin=not args.smoke)
        sys.exit(0)
    t0 = time.monotonic()
    with ExitStack() as own:
        if zygote is None and args.part & {"layouts", "lora"}:  # here: it dies with the thread that starts it
            from support.layout_check import start_zygote

            log = Path(tempfile.mkdtemp(prefix="tf-weight-sync-")) / "zygote.log"
            own.callback(shutil.rmtree, log.parent, ignore_errors=True)  # after the zygote's close
            zygote = own.enter_context(start_zygote(log))
        return measure(args, t0, {"zygote": zygote})  # + layout_check runs, by (tp, ep, lora)


def measure(args, t0: float, done: dict) -> dict:
    """Parts (a) to (d) as ``args.part`` says; smoke: the layout and LoRA runs start at once, beside (a) and (b)."""
    wanted = {k for part in ("layouts", "lora") if args.smoke and part in args.part for k in LAYOUT_RUNS[part]}
    pool = ThreadPoolExecutor(max(1, len(wanted)))  # megatron-core ranks, no timing checked
    early = {k: pool.submit(layout_check, done["zygote"], args.reps, *k) for k in wanted}
    pool.shutdown(wait=False)
    out = {"bench": "weight_sync", "quick": args.quick, "model": args.model, "bucket_bytes": BUCKET_BYTES}
    if "bandwidth" in args.part:
        out["bandwidth"] = bandwidth(args.big_layers, args.big_vocab, args.reps)
        out["bandwidth_target"] = "packed GB/s >= 0.8 x single-tensor GB/s on the big set of >= 1 B parameters"
        out["bandwidth_met"] = (out["bandwidth"]["big_params"] >= 10**9
                                and out["bandwidth"]["sets"]["big"]["ratio"] >= 0.8)
    if "stall" in args.part:
        out.update(asyncio.run(weight_stall.alone(args)))
    done.update({key: future.result() for key, future in early.items()})
    if "layouts" in args.part:
        out["layouts"] = layouts(args.reps, done)
    if "lora" in args.part:
        out["lora"] = lora_sync(args.reps, done)
    out["machine_load_1min"] = os.getloadavg()[0]
    out["wall_s"] = time.monotonic() - t0
    return out


if __name__ == "__main__":
    from leftovers import no_process_left  # bench/ is this script's directory

    if "--_sender" in sys.argv:  # a sender: the benchmark's process checks for leftovers, its own included
        main()
    with no_process_left():
        print(json.dumps(main()))
