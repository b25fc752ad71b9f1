"""Trainer oracle tests: megatron-core on CPU/gloo against Hugging Face transformers and itself.

Multi-rank scenarios run this file as a script (``python tests/trainer/test_trainer.py SCENARIO ...``) in
fresh processes (megatron's parallel state is process-global); each rank writes its results as
safetensors/JSON into a directory the test reads back. Tolerances are asserted and printed.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from pipeline.launch.rendezvous import free_port
from support.oracle import hf_logprobs, make_samples, sharpened_checkpoint

REPO = Path(__file__).resolve().parents[2]
LAUNCH_TIMEOUT_S = 240

# Tolerances (float32 everywhere): achieved values are printed by the tests.
HF_LOGPROB_TOL = 1e-4  # max |megatron - transformers| per-token logprob
LAYOUT_REL_TOL = 1e-4  # max |g_parallel - g_single| / max |g_single|, and loss


# ----------------------------------------------------------------------------- shared helpers
def perturb_behaviour(samples, logprobs, seed):
    rng = np.random.default_rng(seed)
    for s, lp in zip(samples, logprobs):
        s.behaviour_logprobs = (lp + rng.normal(0, 0.1, len(lp))).astype(np.float32)


def launch(scenario: str, world: int, outdir: Path, args: dict, script: Path = Path(__file__)) -> None:
    """Run ``scenario`` of ``script`` on ``world`` ranks (gloo), failing with the ranks' stderr."""
    port = free_port("127.0.0.1")
    outdir.mkdir(parents=True, exist_ok=True)
    procs = []
    for rank in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE=str(world), OMP_NUM_THREADS="1", PYTHONPATH=f"{REPO}{os.pathsep}{REPO / 'tests'}",
                   PYTHONWARNINGS="ignore")
        log = open(outdir / f"rank{rank}.log", "w")
        procs.append((subprocess.Popen([sys.executable, str(script), scenario, str(outdir), json.dumps(args)],
                                       env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO), log))
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    try:
        for proc, _ in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    failed = [(r, p.returncode) for r, (p, _) in enumerate(procs) if p.returncode != 0]
    if failed:
        tails = "\n".join(f"--- rank {r} (rc {rc})\n" + (outdir / f"rank{r}.log").read_text()[-3000:]
                          for r, rc in failed)
        raise AssertionError(f"scenario {scenario} failed on ranks {failed}:\n{tails}")


# ----------------------------------------------------------------------------- scenarios (ranks)
def _trainer(args, **overrides):
    from pipeline.trainer.config import LossConfig, ParallelConfig, TrainerConfig
    from pipeline.trainer.engine import Trainer

    cfg = TrainerConfig(model_dir=args["model_dir"], parallel=ParallelConfig(**args.get("parallel", {})),
                        loss=LossConfig(**args.get("loss", {})), lr=args.get("lr", 1e-3),
                        grad_clip=0.0, micro_batch_tokens=args.get("micro_batch_tokens", 96),
                        **overrides)
    return Trainer(cfg)


def _dp_share(samples):
    from megatron.core import parallel_state as ps

    return samples[ps.get_data_parallel_rank()::ps.get_data_parallel_world_size()]


