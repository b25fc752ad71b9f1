"""Context parallelism: the split (`rank_positions`, the gathers' forward and backward, attention
over the split against whole-sequence attention, on 2 gloo ranks in `scenario_split`), the layout's
segment padding, the refusals, and CP2 x EP2 against one rank with checkpoints moved both ways
(4 ranks, ``slow``), on the tiny 8-expert MoE of test_pipeline_layouts.py (its runs: Keep Routing,
a top-k sampling mask, decoupled PPO, a KL term; micro-batches of at most 48 padded tokens: 2-4
per step; sequences of 3-23 fed tokens cut into 2 cp = 4 chunks). CP2 on 2 ranks shares the
two-rank plan of test_pipeline_layouts.py (one reference run for PP2 and CP2).

Cost on 2 cores: the split check ~10 s in the default suite; the CP2 x EP2 runs (``slow``) ~60 s.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_pipeline_layouts import STEPS, check_checkpoint_move, check_layout, run_plan  # noqa: E402
from test_trainer import launch  # noqa: E402


def test_rank_positions_balance_causal_work_and_cover_every_position_once():
    """The module docstring's worked example, and an even causal load for cp = 2 and 4."""
    from pipeline.trainer.context_parallel import gathered_order, rank_positions

    assert rank_positions([0, 8, 12], 2, 0).tolist() == [0, 1, 6, 7, 8, 11]
    assert rank_positions([0, 8, 12], 2, 1).tolist() == [2, 3, 4, 5, 9, 10]
    for cp in (2, 4):
        bounds = [0, 8 * cp, 12 * cp]
        held = [rank_positions(bounds, cp, r) for r in range(cp)]
        assert sorted(np.concatenate(held).tolist()) == list(range(bounds[-1]))
        work = {int((p + 1).sum()) for p in (h[h < bounds[1]] for h in held)}  # causal pairs, 1st segment
        assert len(work) == 1
        order = gathered_order(bounds, cp)
        assert (np.concatenate(held)[order] == np.arange(bounds[-1])).all()
    with pytest.raises(ValueError, match="does not split into 2\\*cp = 4 chunks"):
        rank_positions([0, 6], 2, 0)


def test_context_parallel_settings_it_cannot_run_are_refused_by_name(tmp_path):
    from pipeline.config import TokenflowConfig, validate
    from pipeline.models.tiny import TinyModelSpec
    from pipeline.trainer.config import ParallelConfig
    from pipeline.trainer.layout import make_layout
    from pipeline.trainer.model import check_pipeline_layout

    cfg = TokenflowConfig()
    cfg.run.dir = str(tmp_path / "run")
    cfg.cluster.trainer_ranks, cfg.trainer.parallel.cp = 4, 2
    validate(cfg)
    cfg.trainer.layout = "padded"
    with pytest.raises(ValueError, match="trainer.parallel.cp=2 needs .* trainer.layout=packed"):
        validate(cfg)
    cfg.trainer.layout, cfg.cluster.trainer_ranks = "packed", 3
    with pytest.raises(ValueError, match="multiple of tp \\* pp \\* cp \\(2\\)"):
        validate(cfg)
    with pytest.raises(ValueError, match="cannot split sequences over context-parallel ranks"):
        make_layout("padded", 64, segment_multiple=4)
    with pytest.raises(ValueError, match="context parallelism inside a pipeline"):
        check_pipeline_layout(TinyModelSpec(kind="moe").hf_config(), ParallelConfig(cp=2, pp=2))


def test_packed_segments_pad_to_the_chunk_multiple_and_mark_real_positions():
    """Under CP every segment is padded at its end to 2 cp; the real mask is exact."""
    from support.oracle import make_samples

    from pipeline.trainer.layout import PackedLayout, fed_length

    samples = make_samples(3, 4, 256, min_len=2, max_len=9)
    (mb,) = PackedLayout(256, pad_multiple=4, segment_multiple=4).micro_batches(samples)
    bounds = mb.packed_seq_params.cu_seqlens_q.tolist()
    fed = [fed_length(samples[i]) for i in mb.sample_index]
    assert all((b - a) % 4 == 0 and b - a - n < 4 for a, b, n in zip(bounds, bounds[1:], fed))
    real = mb.real_mask()[0]
    assert int(real.sum()) == sum(fed) and mb.tokens == sum(int(s.trained.sum()) for s in samples)
    for a, n in zip(bounds, fed):
        assert real[a:a + n].all() and not real[a + n:a + n + (-n) % 4].any()


def scenario_split(outdir: Path, args: dict) -> None:
    """CP attention and the logprob gather on 2 ranks vs the whole sequences on one, fp64,
    forward and gradients (written per rank)."""
    import datetime

    import torch

    from pipeline.trainer.attention import varlen_causal_attention
    from pipeline.trainer.context_parallel import context_parallel_attention, gather_split, rank_positions

    torch.distributed.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    group, rank = torch.distributed.group.WORLD, torch.distributed.get_rank()
    bounds = [0, 16, 20, 44]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(44, h, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    weight = torch.randn(44, 4, 8, generator=gen, dtype=torch.float64)
    cu = torch.tensor(bounds, dtype=torch.int32)
    whole = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = varlen_causal_attention(*whole, cu, 24, 0.3)
    (ref * weight).sum().backward()
    mine = torch.as_tensor(rank_positions(bounds, 2, rank))
    local = [x[mine].clone().requires_grad_() for x in (q, k, v)]
    out = context_parallel_attention(*local, cu, 0.3, group, varlen_causal_attention)
    # the loss every rank computes from gathered per-token values (as the trainer's logprobs)
    per_token = gather_split((out * weight[mine]).sum((1, 2))[None].T, bounds, group, sum_grads=False)
    per_token.sum().backward()
    errors = {"out": float((out - ref[mine]).abs().max()), "gathered": float(
        (per_token[:, 0] - (ref * weight).sum((1, 2))).abs().max())}
    for name, x, y in zip("qkv", local, whole):
        errors[f"d{name}"] = float((x.grad - y.grad[mine]).abs().max())
    (outdir / f"errors-{rank}.json").write_text(json.dumps(errors))
    torch.distributed.destroy_process_group()


@pytest.mark.engine
def test_attention_over_the_split_equals_whole_sequence_attention(tmp_path):
    launch("split", 2, tmp_path, {}, script=Path(__file__))
    for rank in range(2):
        errors = json.loads((tmp_path / f"errors-{rank}.json").read_text())
        print(f"\n[rank {rank}] max |err| {errors}")
        assert max(errors.values()) < 1e-12, errors


@pytest.fixture(scope="module")
def four_rank_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp4")
    return root, run_plan(root, [("tp1", STEPS, []), ("cp2ep2", STEPS, ["tp1"]), ("tp1", 0, ["cp2ep2"])])


@pytest.mark.engine
@pytest.mark.slow
def test_context_and_expert_parallel_match_one_rank_and_checkpoints_move(four_rank_runs):
    """Slow: the CP2 x EP2 runs (one rank, CP2 x EP2, the reload) cost ~60 s on 2 cores."""
    root, runs = four_rank_runs
    check_layout("cp2ep2", runs)
    check_checkpoint_move("tp1", "cp2ep2", root, runs)
    check_checkpoint_move("cp2ep2", "tp1", root, runs)


if __name__ == "__main__":
    scenario = {"split": scenario_split}[sys.argv[1]]
    scenario(Path(sys.argv[2]), json.loads(sys.argv[3]))
