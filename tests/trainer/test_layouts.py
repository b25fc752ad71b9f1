"""Four-rank trainer layouts (TP2 x EP2 at the default expert TP 1, DP2 x EP2, DP2 x TP2 with
expert TP 2) against one rank, and checkpoints that change layout, on a tiny 8-expert MoE over gloo.

The batches are replayed from a recorded rollout log (written once by the fixture with the real
HDF5 writer; behaviour logprobs from transformers, perturbed so PPO clipping is active), so every
layout trains on the same tokens. Each layout runs ``STEPS`` steps in fresh rank processes
(``tests/trainer/test_trainer.py``'s launcher) and records per-step loss, grad norm and the updated
weights (Hugging Face names); the one-rank run is the reference. At step ``SAVE_AT`` each run
saves a checkpoint; after training it reloads other layouts' checkpoints, saves them again in its
own layout (must be bit-identical: weights and Adam moments) and retrains step ``SAVE_AT`` from
them (must match the reference's weights after that step).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_trainer import launch  # noqa: E402

STEPS = 10
SAVE_AT = 5
SAMPLES_PER_STEP = 8
PARITY_TOL = 1e-5  # fp32: |loss|, relative grad norm, max |weight| difference
# lr 1e-4: Adam's first step maps a gradient element at rounding level (~1e-10, where eps = 1e-8
# dominates) to an update anywhere in (-lr, lr); layouts sum in different orders, so one such
# element differs by ~1.4% of lr (measured 1.4e-5 at lr 1e-3 on TP2 x EP2). At 1e-4 that is 1.4e-6.
LAYOUTS = {"tp1": (1, {}), "dp2ep2": (4, {"ep": 2}), "tp2ep2": (4, {"tp": 2, "ep": 2}),
           "dp2tp2": (4, {"tp": 2})}


def tiny_moe8_spec():
    from pipeline.models.tiny import TinyModelSpec

    return TinyModelSpec(kind="moe", hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                         intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                         experts_per_token=2, vocab_size=256)


def record_log(model_dir: Path, log_dir: Path) -> None:
    """A rollout log of STEPS step records, SAMPLES_PER_STEP samples each (groups of 4)."""
    from pipeline.protocol.record import RecordSchema, RolloutSample
    from pipeline.protocol.sample_batch import SampleBatch
    from pipeline.rollout_log.writer import RolloutLogWriter
    from support.oracle import hf_logprobs, make_samples

    samples = make_samples(5, STEPS * SAMPLES_PER_STEP, 256, min_len=2, max_len=10)
    policy = hf_logprobs(model_dir, samples)
    rng = np.random.default_rng(0)
    schema = RecordSchema()
    records = [RolloutSample(
        group_id=i // 4, sample_index=i % 4, prompt_id=i // 4, attempt=0, prompt_ids=s.prompt_ids,
        completion_ids=s.completion_ids, logprobs=lp + rng.normal(0, 0.15, len(lp)).astype(np.float32),
        versions=np.zeros(len(lp), np.int32), finish_reason="stop", reward=s.reward, schema=schema)
        for i, (s, lp) in enumerate(zip(samples, policy))]
    with RolloutLogWriter(log_dir, schema, "parity", {"group_size": 4}) as w:
        rows = w.append_samples(SampleBatch.from_samples(records, schema))
        for step in range(STEPS):
            mine = rows[step * SAMPLES_PER_STEP:(step + 1) * SAMPLES_PER_STEP]
            w.append_steps(step, mine, np.arange(len(mine)) % 2, step, 0.0)
        w.flush()


# ----------------------------------------------------------------------------- rank scenario
def _step_samples(log, step):
    from megatron.core import parallel_state as ps

    from pipeline.trainer.layout import TrainSample

    batch = log.read(log.step_rows()[step])
    samples = [TrainSample(batch.prompt(i), batch.tokens("completion_ids", i), batch.tokens("logprobs", i),
                           reward=float(batch.columns["reward"][i]), group_id=int(batch.columns["group_id"][i]))
               for i in range(len(batch))]
    return samples[ps.get_data_parallel_rank()::ps.get_data_parallel_world_size()]


def scenario_parity(outdir: Path, args: dict) -> None:
    """Train ``steps`` steps from the log (checkpoint at SAVE_AT), then reload, re-save and retrain
    step SAVE_AT from each of ``reload``'s checkpoints."""
    import torch
    from safetensors.torch import save_file

    from pipeline.rollout_log.reader import RolloutLog
    from pipeline.trainer.config import ParallelConfig, TrainerConfig
    from pipeline.trainer.engine import Trainer
    from pipeline.trainer.model import iter_hf_weights

    trainer = Trainer(TrainerConfig(model_dir=args["model_dir"], parallel=ParallelConfig(**args["parallel"]),
                                    lr=1e-4, grad_clip=1.0, micro_batch_tokens=48))
    root = torch.distributed.get_rank() == 0

    def record(tag):
        weights = {k: v.contiguous() for k, v in iter_hf_weights(trainer.model, trainer.hf_config)}
        if root:
            save_file(weights, str(outdir / f"weights-{tag}.safetensors"))

    metrics = []
    with RolloutLog.open(Path(args["log"])) as log:
        for step in range(args["steps"]):
            if step == SAVE_AT:
                trainer.save(Path(args["save"]))
            metrics.append(trainer.train_step(_step_samples(log, step)))
            record(step)
        resumed = []
        for source in args["reload"]:
            trainer.load(Path(source))
            trainer.save(Path(f"{source}-as-{args['name']}"))
            resumed.append(trainer.train_step(_step_samples(log, SAVE_AT)))
            record(f"{Path(source).name}-resumed")
    if root:
        (outdir / "result.json").write_text(json.dumps({"metrics": metrics, "resumed": resumed}))
    trainer.close()


