"""Pipeline- and context-parallel trainer layouts (PP2 and CP2 on 2 gloo ranks; PP2 x TP2, PP2 x
EP2 on 4; CP2 x EP2: test_context_parallel.py) against one rank, and checkpoints that move between
PP, CP and one-rank layouts, on a tiny 8-expert MoE with 2 layers (one per stage).

Every run trains ``STEPS`` steps on the same batches: 8 samples a step with recorded routing
replayed (Keep Routing, random recorded experts, so replay visibly changes the routing), a
top-k sampling mask, decoupled PPO (``recompute_proximal``: the old-policy logprobs are a
forward-only pass through the pipeline) and a KL term (the reference model's logprobs: another
pipeline pass). Micro-batches of at most 48 padded tokens give each pipeline 2-4 micro-batches.
Each run records per-step metrics, the gradients of step 0 and the weights after every step as
Hugging Face tensor sets (each stage writes its own layers); the one-rank run is the reference.
At step ``SAVE_AT`` each run saves a checkpoint; after training it loads the other layouts'
checkpoints, saves them again (must be bit-identical) and retrains step ``SAVE_AT`` from them.

Cost on 2 cores: the two-rank plan (one rank, PP2, CP2, checkpoints tp1 -> PP2 -> CP2 -> tp1) ~50 s
in the default suite; the 4-rank matrix (``slow``) ~4 min.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_layouts import changed_tensors, max_diff, tiny_moe8_spec  # noqa: E402
from test_trainer import launch  # noqa: E402

STEPS = 3
SAVE_AT = 1
SAMPLES_PER_STEP = 8
PARITY_TOL = 1e-5  # fp32
# lr 3e-5: Adam's first step maps a gradient element at rounding level (~1e-10, where eps = 1e-8
# dominates) to an update anywhere in (-lr, lr) (test_layouts.py); the output layer's are such
# elements under vocabulary-parallel TP: 7e-6 of weight difference measured at lr 1e-4 on PP2 x TP2.
LR = 3e-5
LAYOUTS = {"tp1": (1, {}), "pp2": (2, {"pp": 2}), "pp2tp2": (4, {"pp": 2, "tp": 2}),
           "pp2ep2": (4, {"pp": 2, "ep": 2}), "cp2": (2, {"cp": 2}),
           "cp2ep2": (4, {"cp": 2, "ep": 2})}  # cp: test_context_parallel.py


def make_step_samples(step: int, experts: int, k: int, layers: int) -> list:
    """The step's samples with behaviour logprobs, recorded routing and a sampling mask (seeded)."""
    from support.oracle import make_samples

    samples = make_samples(100 + step, SAMPLES_PER_STEP, 256, min_len=2, max_len=12)
    rng = np.random.default_rng(step)
    for s in samples:
        c, n = len(s.completion_ids), len(s.prompt_ids) + len(s.completion_ids) - 1
        s.behaviour_logprobs = -rng.uniform(4.0, 6.0, c).astype(np.float32)
        s.routed_experts = np.stack([np.stack([rng.choice(experts, k, replace=False) for _ in range(layers)])
                                     for _ in range(n)])
        mask = np.full((c, 6), -1, dtype=np.int64)
        for j, token in enumerate(s.completion_ids):  # the sampled token and up to 5 others kept
            others = rng.choice(256, int(rng.integers(0, 6)), replace=False)
            kept = np.unique(np.concatenate([[token], others]))
            mask[j, :len(kept)] = kept
        s.sampling_mask = mask
    return samples


