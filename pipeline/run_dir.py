"""What a run directory holds that every process reads: the run's config and the model it starts from.

Invariants: both are written atomically (a temporary file renamed), so a reader sees the whole
file or none; `model_dir` waits for trainer rank 0's `publish_model` (names: `pipeline.run_files`).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from pipeline.config import TokenflowConfig
from pipeline.run_files import CONFIG_FILE, MODEL_FILE


def load_run_config(run_dir: Path) -> TokenflowConfig:
    """The resolved config a run directory was started with."""
    from omegaconf import OmegaConf

    path = Path(run_dir) / CONFIG_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: {run_dir} is not a Tokenflow run directory")
    merged = OmegaConf.merge(OmegaConf.structured(TokenflowConfig), OmegaConf.load(path))
    return OmegaConf.to_object(merged)


def save_run_config(run_dir: Path, cfg: TokenflowConfig) -> Path:
    from omegaconf import OmegaConf

    path = Path(run_dir) / CONFIG_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg), resolve=True))
    os.replace(tmp, path)
    return path


def publish_model(run_dir: Path, path: Path) -> None:
    """Record the checkpoint every role starts from (trainer rank 0 writes it, atomically)."""
    tmp = Path(run_dir) / (MODEL_FILE + ".tmp")
    tmp.write_text(json.dumps({"path": str(path)}))
    os.replace(tmp, Path(run_dir) / MODEL_FILE)


def model_dir(run_dir: Path, timeout_s: float = 0.0) -> Path:
    """The checkpoint the run's roles start from, waiting up to ``timeout_s`` for trainer rank 0."""
    path = Path(run_dir) / MODEL_FILE
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s:.0f}s (is the trainer up?)")
        time.sleep(0.2)
    return Path(json.loads(path.read_text())["path"])
