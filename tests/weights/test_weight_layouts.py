"""Weight sync from multi-rank trainer layouts (megatron-core on gloo) to receivers, end to end.

`support.layout_check` starts the trainer ranks and receivers as real processes and runs
the roles' push path (`ShardedWeights` + streamed `send_stream`); each receiver compares every
tensor bit for bit with the checkpoint the trainer loaded (the independent reference).
"""
from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.engine


def test_tp2_ep2_streams_each_expert_from_its_owner_and_receivers_get_the_checkpoint(tmp_path):
    """Also the bytes test of an expert-parallel layout: what both ends counted agrees."""
    from pipeline.models.tiny import ensure_tiny_model
    from support.layout_check import run

    model = ensure_tiny_model("moe")  # 4 experts per layer: EP rank r owns experts 2r, 2r+1
    r = run(str(model), tp=2, ep=2, receivers=2, bucket_mb=0.25, reps=2, outdir=tmp_path)
    for recv in r["receivers"]:
        assert recv["versions"] == [1, 2]
        assert recv["mismatched_count"] == 0 and not recv["missing"], recv
        assert recv["tensors"] == recv["unique"] == recv["checkpoint_tensors"]
        # a streamed receiver holds two bucket buffers (bucket k+1 posted into bucket k-1's while k loads)
        assert 0 < recv["buffers_allocated"] <= 2 * r["trainer"][0]["max_bucket"]
    by_rank = {t["rank"]: t for t in r["trainer"]}
    # megatron's order tp-ep-dp at the default expert TP 1: TP groups {0,1} {2,3}; EP groups {0,1}
    # {2,3}; experts whole on each rank, ranks 2 and 3 the expert-DP copies of 0 and 1: the senders
    # are expert-DP rank 0 of each EP rank
    assert [by_rank[k]["source"] for k in range(4)] == [0, 1, None, None]
    assert by_rank[2]["sent"] == [] and by_rank[3]["sent"] == []

    def experts(names):
        return {int(m.group(1)) for n in names if (m := re.search(r"experts\.(\d+)\.", n))}

    assert experts(by_rank[0]["sent"]) == {0, 1}, "rank 0 sent experts it does not own"
    assert experts(by_rank[1]["sent"]) == {2, 3}, "rank 1 sent experts it does not own"
    assert all("experts" in n for n in by_rank[1]["sent"]), "only the leader sends dense weights"
    sent = by_rank[0]["sent"] + by_rank[1]["sent"]
    assert len(sent) == len(set(sent)) == r["receivers"][0]["checkpoint_tensors"]
    for t in (by_rank[0], by_rank[1]):  # 0 when every bucket of a sender is one tensor's bytes (sent uncopied)
        assert 0 <= t["buffers_allocated"] <= 2 * t["max_bucket"]
    assert by_rank[0]["buffers_allocated"] > 0  # the leader packs the small dense tensors
    # counted, not computed: per update the bytes each receiver counted are what the two sending
    # ranks counted together; the non-sending ranks moved none; the count is the plan's segments
    # plus the metadata, and the tensors' bytes are what the trainer planned at its start
    # (sync_bytes: every sender's tensors; the padding inside packed runs comes on top)
    for version in range(2):
        sent = by_rank[0]["wire"][version][0] + by_rank[1]["wire"][version][0]
        assert by_rank[2]["wire"][version] == by_rank[3]["wire"][version] == [0, 0]
        for recv in r["receivers"]:
            planned = recv["planned_wire"][version]
            assert recv["wire"][version] == [0, sent], (version, recv["wire"], sent)
            assert sent == planned["metadata"] + planned["payload"]
            assert planned["tensor_bytes"] == by_rank[0]["sync_bytes"]
            assert 0 <= planned["payload"] - planned["tensor_bytes"] < 64 * len(by_rank[0]["sent"] + by_rank[1]["sent"])



@pytest.mark.parametrize("ep", [1, 2], ids=["pp2", "pp2ep2"])
def test_pipeline_stages_stream_their_own_layers_and_receivers_get_the_checkpoint(ep, tmp_path):
    """Each stage sends its own layers: no gather of another stage's weights anywhere. PP2 x EP2
    (4 ranks) costs ~13 CPU s, 9-18 s on 2 cores (the ranks forked from one zygote, `support.zygote`)."""
    from pipeline.models.tiny import ensure_tiny_model
    from support.layout_check import run

    model = ensure_tiny_model("moe")  # 2 layers (one per stage), 4 experts: EP rank r owns 2r, 2r+1
    r = run(str(model), ep=ep, pp=2, receivers=1, bucket_mb=0.25, reps=1, outdir=tmp_path)
    recv = r["receivers"][0]
    assert recv["mismatched_count"] == 0 and not recv["missing"], recv
    assert recv["tensors"] == recv["unique"] == recv["checkpoint_tensors"]
    by_rank = {t["rank"]: t for t in r["trainer"]}
    # megatron's order tp-cp-ep-dp-pp: stage s = ranks s*ep .. s*ep+ep-1, sender s*ep + EP rank
    assert [by_rank[k]["source"] for k in range(2 * ep)] == list(range(2 * ep))

    def layers(names):
        return {int(m.group(1)) for n in names if (m := re.search(r"layers\.(\d+)\.", n))}

    def experts(names):
        return {int(m.group(1)) for n in names if (m := re.search(r"experts\.(\d+)\.", n))}

    for k in range(2 * ep):
        assert layers(by_rank[k]["sent"]) == {k // ep}, f"rank {k} sent another stage's layers"
        assert experts(by_rank[k]["sent"]) == set(range(4 // ep * (k % ep), 4 // ep * (k % ep + 1)))
        if k % ep:
            assert all("experts" in n for n in by_rank[k]["sent"]), "only EP rank 0 sends dense weights"
    assert "model.embed_tokens.weight" in by_rank[0]["sent"]
    assert {"model.norm.weight", "lm_head.weight"} <= set(by_rank[ep]["sent"])
    sent = [n for t in r["trainer"] for n in t["sent"]]
    assert len(sent) == len(set(sent)) == recv["checkpoint_tensors"]
    assert sum(t["wire"][0][0] for t in r["trainer"]) == recv["wire"][0][1]