def scenario_pipeline(outdir: Path, args: dict) -> None:
    import torch
    from megatron.core import parallel_state as ps

    from pipeline.trainer.config import LossConfig, ParallelConfig, TrainerConfig
    from pipeline.trainer.engine import Trainer
    from pipeline.trainer.hf_shards import write_tensor_set

    trainer = Trainer(TrainerConfig(
        model_dir=args["model_dir"], parallel=ParallelConfig(**args["parallel"]), lr=LR, grad_clip=1.0,
        micro_batch_tokens=48, routing_replay=True, recompute_proximal=True, loss=LossConfig(kl_coef=0.05)))
    hf = trainer.hf_config

    def samples_of(step):
        mine = make_step_samples(step, hf.num_experts, hf.num_experts_per_tok, hf.num_hidden_layers)
        return mine[ps.get_data_parallel_rank()::ps.get_data_parallel_world_size()]

    def record(tag, value_of=lambda n, p: p):
        write_tensor_set(trainer.model, hf, outdir / tag, "model", value_of)

    metrics = []
    for step in range(args["steps"]):
        if step == SAVE_AT:
            trainer.save(Path(args["save"]))
        metrics.append(trainer.train_step(samples_of(step)))
        if step == 0:
            record("grads-0", lambda n, p: p.main_grad)
        record(f"weights-{step}")
    for source in args["reload"]:
        trainer.load(Path(source))
        trainer.save(Path(f"{source}-as-{args['name']}"))
        trainer.train_step(samples_of(SAVE_AT))
        record(f"weights-{Path(source).name}-resumed")
    if torch.distributed.get_rank() == 0:
        (outdir / "result.json").write_text(json.dumps({"metrics": metrics}))
    trainer.close()


def run_plan(root: Path, plan) -> dict:
    """Run each (layout, steps, layouts whose checkpoints to reload) in order on one model."""
    from support.oracle import sharpened_checkpoint

    model_dir = sharpened_checkpoint("moe8-small", root / "model", spec=tiny_moe8_spec())
    out = {}
    for i, (name, steps, reload) in enumerate(plan):
        world, parallel = LAYOUTS[name]
        outdir = root / f"run{i}-{name}"
        launch("pipeline", world, outdir, {
            "model_dir": str(model_dir), "parallel": parallel, "steps": steps, "name": name,
            "save": str(root / f"ckpt-{name}"), "reload": [str(root / f"ckpt-{r}") for r in reload]},
            script=Path(__file__))
        out[(name, steps)] = outdir
    return out


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pp2")
    return root, run_plan(root, [("tp1", STEPS, []), ("pp2", STEPS, ["tp1"]), ("cp2", STEPS, ["pp2"]),
                                 ("tp1", 0, ["pp2", "cp2"])])


@pytest.fixture(scope="module")
def four_rank_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pp4")
    return root, run_plan(root, [("tp1", STEPS, []), ("pp2tp2", STEPS, ["tp1"]), ("pp2ep2", STEPS, ["pp2tp2"]),
                                 ("tp1", 0, ["pp2ep2"])])


def _tensors(directory: Path) -> dict:
    from safetensors.torch import load_file

    return {k: v for f in sorted(directory.glob("model-r*.safetensors")) for k, v in load_file(str(f)).items()}


def check_layout(layout, runs):
    ref_dir, got_dir = runs[("tp1", STEPS)], runs[(layout, STEPS)]
    ref = json.loads((ref_dir / "result.json").read_text())["metrics"]
    got = json.loads((got_dir / "result.json").read_text())["metrics"]
    loss_err = max(abs(a["loss"] - b["loss"]) for a, b in zip(ref, got))
    norm_err = max(abs(a["grad_norm"] - b["grad_norm"]) / a["grad_norm"] for a, b in zip(ref, got))
    grads_ref = _tensors(ref_dir / "grads-0")
    grad_err = max_diff(grads_ref, _tensors(got_dir / "grads-0"))
    grad_scale = max(float(v.abs().max()) for v in grads_ref.values())
    weight_err = max(max_diff(_tensors(ref_dir / f"weights-{k}"), _tensors(got_dir / f"weights-{k}"))
                     for k in range(STEPS))
    print(f"\n[{layout}] {STEPS} steps: max |loss err| {loss_err:.2e}, rel grad-norm err {norm_err:.2e}, "
          f"max |grad err| {grad_err:.2e} (max |grad| {grad_scale:.2e}), max |weight err| {weight_err:.2e}")
    assert [m["tokens"] for m in got] == [m["tokens"] for m in ref]
    assert all(m["kl"] > 0 for m in ref[1:]) and any(abs(m["is_weight_mean"] - 1) > 1e-3 for m in ref)
    # replay is on: the router's own choice differs from the random recorded experts
    assert all(m["routing_differ_frac"] > 0.5 for m in ref)
    for key in ("routing_differ_frac", "routing_differ_token_frac", "moe_load_l1_e0", "entropy"):
        assert all(abs(a[key] - b[key]) < PARITY_TOL for a, b in zip(ref, got)), key
    assert grad_scale > 100 * PARITY_TOL
    assert loss_err < PARITY_TOL and norm_err < PARITY_TOL and grad_err < PARITY_TOL and weight_err < PARITY_TOL


