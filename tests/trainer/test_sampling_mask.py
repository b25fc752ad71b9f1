"""Keep Sampling Mask without an engine: the trainer's renormalised logprobs (the chunked
`pipeline.trainer.logprobs`, fed given logits through an identity output weight) against a loop
reference (one rank and a vocabulary split over two gloo ranks), the kept-set reader against
vLLM's own top-k/top-p filter and FlatLogprobs, and the refusal of biased truncated sampling."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pipeline.launch.rendezvous import free_port
from pipeline.trainer.logprobs import token_logprobs

torch.set_num_threads(1)


def random_case(seed, rows=3, length=6, vocab=11, width=4):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, length, vocab, generator=g, dtype=torch.float64) * 2
    labels = torch.randint(0, vocab, (rows, length), generator=g)
    kept = torch.full((rows, length, width), -1, dtype=torch.long)
    for r in range(rows):
        for s in range(1, length):  # position 0 has no set (a prompt position)
            n = int(torch.randint(1, width + 1, (1,), generator=g))
            others = [int(v) for v in torch.randperm(vocab, generator=g) if int(v) != int(labels[r, s])]
            kept[r, s, :n] = torch.tensor([int(labels[r, s])] + others[:n - 1])
    return logits, labels, kept


def loop_reference(logits, labels, kept):
    out = torch.zeros(labels.shape, dtype=logits.dtype)
    for r in range(labels.shape[0]):
        for s in range(labels.shape[1]):
            ids = [int(i) for i in kept[r, s] if i >= 0] or list(range(logits.shape[-1]))
            lse = math.log(sum(math.exp(float(logits[r, s, j])) for j in ids))
            out[r, s] = float(logits[r, s, labels[r, s]]) - lse
    return out


def kept_logprobs(logits, labels, kept, group=None, shard=None, chunk=4):
    """``token_logprobs`` of given logits: hidden = the logits, output weight = the identity (rows
    ``shard`` of it on a vocabulary-split rank), so its gradient in hidden is the logits' own."""
    vocab = logits.shape[-1]
    weight = torch.eye(vocab, dtype=logits.dtype)[shard if shard is not None else slice(None)]
    return token_logprobs(logits, weight, labels, kept, tp_group=group, chunk=chunk)[0]


def test_renormalised_logprobs_match_loop_reference_and_masked_softmax_gradient():
    logits, labels, kept = random_case(0)
    x = logits.clone().requires_grad_(True)
    got = kept_logprobs(x, labels, kept)
    assert torch.allclose(got, loop_reference(logits, labels, kept), atol=1e-10)
    got.sum().backward()
    # independent gradient: log-softmax with every token outside the set at -inf
    y = logits.clone().requires_grad_(True)
    allowed = torch.ones(logits.shape, dtype=torch.bool)
    for r, s in zip(*torch.nonzero((kept >= 0).any(-1), as_tuple=True)):
        allowed[r, s] = False
        allowed[r, s, [int(i) for i in kept[r, s] if i >= 0]] = True
    torch.log_softmax(y.masked_fill(~allowed, -math.inf), -1).gather(-1, labels[..., None]).sum().backward()
    assert torch.allclose(x.grad, y.grad, atol=1e-10)


def test_worked_example_from_module_docstring():
    logits = torch.tensor([[[2.0, 1.0, 0.0]]], dtype=torch.float64)
    got = kept_logprobs(logits, torch.tensor([[1]]), torch.tensor([[[0, 1]]]))
    assert abs(float(got) - (-1.3133)) < 1e-4


def test_entropy_and_temperature_match_a_plain_softmax():
    logits, labels, _ = random_case(2)
    logp, entropy = token_logprobs(logits, torch.eye(logits.shape[-1], dtype=logits.dtype), labels,
                                   temperature=0.7, chunk=5, want_entropy=True)
    ref = torch.log_softmax(logits / 0.7, -1)
    assert torch.allclose(logp, ref.gather(-1, labels[..., None])[..., 0], atol=1e-10)
    assert torch.allclose(entropy, -(ref.exp() * ref).sum(-1), atol=1e-10)


def _vocab_split_rank(rank, port, out):
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                         world_size=2)
    logits, labels, kept = random_case(1, vocab=12)
    x = logits.clone().requires_grad_(True)
    got = kept_logprobs(x, labels, kept, torch.distributed.group.WORLD, slice(rank * 6, (rank + 1) * 6))
    got.sum().backward()
    torch.save({"value": got.detach(), "grad": x.grad}, f"{out}/rank{rank}.pt")
    torch.distributed.destroy_process_group()


