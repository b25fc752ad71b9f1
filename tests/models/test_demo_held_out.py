"""The demo's held-out prompts stay unseen: neither its warm start nor its training gets one.

The demo is `tokenflow train` without arguments, composed here as Hydra composes it. The held-out
set is the task's fixed evaluation draw; what the warm start trains on is its demonstration batches
(`pipeline.models.warmstart.demonstration_batches`, what `train_warm_start` iterates) and what
training sees is the orchestrator's prompt source for the run's seed, for every group the run can
admit (steps x groups per step, plus the groups in flight at the staleness bound), for three seeds.
"""
from __future__ import annotations

from omegaconf import OmegaConf

from pipeline.models.warmstart import demonstration_batches
from pipeline.roles.trainer import warm_start_config
from pipeline.tasks import make_task
from pipeline.tasks.sources import TaskPromptSource


def _demo_config():
    from hydra import compose, initialize_config_dir

    from pipeline.apps.train import CONFIGS
    from pipeline.config import register

    register()
    with initialize_config_dir(str(CONFIGS), version_base=None):
        composed = compose("train")
    composed.run.dir = "unused"
    return OmegaConf.to_object(composed)


def test_the_demo_never_warm_starts_or_trains_on_a_held_out_prompt():
    cfg = _demo_config()
    task = make_task(cfg.task)
    held_out = {p.text for p in task.eval_prompts()}
    assert len(held_out) == cfg.task.eval_size == 200
    ws = warm_start_config(cfg, task)
    assert ws is not None and ws.steps > 0, "the demo warm-starts its tiny model"
    demonstrated = [p.text for batch in demonstration_batches(task, ws) for p in batch]
    assert len(demonstrated) == ws.steps * ws.batch_size
    assert not held_out & set(demonstrated)
    o = cfg.orchestrator
    groups = (cfg.run.steps + o.max_async + 1) * o.groups_per_step * 2  # twice what the run can admit
    for seed in (0, 1, 2):
        source = TaskPromptSource(task, lambda prompt: [0], seed)
        trained = {source.for_group(g).answer.text for g in range(groups)}
        assert len(trained) > groups // 2 and not held_out & trained, seed
