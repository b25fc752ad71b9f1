"""The doctor's memory check (pipeline.doctor.memory) on structured configs, in-process."""
from __future__ import annotations

from pipeline.apps.doctor import diagnose
from pipeline.config import TokenflowConfig


def config(tmp_path, **trainer):
    cfg = TokenflowConfig()
    cfg.run.dir = str(tmp_path / "run")
    for name, value in trainer.items():
        setattr(cfg.trainer, name, value)
    return cfg


def test_the_default_run_fits_and_its_peak_is_reported(tmp_path, capsys):
    assert diagnose(config(tmp_path)) == 0
    out = capsys.readouterr().out
    assert "[memory] trainer rank peak" in out and "refused: [memory]" not in out


def test_a_micro_batch_beyond_host_memory_is_refused_naming_what_binds(tmp_path, capsys):
    assert diagnose(config(tmp_path, micro_batch_tokens=2_000_000)) == 2
    out = capsys.readouterr().out
    assert "refused: [memory] the trainer does not fit its host memory" in out
    assert "activations binds" in out  # rows of generator.max_model_len: activations, not S x S scores
