"""Finding the runs of a sweep and what each was started with; ``tokenflow status SWEEP_DIR``.

A run directory holds ``config.yaml`` (the resolved config it started with) or, if it stopped
before that was written, Hydra's ``.hydra/overrides.yaml``. A sweep directory (Hydra multirun's
``hydra.sweep.dir``, ``runs/<name>-sweep`` by default) is a directory that is not a run directory
and holds run directories, one per point (``0``, ``1``, ... in job order).

Invariants:
- points are listed in job order (numeric names numerically, then the others by name);
- `run_config` flattens a run's config to dotted keys with the values it ran with; for a point
  without ``config.yaml`` only its command-line overrides are known (its other keys are absent,
  never guessed);
- `status` of a sweep directory lists every point (its Slurm job or local processes, the state of
  each component, step, last evaluation, error), reading each point as ``tokenflow status RUN_DIR``
  does, so it works the same while a detached Slurm sweep is pending, running or done.

Example (`tokenflow status runs/ssw-sweep` of a detached Slurm sweep, as the test cluster printed it;
3 nodes fit one point at a time)::

    sweep      /home/me/runs/ssw-sweep  2 point(s)
    point  trainer.lr  job  components                                                  step  eval  error
    0      0.0001      13   trainer RUNNING, generator RUNNING                          0/2   -     -
    1      0.0002      15   trainer PENDING (Resources), generator PENDING (Resources)  0/2   -     -
"""
from __future__ import annotations

import glob
import json
from pathlib import Path
from typing import Any, Dict, List

from pipeline.run_files import CONFIG_FILE

OVERRIDES_FILE = ".hydra/overrides.yaml"
#: Keys that differ between any two runs by construction: never a column, never an hparam.
IDENTITY_KEYS = ("run.dir", "run.name")


def is_run_dir(path: Path) -> bool:
    return (path / CONFIG_FILE).exists() or (path / "launch" / "launches.jsonl").exists() \
        or (path / OVERRIDES_FILE).exists()


def _job_order(path: Path) -> tuple:
    return (0, int(path.name), "") if path.name.isdigit() else (1, 0, path.name)


def sweep_points(sweep_dir: Path) -> List[Path]:
    """The run directories directly inside `sweep_dir`, in job order (empty if there are none)."""
    return sorted((p for p in Path(sweep_dir).iterdir() if p.is_dir() and is_run_dir(p)), key=_job_order)


def is_sweep_dir(path: Path) -> bool:
    return Path(path).is_dir() and not is_run_dir(Path(path)) and bool(sweep_points(path))


def find_runs(paths: List[str]) -> List[Path]:
    """Run directories named by `paths`: run directories, sweep directories (all their points) or
    glob patterns of either; each run once, in the order given; files are passed over. Raises
    ValueError naming a path that does not exist or a directory that is neither, or if no run is left."""
    runs: List[Path] = []
    for arg in paths:
        matches = [Path(m) for m in sorted(glob.glob(arg), key=lambda m: _job_order(Path(m)))] \
            if glob.has_magic(arg) else [Path(arg)]
        if not matches:
            raise ValueError(f"{arg}: no path matches this pattern")
        for path in matches:
            if not path.exists():
                raise ValueError(f"{path}: no such directory")
            if is_run_dir(path):
                found = [path]
            elif path.is_dir() and sweep_points(path):
                found = sweep_points(path)
            elif glob.has_magic(arg) or not path.is_dir():
                continue  # a pattern (the shell's too: SWEEP/*) also matches files such as multirun.yaml
            else:
                raise ValueError(f"{path} is neither a run directory (config.yaml, launch/) nor a sweep "
                                 f"directory holding run directories")
            runs += [p.resolve() for p in found if p.resolve() not in runs]
    if not runs:
        raise ValueError(f"no run directory in {' '.join(paths)}")
    return runs


def _flatten(node: Any, prefix: str, out: Dict[str, Any]) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            _flatten(value, f"{prefix}.{key}" if prefix else str(key), out)
    else:
        out[prefix] = json.dumps(node) if isinstance(node, list) else node


def _resolved_config(run_dir: Path) -> Dict[str, Any]:
    from omegaconf import OmegaConf

    path = Path(run_dir) / CONFIG_FILE
    out: Dict[str, Any] = {}
    if path.exists():
        _flatten(OmegaConf.to_container(OmegaConf.load(path), resolve=False), "", out)
    return out


def command_overrides(run_dir: Path) -> Dict[str, Any]:
    """The run's command-line overrides (Hydra's record), key -> the value the run resolved (a config
    group override such as ``model=tiny-dense``: its option name); Hydra's own keys and the identity
    keys left out. Empty if Hydra left no record."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    path = Path(run_dir) / OVERRIDES_FILE
    if not path.exists():
        return {}
    resolved = _resolved_config(run_dir)
    parser = OverridesParser.create()
    out: Dict[str, Any] = {}
    for item in OmegaConf.to_container(OmegaConf.load(path)):
        override = parser.parse_override(str(item))
        key = override.key_or_group
        if key.startswith("hydra.") or key.startswith("hydra/") or key in IDENTITY_KEYS or override.is_delete():
            continue
        value = resolved[key] if key in resolved else override.value()
        out[key] = value if isinstance(value, (int, float, str, bool)) or value is None else str(value)
    return out


def run_config(run_dir: Path) -> Dict[str, Any]:
    """The run's config as dotted keys -> values (see the module doc)."""
    return _resolved_config(run_dir) or command_overrides(run_dir)


def differing_keys(configs: List[Dict[str, Any]]) -> List[str]:
    """Keys whose known values differ between the configs (identity keys left out), in key order."""
    keys = sorted({k for c in configs for k in c} - set(IDENTITY_KEYS))
    return [k for k in keys if len({json.dumps(c[k], sort_keys=True) for c in configs if k in c}) > 1]


def format_sweep_status(s: Dict[str, Any]) -> str:
    header = ["point", *s["keys"], "job", "components", "step", "eval", "error"]
    rows = []
    for p in s["points"]:
        st = p["status"]
        values = [str(p["overrides"][k]) for k in s["keys"]]
        if st is None:
            rows.append([p["point"], *values, "-", "never launched", "-", "-", "-"])
            continue
        comps = ", ".join(f"{c['role']} {c['state']}" + (f" ({c['reason']})" if c.get("reason") else "")
                          for c in st["components"])
        ev = st["last_eval"]
        rows.append([p["point"], *values, str(st["job_id"] or "local"), comps, f"{st['steps_done']}/{st['steps']}",
                     f"{ev['accuracy']:.2f}@{ev['step']}" if ev and ev.get("accuracy") is not None else "-",
                     st["last_error"] or "-"])
    lines = [f"sweep      {s['sweep_dir']}  {len(s['points'])} point(s)", *align([header, *rows])]
    return "\n".join(lines)


def align(rows: List[List[str]]) -> List[str]:
    """Rows of cells as text lines, columns padded to their widest cell (the last one not padded)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows]
