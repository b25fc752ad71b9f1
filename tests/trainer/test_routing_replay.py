"""Keep Routing in the trainer: megatron-core replaying a given routing against transformers'
model forced to the same routing (an independent oracle), at EP1, EP2 and TP2 (+SP); and the
trainer's count of positions where its own router disagrees with the given routing
(``routing_differ_frac``) against the same count from transformers' own routing.

Ranks run this file as a script (megatron's parallel state is process-global); the routing is
random (not what either model would choose), so a replay that silently does nothing fails.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_trainer import launch  # noqa: E402

HF_LOGPROB_TOL = 1e-4  # as tests/trainer/test_trainer.py (float32 both sides)
SEED, N = 21, 6


def random_routing(samples, layers, experts, k, seed):
    """Distinct experts per (position, layer), for every position the trainer feeds the model."""
    rng = np.random.default_rng(seed)
    for s in samples:
        n = len(s.prompt_ids) + len(s.completion_ids) - 1
        s.routed_experts = np.argsort(rng.random((n, layers, experts)), axis=-1)[..., :k].astype(np.int16)
    return samples


def forced_hf_logprobs(model_dir, samples):
    """transformers' Qwen3-MoE with every gate returning the given experts (softmax of its own
    logits gathered there, renormalised as the model's config says)."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    gates = [layer.mlp.gate for layer in model.model.layers]
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.from_numpy(np.concatenate([s.prompt_ids, s.completion_ids]))[None]
            k = s.routed_experts.shape[-1]
            routed = np.concatenate([s.routed_experts, np.broadcast_to(np.arange(k), (1, *s.routed_experts.shape[1:]))])
            for l, gate in enumerate(gates):
                idx = torch.from_numpy(routed[:, l].astype(np.int64))

                def forward(h, gate=gate, idx=idx):
                    logits = F.linear(h.reshape(-1, gate.hidden_dim), gate.weight)
                    top = torch.softmax(logits, -1, dtype=torch.float).gather(1, idx)
                    if gate.norm_topk_prob:
                        top = top / top.sum(-1, keepdim=True)
                    return logits, top.to(logits.dtype), idx
                gate.forward = forward
            logp = model(ids).logits[0].float().log_softmax(-1)
            p = len(s.prompt_ids)
            out.append(logp[p - 1:-1].gather(-1, ids[0, p:, None])[:, 0].numpy())
    return out


def own_routing_differences(model_dir, samples):
    """(pairs, near-ties, pairs whose expert set differs): transformers' own routing of every
    position the trainer feeds against the samples' given routing."""
    from support.routing import hf_routing

    sequences = [np.concatenate([s.prompt_ids, s.completion_ids[:-1]]).tolist() for s in samples]
    pairs = ties = differ = 0
    for s, (experts, tie) in zip(samples, hf_routing(model_dir, sequences)):
        pairs += tie.size
        ties += int(tie.sum())
        differ += int((np.sort(experts, -1) != np.sort(s.routed_experts, -1)).any(-1).sum())
    return pairs, ties, differ


def scenario(outdir: Path, args: dict) -> None:
    import torch
    from megatron.core import parallel_state as ps

    from pipeline.trainer.config import ParallelConfig, TrainerConfig
    from pipeline.trainer.engine import Trainer
    from support.oracle import make_samples

    torch.set_num_threads(1)
    trainer = Trainer(TrainerConfig(model_dir=args["model_dir"], parallel=ParallelConfig(**args["parallel"]),
                                    routing_replay=True, micro_batch_tokens=96, lr=1e-3))
    hf = trainer.hf_config
    samples = random_routing(make_samples(SEED, N, hf.vocab_size), hf.num_hidden_layers, hf.num_experts,
                             hf.num_experts_per_tok, SEED)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mine = list(range(dp_rank, N, dp))
    part = [samples[i] for i in mine]
    replayed = trainer.logprobs(part)
    trainer.replayer.apply = False  # route by itself, count where it differs from the given routing
    own = trainer.logprobs(part, count_routing=True)
    differ = trainer.routing_differences()  # a collective: every rank
    trainer.replayer.apply = True
    for s, lp in zip(part, replayed):
        s.behaviour_logprobs = lp
    metrics = trainer.train_step(part)  # forward + backward under replay
    metrics["own_differ"] = differ
    if torch.distributed.get_rank() == torch.distributed.get_process_group_ranks(
            ps.get_tensor_model_parallel_group())[0]:
        np.savez(outdir / f"dp{dp_rank}.npz", index=np.array(mine),
                 **{f"replayed{j}": v for j, v in enumerate(replayed)}, **{f"own{j}": v for j, v in enumerate(own)})
        (outdir / f"dp{dp_rank}.json").write_text(json.dumps(metrics))
    trainer.close()


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    from support.oracle import sharpened_checkpoint

    return sharpened_checkpoint("moe", tmp_path_factory.mktemp("moe") / "model")