def test_vocab_split_over_two_ranks_matches_loop_reference(tmp_path):
    """Each of 2 gloo ranks holds half the vocabulary: values equal the loop reference on both,
    and the ranks' gradient parts sum to the one-rank gradient (megatron sums them over TP)."""
    import torch.multiprocessing as mp

    port = free_port("127.0.0.1")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_vocab_split_rank, args=(r, port, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        if p.is_alive():
            p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    logits, labels, kept = random_case(1, vocab=12)
    want = loop_reference(logits, labels, kept)
    x = logits.clone().requires_grad_(True)
    kept_logprobs(x, labels, kept).sum().backward()
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for part in parts:
        assert torch.allclose(part["value"], want, atol=1e-10)
    assert torch.allclose(parts[0]["grad"] + parts[1]["grad"], x.grad, atol=1e-10)


def test_kept_sets_read_from_vllm_processed_logprobs_are_exact_under_ties():
    """vLLM's own top-k/top-p filter and logprob gathering (as its sampler runs them), read back."""
    from types import SimpleNamespace

    from vllm.logprobs import FlatLogprobs
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    from pipeline.generator.capture import SamplingMaskOverflow, kept_token_ids

    logits = torch.tensor([[3.0, 1.0, 3.0, 0.5, -1.0, 2.0],    # top_k 2 with a tie at the cut: {0, 2}
                           [0.0, 0.0, 0.0, 0.0, 5.0, 0.0]])    # top_p 0.5: {4}
    processed = apply_top_k_top_p_pytorch(logits.clone(), torch.tensor([2, 6]), torch.tensor([1.0, 0.5]),
                                          allow_cpu_sync=True).log_softmax(-1)
    width = 3
    flat = FlatLogprobs()
    sampled = [2, 4]
    for row, tok in zip(processed, sampled):
        top = torch.topk(row, width + 1)
        flat.append_fast([tok] + top.indices.tolist(), [float(row[tok])] + top.values.tolist(),
                         iter([1] * (width + 2)), [None] * (width + 2))
    out = SimpleNamespace(token_ids=sampled, logprobs=flat)
    rows = kept_token_ids(out, width)
    assert [sorted(int(t) for t in r if t >= 0) for r in rows] == [[0, 2], [4]]
    assert rows.dtype == np.int32 and rows.shape == (2, width)
    with pytest.raises(SamplingMaskOverflow, match="sampling_mask_width"):
        kept_token_ids(out, 1)  # the tie makes the first set wider than 1


def test_truncated_sampling_without_the_mask_is_refused():
    from pipeline.generator.config import GeneratorConfig

    for kw in ({"top_p": 0.9}, {"top_k": 20}):
        with pytest.raises(ValueError, match="sampling_mask_width"):
            GeneratorConfig(**kw)
        GeneratorConfig(**kw, allow_sampling_bias=True)
        GeneratorConfig(**kw, sampling_mask_width=32)
    with pytest.raises(ValueError, match="top_k"):
        GeneratorConfig(top_k=40, sampling_mask_width=32)
    with pytest.raises(ValueError, match="processed_logprobs"):
        GeneratorConfig(top_p=0.9, sampling_mask_width=32, logprobs_mode="raw_logprobs")
    GeneratorConfig()  # the full distribution needs nothing


def test_inspect_shows_what_a_log_carries_and_its_bytes_per_token(tmp_path, capsys):
    import json

    from pipeline.apps.inspect_log import main
    from pipeline.protocol.record import RecordSchema
    from pipeline.rollout_log.writer import RolloutLogWriter
    from support.rollout_data import make_batch

    for schema, want in ((RecordSchema(), None), (RecordSchema(sampling_mask_k=8), 32),
                         (RecordSchema(routed_experts=(2, 2), sampling_mask_k=8), 32)):
        run = tmp_path / f"run{want}{schema.routed_experts}"
        with RolloutLogWriter(run / "rollouts", schema, "r", {}) as w:
            w.append_samples(make_batch(schema, 1, 4))
        assert main([str(run), "--json"]) == 0
        got = json.loads(capsys.readouterr().out)["per_token_bytes"]
        assert got.get("sampling_mask") == want
        assert got.get("routed_experts") == (8 if schema.routed_experts else None)  # 2 x 2 int16
        assert got.get("prompt_routed_experts") == (8 if schema.routed_experts else None)
        assert got["completion_ids"] + got["logprobs"] + got["versions"] == 12
        assert main([str(run)]) == 0
        text = capsys.readouterr().out
        assert ("sampling mask 32 B" if want else "sampling mask not recorded") in text
        assert ("routing (prompt and completion) 8 B per prompt token + 8 B per completion token"
                if schema.routed_experts else "routing (prompt and completion) not recorded") in text
        if schema.routed_experts:  # the bytes the log holds per token, read from the file itself
            from pipeline.rollout_log.reader import RolloutLog
            with RolloutLog.open(run) as log:
                batch = log.read(np.arange(log.num_samples))
            for name, length in (("prompt_routed_experts", "prompt_len"), ("routed_experts", "completion_len")):
                assert batch.columns[name].nbytes == 8 * int(batch.columns[length].sum())