def check_checkpoint_move(source, target, root, runs):
    changed = changed_tensors(root / f"ckpt-{source}", root / f"ckpt-{source}-as-{target}")
    assert not changed, f"{source} -> {target}: weights or Adam moments changed in the round trip: {changed[:5]}"
    target_dir = next(d for (n, _), d in runs.items() if n == target and (d / f"weights-ckpt-{source}-resumed").exists())
    ref = _tensors(runs[(source, STEPS)] / f"weights-{SAVE_AT}")
    err = max_diff(ref, _tensors(target_dir / f"weights-ckpt-{source}-resumed"))
    print(f"\n[{source} -> {target}] bit-identical after load + save; step {SAVE_AT} retrained: "
          f"max |weight err| {err:.2e}")
    assert err < PARITY_TOL


def test_stage_rules_cover_the_model_once_with_local_layer_names():
    """Each stage's rules name its own layers 0.. locally; together they are the whole model's."""
    from pipeline.models.tiny import TinyModelSpec
    from pipeline.trainer.conversion import base_rules

    hf = TinyModelSpec(kind="moe", num_layers=4).hf_config()
    whole = base_rules(hf, 0, 1)
    stages = [base_rules(hf, 0, 1, (s, 2)) for s in range(2)]
    assert [h for rules in stages for r in rules for h in r.hf] == [h for r in whole for h in r.hf]
    second = {r.megatron: r.hf for r in stages[1]}
    assert second["decoder.layers.0.self_attention.linear_proj.weight"] == ("model.layers.2.self_attn.o_proj.weight",)
    assert "embedding.word_embeddings.weight" not in second and "output_layer.weight" in second
    assert "output_layer.weight" not in {r.megatron for r in stages[0]}


@pytest.mark.engine
def test_two_stage_pipeline_matches_one_rank_and_checkpoints_move_both_ways(two_rank_runs):
    root, runs = two_rank_runs
    check_layout("pp2", runs)
    check_checkpoint_move("tp1", "pp2", root, runs)
    check_checkpoint_move("pp2", "tp1", root, runs)


@pytest.mark.engine
def test_context_parallel_matches_one_rank_and_checkpoints_move_both_ways(two_rank_runs):
    """CP2 (`pipeline.trainer.context_parallel`): sequences of 3-23 fed tokens in 4 chunks."""
    root, runs = two_rank_runs
    check_layout("cp2", runs)
    check_checkpoint_move("pp2", "cp2", root, runs)
    check_checkpoint_move("cp2", "tp1", root, runs)


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["pp2tp2", "pp2ep2"])
def test_four_rank_pipeline_layout_matches_one_rank(layout, four_rank_runs):
    """Slow: the module's 4-rank matrix costs ~4 min on 2 cores."""
    check_layout(layout, four_rank_runs[1])


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.parametrize("source,target", [("tp1", "pp2tp2"), ("pp2tp2", "pp2ep2"), ("pp2ep2", "tp1")])
def test_checkpoint_moves_between_four_rank_pipeline_layouts_exactly(source, target, four_rank_runs):
    """Slow: shares the 4-rank matrix (~4 min on 2 cores)."""
    check_checkpoint_move(source, target, *four_rank_runs)


if __name__ == "__main__":
    scenario = {"pipeline": scenario_pipeline}[sys.argv[1]]
    scenario(Path(sys.argv[2]), json.loads(sys.argv[3]))