@pytest.mark.engine
@pytest.mark.parametrize("world,parallel", [(1, {}), (2, {"ep": 2}), (2, {"tp": 2})],
                         ids=["ep1", "ep2", "tp2-sp"])
def test_replayed_routing_equals_transformers_forced_to_it(moe_checkpoint, tmp_path, world, parallel):
    from support.oracle import make_samples
    from transformers import AutoConfig

    launch("replay", world, tmp_path, {"model_dir": str(moe_checkpoint), "parallel": parallel}, script=Path(__file__))
    hf = AutoConfig.from_pretrained(str(moe_checkpoint))
    samples = random_routing(make_samples(SEED, N, hf.vocab_size), hf.num_hidden_layers, hf.num_experts,
                             hf.num_experts_per_tok, SEED)
    want = forced_hf_logprobs(moe_checkpoint, samples)
    replayed, own = [None] * N, [None] * N
    for f in tmp_path.glob("dp*.npz"):
        d = np.load(f)
        for j, i in enumerate(d["index"]):
            replayed[i], own[i] = d[f"replayed{j}"], d[f"own{j}"]
        metrics = json.loads(f.with_suffix(".json").read_text())
        assert np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    assert metrics["routing_differ_frac"] > 0  # counted in training forwards too (replayed path)
    pairs, ties, differ = own_routing_differences(moe_checkpoint, samples)
    got = metrics["own_differ"]["routing_differ_frac"]
    print(f"\n[{parallel or 'ep1'}] own routing differs from the given one at {got:.4f} of (token, layer) "
          f"pairs; transformers {differ / pairs:.4f} ({ties} near-ties of {pairs})")
    assert abs(got * pairs - differ) <= ties
    err = max(float(np.abs(a - b).max()) for a, b in zip(replayed, want))
    moved = max(float(np.abs(a - b).max()) for a, b in zip(own, want))
    print(f"\n[{parallel or 'ep1'}] max |megatron(replayed) - HF(forced)| {err:.2e}; "
          f"own routing differs by up to {moved:.3f}")
    assert err < HF_LOGPROB_TOL
    assert moved > 100 * HF_LOGPROB_TOL  # the forced routing is not the model's own


def test_layer_targets_follow_the_routers_token_order():
    """The module docstring's worked example (sequence-first order; SP slices)."""
    import torch

    from pipeline.trainer.routing_replay import layer_targets

    routed = torch.tensor([[[[0, 1]], [[2, 3]], [[1, 3]]], [[[0, 1]], [[0, 1]], [[0, 1]]]])  # [2, 3, 1, 2]
    assert layer_targets(routed)[0].tolist() == [[0, 1], [0, 1], [2, 3], [0, 1], [1, 3], [0, 1]]
    assert layer_targets(routed, 1, 3, sequence_parallel=True)[0].tolist() == [[2, 3], [0, 1]]


if __name__ == "__main__":  # a rank of `launch` (tests/trainer/test_trainer.py): SCENARIO OUTDIR ARGS
    scenario(Path(sys.argv[2]), json.loads(sys.argv[3]))