# ----------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """Run every layout once (reference first); later runs reload earlier runs' checkpoints."""
    from support.oracle import sharpened_checkpoint

    root = tmp_path_factory.mktemp("layouts")
    model_dir = sharpened_checkpoint("moe8-small", root / "model", spec=tiny_moe8_spec())
    record_log(model_dir, root / "rollouts")
    plan = [("tp1", STEPS, []), ("dp2ep2", STEPS, ["tp1"]), ("tp2ep2", STEPS, ["tp1", "dp2ep2"]),
            ("dp2tp2", STEPS, ["tp2ep2"]),
            ("tp1", 0, ["tp2ep2"]), ("dp2ep2", 0, ["tp2ep2"])]  # the reverse directions
    out = {}
    for i, (name, steps, reload) in enumerate(plan):
        world, parallel = LAYOUTS[name]
        outdir = root / f"run{i}-{name}"
        launch("parity", world, outdir, {
            "model_dir": str(model_dir), "log": str(root / "rollouts"), "parallel": parallel,
            "steps": steps, "save": str(root / f"ckpt-{name}"), "name": name,
            "reload": [str(root / f"ckpt-{r}") for r in reload]}, script=Path(__file__))
        out[(name, steps)] = outdir
    return root, out


def _weights(path):
    from safetensors.torch import load_file

    return load_file(str(path))


def max_diff(a, b):
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def changed_tensors(original: Path, resaved: Path) -> list[tuple[str, str]]:
    """(file prefix, tensor name) of every weight or Adam moment that differs between a checkpoint
    and its copy saved again on another layout (the two must name the same tensors)."""
    from safetensors import safe_open

    changed = []
    for prefix in ("model", "exp_avg", "exp_avg_sq"):
        index = json.loads((original / f"{prefix}.safetensors.index.json").read_text())["weight_map"]
        again = json.loads((resaved / f"{prefix}.safetensors.index.json").read_text())["weight_map"]
        assert set(index) == set(again)
        for name, file in index.items():
            with safe_open(str(original / file), "pt") as a, safe_open(str(resaved / again[name]), "pt") as b:
                if not np.array_equal(a.get_tensor(name).numpy(), b.get_tensor(name).numpy()):
                    changed.append((prefix, name))
    return changed