def scenario_oracle(outdir: Path, args: dict) -> None:
    """logprobs before a step, one step, logprobs after, HF export, exact weight round trip."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from pipeline.trainer.model import iter_hf_weights

    trainer = _trainer(args)
    samples = make_samples(args["seed"], args["n"], trainer.hf_config.vocab_size)
    before = trainer.logprobs(samples)
    loaded = dict(iter_hf_weights(trainer.model, trainer.hf_config))
    with safe_open(str(Path(args["model_dir"]) / "model.safetensors"), "pt") as f:
        roundtrip = max(float((f.get_tensor(k) - v).abs().max()) for k, v in loaded.items())
        assert set(f.keys()) == set(loaded), "exported names differ from the checkpoint's"
    perturb_behaviour(samples, before, args["seed"])
    metrics = trainer.train_step(samples)
    after = trainer.logprobs(samples)
    trainer.export_hf(outdir / "export")
    save_file({f"before.{i}": torch.from_numpy(a) for i, a in enumerate(before)}
              | {f"after.{i}": torch.from_numpy(a) for i, a in enumerate(after)},
              str(outdir / "logprobs.safetensors"))
    (outdir / "result.json").write_text(json.dumps({"metrics": metrics, "roundtrip": roundtrip}))
    trainer.close()


def scenario_layout(outdir: Path, args: dict) -> None:
    """Two optimizer steps; record losses and the full (gathered) gradients of step 1."""
    import torch
    from safetensors.torch import save_file

    from pipeline.trainer.model import iter_hf_weights

    trainer = _trainer(args)
    samples = make_samples(args["seed"], args["n"], trainer.hf_config.vocab_size)
    mine = _dp_share(samples)
    base = trainer.logprobs(mine)
    for s, lp in zip(mine, base):  # behaviour near the policy, so the clip is sometimes active
        s.behaviour_logprobs = (lp + 0.1 * np.sign(np.sin(np.arange(len(lp)) + s.group_id))).astype(np.float32)
    m1 = trainer.train_step(mine)
    grads = dict(iter_hf_weights(trainer.model, trainer.hf_config, grads=True))
    m2 = trainer.train_step(mine)
    if torch.distributed.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in grads.items()}, str(outdir / "grads.safetensors"))
        (outdir / "result.json").write_text(json.dumps({"step1": m1, "step2": m2}))
    trainer.close()


def scenario_checkpoint(outdir: Path, args: dict) -> None:
    """save after step 1; step 2; load; step 2 again: weights, metrics and RNG must be identical."""
    import torch

    trainer = _trainer(args)
    if args.get("group_step_adam"):  # a fused Adam's bookkeeping (step per group), on CPU
        from support.group_step_adam import GroupStepAdam
        trainer.optimizer = GroupStepAdam(trainer.trainable(), lr=args.get("lr", 1e-3))
    samples = make_samples(args["seed"], args["n"], trainer.hf_config.vocab_size)
    perturb_behaviour(samples, trainer.logprobs(samples), 1)
    trainer.train_step(samples)
    trainer.save(outdir / "ckpt")
    from pipeline.trainer.model import iter_hf_weights
    saved_weights = dict(iter_hf_weights(trainer.model, trainer.hf_config))  # the model's own (bf16) values
    masters = getattr(trainer, "masters", None)  # fp32 copies of a bf16 model (pipeline/trainer/masters.py)
    saved_masters = [m.detach().clone() for m in masters.masters] if masters is not None else []
    rng_draw = torch.rand(4)
    m_direct = trainer.train_step(samples)
    w_direct = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.load(outdir / "ckpt")
    masters_equal = all(torch.equal(m, s) for m, s in zip(masters.masters, saved_masters)) if masters else None
    rng_equal = bool(torch.equal(torch.rand(4), rng_draw))
    m_resumed = trainer.train_step(samples)
    w_diff = max(float((p.detach() - w_direct[n]).abs().max()) for n, p in trainer.model.named_parameters())
    keys = ["loss", "clip_fraction", "grad_norm", "kl", "entropy"]
    (outdir / "result.json").write_text(json.dumps({
        "inputs_untouched": all(s.advantage is None for s in samples),
        "rng_equal": rng_equal, "weight_diff": w_diff,
        "adam_step": json.loads((outdir / "ckpt" / "trainer.json").read_text())["adam_step"],
        "masters_restored": masters_equal, "stored_beyond_model": _stored_differs(outdir / "ckpt", saved_weights),
        "metrics_direct": [m_direct[k] for k in keys], "metrics_resumed": [m_resumed[k] for k in keys]}))
    trainer.close()


def _stored_differs(ckpt: Path, weights: dict) -> bool:
    """Whether any stored weight differs from the model's parameter at the save (fp32 masters of
    bf16 parameters do, after a step, almost surely)."""
    import torch
    from safetensors.torch import load_file

    return any(not torch.equal(t, weights[n].float())
               for f in sorted(ckpt.glob("model-r*.safetensors")) for n, t in load_file(str(f)).items())


def scenario_decoupled(outdir: Path, args: dict) -> None:
    """Decoupled PPO (recomputed proximal policy), 2 mini-batches, KL to the reference model."""
    trainer = _trainer(args, recompute_proximal=True, mini_batches=2)
    samples = make_samples(args["seed"], args["n"], trainer.hf_config.vocab_size)
    perturb_behaviour(samples, trainer.logprobs(samples), 2)
    first = trainer.train_step(samples)
    ref_now = trainer.logprobs(samples, reference=True)
    second = trainer.train_step(samples)
    (outdir / "result.json").write_text(json.dumps({
        "first": first, "second": second,
        "reference_is_initial": bool(np.allclose(np.concatenate(ref_now),
                                                 np.concatenate([s.behaviour_logprobs for s in samples]),
                                                 atol=0.5))}))
    trainer.close()


# ----------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    return {kind: sharpened_checkpoint(kind, root / kind) for kind in ("dense", "moe")}


def test_padded_layout_scatter_gather_round_trip():
    import torch

    from pipeline.trainer.layout import PaddedLayout

    samples = make_samples(0, 9, 100)
    for s in samples:
        s.advantage = 0.5
        s.behaviour_logprobs = -np.arange(1, len(s.completion_ids) + 1, dtype=np.float32)
    layout = PaddedLayout(micro_batch_tokens=40, pad_multiple=2)
    mbs = layout.micro_batches(samples)
    seen = sorted(i for mb in mbs for i in mb.sample_index)
    assert seen == list(range(len(samples)))
    assert sum(mb.tokens for mb in mbs) == sum(len(s.completion_ids) for s in samples)
    for mb in mbs:
        assert mb.input_ids.shape[1] % 2 == 0
        assert mb.input_ids.numel() <= 40 or len(mb.sample_index) == 1
        for row, i in enumerate(mb.sample_index):
            s = samples[i]
            full = np.concatenate([s.prompt_ids, s.completion_ids])
            n = len(full) - 1
            assert mb.input_ids[row, :n].tolist() == full[:-1].tolist()
            masked = mb.labels[row][mb.loss_mask[row] > 0]
            assert masked.tolist() == s.completion_ids.tolist()
        back = layout.gather(mb, mb.extras["behaviour"])
        for i, arr in zip(mb.sample_index, back):
            np.testing.assert_array_equal(arr, samples[i].behaviour_logprobs)
        assert torch.all(mb.extras["behaviour"][mb.loss_mask == 0] == 0)


def test_train_sample_rejects_mismatched_logprobs():
    from pipeline.trainer.layout import TrainSample

    with pytest.raises(ValueError, match="one logprob per token"):
        TrainSample([1, 2], [3, 4, 5], [0.0, 0.0])


def test_allgather_dispatcher_refused_with_expert_parallelism(checkpoints):
    from pipeline.trainer.config import ParallelConfig
    from pipeline.trainer.model import load_hf_config, transformer_config

    config = load_hf_config(checkpoints["moe"])
    with pytest.raises(ValueError, match="alltoall"):
        transformer_config(config, ParallelConfig(ep=2, moe_dispatcher="allgather"))


def test_cpu_patches_idempotent():
    """In a fresh process (the patches change torch.cuda process-wide)."""
    code = ("import json, torch; from megatron_patches import apply_patches; a = apply_patches(); "
            "b = apply_patches(); print(json.dumps([a, b, str(torch.cuda.current_device())]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=REPO, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert out.returncode == 0, out.stderr[-2000:]
    first, second, device = json.loads(out.stdout.strip().splitlines()[-1])
    assert first == second and "moe_te_general_gemm" in first
    assert device == "cpu" and "cuda_rng" in first


def test_a_trainer_process_skips_megatrons_wandb_import_and_leaves_no_temp_dirs(tmp_path):
    """A trainer rank (`pipeline.roles.trainer.main`) imports megatron-core without W&B: none of
    wandb's temp directories is left when it ends through ``os._exit``, as a role does."""
    code = ("import os; from pipeline.roles.trainer import skip_wandb_import; skip_wandb_import(); "
            "import megatron.core.timers as t; import sys; print(t.wandb, sys.modules['wandb']); os._exit(0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=REPO, env=dict(os.environ, PYTHONWARNINGS="ignore", TMPDIR=str(tmp_path)))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["None", "None"]
    left = [p.name for p in tmp_path.iterdir() if "wandb" in p.name]  # torch's inductor cache may be there
    assert not left, f"wandb's temp directories: {left}"  # with wandb imported: *wandb-media, *wandb-artifacts


@pytest.mark.engine
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_logprobs_match_transformers_and_export_round_trips(kind, checkpoints, tmp_path):
    from safetensors import safe_open

    args = {"model_dir": str(checkpoints[kind]), "seed": 3, "n": 8}
    launch("oracle", 1, tmp_path, args)
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["roundtrip"] == 0.0, "HF -> megatron -> HF changed weights"
    samples = make_samples(3, 8, 512)
    with safe_open(str(tmp_path / "logprobs.safetensors"), "np") as f:
        before = [f.get_tensor(f"before.{i}") for i in range(8)]
        after = [f.get_tensor(f"after.{i}") for i in range(8)]
    ref_before = hf_logprobs(checkpoints[kind], samples)
    ref_after = hf_logprobs(tmp_path / "export", samples)
    err_before = max(float(np.abs(a - b).max()) for a, b in zip(before, ref_before))
    err_after = max(float(np.abs(a - b).max()) for a, b in zip(after, ref_after))
    moved = max(float(np.abs(a - b).max()) for a, b in zip(before, after))
    print(f"\n[{kind}] max |megatron - HF| logprob: {err_before:.2e} (loaded), {err_after:.2e} "
          f"(exported after a step); the step moved logprobs by {moved:.3f}")
    assert float(np.mean(np.concatenate(ref_before))) < -1.0  # not a degenerate model
    assert err_before < HF_LOGPROB_TOL and err_after < HF_LOGPROB_TOL
    assert moved > 10 * HF_LOGPROB_TOL, "the train step did not change the model"


def _layout_run(outdir, model_dir, world, parallel):
    from safetensors.torch import load_file

    args = {"model_dir": str(model_dir), "seed": 11, "n": 12, "parallel": parallel,
            "micro_batch_tokens": 64}
    launch("layout", world, outdir, args)
    return json.loads((outdir / "result.json").read_text()), load_file(str(outdir / "grads.safetensors"))


@pytest.fixture(scope="module")
def single_rank_runs(checkpoints, tmp_path_factory):
    """The TP=1/EP=1 reference of each model, run once per module."""
    cache = {}

    def get(kind):
        if kind not in cache:
            cache[kind] = _layout_run(tmp_path_factory.mktemp(f"single-{kind}"), checkpoints[kind], 1, {})
        return cache[kind]
    return get


@pytest.mark.engine
@pytest.mark.parametrize("kind,parallel", [
    ("dense", {"tp": 2}),
    ("moe", {"ep": 2}),
    ("moe", {"tp": 2}),
], ids=["dense-tp2", "moe-ep2-alltoall", "moe-tp2-sp"])
def test_parallel_layout_matches_single_rank(kind, parallel, checkpoints, single_rank_runs, tmp_path):
    ref, ref_grads = single_rank_runs(kind)
    got, grads = _layout_run(tmp_path, checkpoints[kind], 2, parallel)
    assert set(grads) == set(ref_grads)
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    grad_err = max(float((grads[k] - ref_grads[k]).abs().max()) for k in ref_grads) / scale
    loss_err = [abs(got[s]["loss"] - ref[s]["loss"]) / max(abs(ref[s]["loss"]), 1e-6)
                for s in ("step1", "step2")]
    norm_err = abs(got["step1"]["grad_norm"] - ref["step1"]["grad_norm"]) / ref["step1"]["grad_norm"]
    print(f"\n[{kind} {parallel}] rel grad err {grad_err:.2e}, rel loss err step1 {loss_err[0]:.2e} "
          f"step2 {loss_err[1]:.2e}, grad norm {norm_err:.2e}; tokens {ref['step1']['tokens']:.0f}, "
          f"{ref['step1']['tokens_per_s']:.0f} tokens/s single rank")
    assert scale > 0 and ref["step1"]["tokens"] == got["step1"]["tokens"]
    assert grad_err < LAYOUT_REL_TOL
    assert max(loss_err) < LAYOUT_REL_TOL
    assert norm_err < LAYOUT_REL_TOL, f"global grad norm differs: {norm_err:.2e}"


@pytest.mark.engine
def test_decoupled_ppo_with_kl_and_mini_batches(checkpoints, tmp_path):
    args = {"model_dir": str(checkpoints["dense"]), "seed": 9, "n": 8,
            "loss": {"kl_coef": 0.1, "tis_cap": 1.05}}
    launch("decoupled", 1, tmp_path, args)
    r = json.loads((tmp_path / "result.json").read_text())
    first, second = r["first"], r["second"]
    # behaviour = policy + N(0, 0.1) noise: some proximal/behaviour weights exceed the 1.05 cap
    assert 0 < first["tis_clip_fraction"] < 1
    # mini-batch 1 starts at the reference (KL 0), mini-batch 2 after one update (KL > 0)
    assert 0 < first["kl"] < second["kl"]
    assert r["reference_is_initial"]


@pytest.mark.engine
def test_checkpoint_resume_is_exact(checkpoints, tmp_path):
    launch("checkpoint", 1, tmp_path, {"model_dir": str(checkpoints["moe"]), "seed": 5, "n": 8})
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["inputs_untouched"], "train_step changed the caller's samples"
    assert result["rng_equal"]
    assert result["weight_diff"] == 0.0
    assert result["metrics_resumed"] == result["metrics_direct"]


def test_checkpoint_finds_adams_step_in_param_groups(checkpoints, tmp_path):
    """A fused Adam (TE, Apex) counts steps per parameter group: the checkpoint records the step
    and the resumed step equals the direct one (the old code recorded 0 and dropped the moments)."""
    launch("checkpoint", 1, tmp_path, {"model_dir": str(checkpoints["dense"]), "seed": 5, "n": 4,
                                        "group_step_adam": True})
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["adam_step"] == 1
    assert result["weight_diff"] == 0.0
    assert result["metrics_resumed"] == result["metrics_direct"]


def test_bf16_training_keeps_fp32_masters_through_a_checkpoint(checkpoints, tmp_path):
    """bf16 parameters on the torch path: AdamW on fp32 masters; the checkpoint stores the masters
    (not the rounded weights) and the resume restores them and the next step exactly (the old code
    had no masters: every stored weight was a bf16 value)."""
    launch("checkpoint", 1, tmp_path, {"model_dir": str(checkpoints["dense"]), "seed": 5, "n": 4,
                                        "parallel": {"params_dtype": "bfloat16"}})
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["stored_beyond_model"], "the checkpoint holds the bf16 weights themselves: no fp32 masters"
    assert result["masters_restored"] is True
    assert result["weight_diff"] == 0.0
    assert result["metrics_resumed"] == result["metrics_direct"]


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)
    scenario, outdir, args = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    globals()[f"scenario_{scenario}"](outdir, args)
