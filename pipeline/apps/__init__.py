"""The entry points of Tokenflow, in one place: every process a user or a launcher starts.

- `train` (``tokenflow train``), `replay` (``tokenflow replay``), `inspect_log` (``tokenflow
  inspect``), `ops` (``tokenflow status`` / ``cancel``): the console commands (`pipeline.cli`);
- `launch_task` (``python -m pipeline.apps.launch_task RUN_DIR INDEX``): one task of a launched plan;
- `batch` (``python -m pipeline.apps.batch prepare|finish``): the steps of ``slurm/train.sbatch``;
- `orchestrator` (``python -m pipeline.apps.orchestrator RUN_DIR``): the orchestrator process.

Library packages (`pipeline.orchestrator`, `launch`, `roles`, `trainer`, `generator`, ...) never
import from here; entry points import them.
"""