@pytest.mark.engine
@pytest.mark.parametrize("layout", ["tp2ep2", "dp2ep2", "dp2tp2"])
def test_four_rank_layout_matches_one_rank_for_ten_steps(layout, matrix):
    from pipeline.trainer.config import ParallelConfig

    assert ParallelConfig(**LAYOUTS[layout][1]).expert_tp == {"tp2ep2": 1, "dp2ep2": 1, "dp2tp2": 2}[layout]
    _, runs = matrix
    ref_dir, got_dir = runs[("tp1", STEPS)], runs[(layout, STEPS)]
    ref = json.loads((ref_dir / "result.json").read_text())["metrics"]
    got = json.loads((got_dir / "result.json").read_text())["metrics"]
    loss_err = max(abs(a["loss"] - b["loss"]) for a, b in zip(ref, got))
    norm_err = max(abs(a["grad_norm"] - b["grad_norm"]) / a["grad_norm"] for a, b in zip(ref, got))
    weight_err = max(max_diff(_weights(ref_dir / f"weights-{k}.safetensors"),
                               _weights(got_dir / f"weights-{k}.safetensors")) for k in range(STEPS))
    moved = max_diff(_weights(ref_dir / "weights-0.safetensors"),
                      _weights(ref_dir / f"weights-{STEPS - 1}.safetensors"))
    t_ref = np.mean([m["step_time_s"] for m in ref[1:]])
    t_got = np.mean([m["step_time_s"] for m in got[1:]])
    print(f"\n[{layout}] {STEPS} steps: max |loss err| {loss_err:.2e}, max rel grad-norm err "
          f"{norm_err:.2e}, max |weight err| {weight_err:.2e} (weights moved {moved:.3f}); "
          f"time/step {t_got * 1e3:.0f} ms vs {t_ref * 1e3:.0f} ms on 1 rank ({t_got / t_ref:.2f}x)")
    assert len(got) == len(ref) == STEPS
    assert [m["tokens"] for m in got] == [m["tokens"] for m in ref]
    # decoupled PPO with one mini-batch: the ratio is 1 at the step, so the importance weights
    # (proximal / behaviour) are what make the loss more than plain policy gradient here
    assert any(abs(m["is_weight_mean"] - 1.0) > 1e-3 for m in ref), "importance weights all 1: a weak test"
    assert moved > 20 * PARITY_TOL
    assert loss_err < PARITY_TOL and norm_err < PARITY_TOL and weight_err < PARITY_TOL


@pytest.mark.engine
@pytest.mark.parametrize("source,target", [("tp2ep2", "tp1"), ("tp2ep2", "dp2ep2"), ("tp1", "tp2ep2"),
                                           ("dp2ep2", "tp2ep2"), ("tp2ep2", "dp2tp2")])
def test_checkpoint_resumes_on_another_layout_exactly(source, target, matrix):
    root, runs = matrix
    original, resaved = root / f"ckpt-{source}", root / f"ckpt-{source}-as-{target}"
    changed = changed_tensors(original, resaved)
    meta = [json.loads((d / "trainer.json").read_text()) for d in (original, resaved)]
    assert meta[0]["adam_step"] == meta[1]["adam_step"] == SAVE_AT
    assert meta[0]["steps"] == meta[1]["steps"] == SAVE_AT
    assert not changed, f"{source} -> {target}: weights or Adam moments changed in the round trip: {changed[:5]}"
    target_dir = next(d for (n, _), d in runs.items() if n == target and
                      (d / f"weights-ckpt-{source}-resumed.safetensors").exists())
    # the same step taken by the layout that saved the checkpoint
    ref = _weights(runs[(source, STEPS)] / f"weights-{SAVE_AT}.safetensors")
    err = max_diff(ref, _weights(target_dir / f"weights-ckpt-{source}-resumed.safetensors"))
    print(f"\n[{source} -> {target}] state bit-identical after load+save; step {SAVE_AT} retrained "
          f"from it: max |weight - {source}'s own step {SAVE_AT}| {err:.2e}")
    assert err < PARITY_TOL


if __name__ == "__main__":
    scenario = {"parity": scenario_parity}[sys.argv[1]]
    scenario(Path(sys.argv[2]), json.loads(sys.argv[3]))
