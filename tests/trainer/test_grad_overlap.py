"""Gradient-reduce overlap (``trainer.overlap_grad_reduce``) against overlap off: a tiny MoE on two
data-parallel ranks (dense and expert buffers both reduced over DP 2), several micro-batches per
step, two steps; the reduced gradients and the weights after each step must be equal.

Ranks run this file as a script (megatron's parallel state is process-global). The scenario also
records, just before the step waits for the reductions (``finish_grad_sync``), whether each
bucket's reduction was already in flight: with overlap on, from the second step on (the first step
counts each bucket's gradients), it must have been started during the last micro-batch's backward.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_trainer import launch, perturb_behaviour  # noqa: E402


def scenario(outdir: Path, args: dict) -> None:
    import torch
    from safetensors.torch import save_file

    from pipeline.trainer.config import ParallelConfig, TrainerConfig
    from pipeline.trainer.engine import Trainer
    from pipeline.trainer.model import iter_hf_weights
    from support.oracle import make_samples

    torch.set_num_threads(1)
    trainer = Trainer(TrainerConfig(model_dir=args["model_dir"], parallel=ParallelConfig(),
                                    overlap_grad_reduce=args["overlap"], micro_batch_tokens=40, lr=1e-3,
                                    grad_clip=0.0))
    rank = torch.distributed.get_rank()
    samples = make_samples(3, 16, trainer.hf_config.vocab_size)[rank::2]
    perturb_behaviour(samples, trainer.logprobs(samples), 3)
    in_flight = []
    finish = trainer.model.finish_grad_sync

    def recording_finish(*a, **kw):
        groups = trainer.model.bucket_groups + trainer.model.expert_parallel_bucket_groups
        in_flight.append([g.grad_reduce_handle is not None for g in groups])
        return finish(*a, **kw)

    trainer.model.finish_grad_sync = recording_finish
    out = {}
    for step in range(2):
        metrics = trainer.train_step(samples)
        out.update({f"grad{step}.{k}": v.contiguous()
                    for k, v in iter_hf_weights(trainer.model, trainer.hf_config, grads=True)})
        out.update({f"weight{step}.{k}": v.contiguous() for k, v in iter_hf_weights(trainer.model, trainer.hf_config)})
    if rank == 0:
        save_file(out, str(outdir / "state.safetensors"))
        (outdir / "result.json").write_text(json.dumps({
            "in_flight": in_flight, "micro_batches": len(trainer.layout.micro_batches(samples)),
            "loss": metrics["loss"]}))
    trainer.close()


@pytest.mark.engine
def test_overlapped_gradient_reduction_equals_overlap_off(tmp_path):
    from safetensors.torch import load_file

    from support.oracle import sharpened_checkpoint

    model_dir = sharpened_checkpoint("moe", tmp_path / "model")
    runs = {}
    for overlap in (True, False):
        runs[overlap] = tmp_path / f"overlap-{overlap}"
        launch("overlap", 2, runs[overlap], {"model_dir": str(model_dir), "overlap": overlap}, script=Path(__file__))
    result = {k: json.loads((d / "result.json").read_text()) for k, d in runs.items()}
    state = {k: load_file(str(d / "state.safetensors")) for k, d in runs.items()}
    diff = max(float((state[True][n] - state[False][n]).abs().max()) for n in state[False])
    moved = max(float((state[False][n] - state[False][n.replace("weight1", "weight0")]).abs().max())
                for n in state[False] if n.startswith("weight1"))
    print(f"\noverlap on vs off: {result[True]['micro_batches']} micro-batches per rank, max |diff| of "
          f"gradients and weights over 2 steps {diff:.2e} (weights moved {moved:.2e} in step 2); "
          f"reductions in flight before the wait: {result[True]['in_flight']} (on), {result[False]['in_flight']} (off)")
    assert result[True]["micro_batches"] >= 2 and moved > 0
    assert set(state[True]) == set(state[False]) and diff == 0.0
    assert all(result[True]["in_flight"][-1]) and not any(np.concatenate(result[False]["in_flight"]))


if __name__ == "__main__":
    {"overlap": scenario}[sys.argv[1]](Path(sys.argv[2]), json.loads(sys.argv[3]))
