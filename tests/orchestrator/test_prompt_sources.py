"""Synthetic prompts (`pipeline/orchestrator/prompts.py`) are drawn a block at a time, yet each is a
pure function of (seed, prompt id): read in any order, by any instance, it is the same; another
seed gives other prompts."""
from __future__ import annotations

import numpy as np

from pipeline.orchestrator.prompts import SYNTHETIC_BLOCK, SyntheticPromptSource


def test_a_synthetic_prompt_is_the_same_in_any_order_and_instance():
    ids = list(range(3 * SYNTHETIC_BLOCK))
    forward = SyntheticPromptSource(n_prompts=len(ids), seed=3)
    first = {i: forward.load(i) for i in ids}
    backward = SyntheticPromptSource(n_prompts=len(ids), seed=3)
    for i in reversed(ids):
        item = backward.load(i)
        np.testing.assert_array_equal(item.token_ids, first[i].token_ids)
        assert item.prompt_id == i and item.answer == int(item.token_ids[-1])
        assert 8 <= len(item.token_ids) <= 64 and not item.token_ids.flags.writeable
    other = SyntheticPromptSource(n_prompts=len(ids), seed=4)
    assert sum(np.array_equal(other.load(i).token_ids, first[i].token_ids) for i in ids) == 0
    lengths = {len(first[i].token_ids) for i in ids}
    assert len(lengths) > 20  # lengths drawn per prompt, not one per block


def test_a_groups_prompt_is_its_epochs_permutation_entry_however_often_looked_up():
    """`PromptSource.for_group` keeps recent groups' prompts: each lookup, first or repeated, is
    the prompt the seeded epoch permutation assigns (epoch = group // prompts)."""
    source = SyntheticPromptSource(n_prompts=50, seed=2)
    reference = SyntheticPromptSource(n_prompts=50, seed=2)
    for group in [0, 7, 49, 50, 51, 7, 99, 0, 120, 50]:
        epoch, pos = divmod(group, 50)
        expected = int(np.random.default_rng([2, epoch]).permutation(50)[pos])
        item = source.for_group(group)
        assert item.prompt_id == expected
        np.testing.assert_array_equal(item.token_ids, reference.load(expected).token_ids)
