"""Stop signals to the batch step of a hand-submitted run (`slurm/train.sbatch`) on the test
cluster: the run ends as `tokenflow cancel` ends it (every role sees the stop, the job is cancelled,
not requeued, nothing of it runs on), instead of its tasks lingering after a forwarded SIGTERM for
Slurm to end them (the supervisor's `term_linger_s`, 600 s)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from support.slurm_runs import status_of, submit_probe_batch, wait_until

pytestmark = pytest.mark.slurm


def test_sigterm_to_the_batch_step_ends_the_run_as_cancel_does(tmp_path):
    """About 20 s: two probe roles hold until stopped; `scancel --batch --signal=TERM` signals only
    the batch shell. Found at merge: the batch shell outlived the cancel long enough for
    `batch finish` to read the stopped roles as a checkpoint stop and requeue the job (a second
    attempt ran and completed); the trap now marks the run cancelled and the shell never requeues.
    Found in CI: the trap's cancel also signalled srun, which then SIGKILLed the tasks at once ("srun:
    forcing job termination"), before a loaded machine had run the generator's stop; the trap now
    signals the tasks first and cancels once srun has returned (or after the stop grace)."""
    job_id = submit_probe_batch(tmp_path, "tf-sbatch-term", hold_s=200, TOKENFLOW_PYTHON=sys.executable)
    try:
        wait_until(lambda: len(list((tmp_path / "probe").glob("*.attempt-0.json"))) == 2, 60, "both roles started")
        subprocess.run(["scancel", "--batch", "--signal=TERM", job_id], check=True, timeout=30)
        wait_until(lambda: all(c["state"].startswith(("COMPLETED", "FAILED", "CANCELLED"))
                               for c in status_of(tmp_path)["components"]), 120, "the job ended", poll_s=2)
    finally:
        subprocess.run(["scancel", job_id], timeout=30)
    batch_log = (tmp_path / "batch.out").read_text()
    states = [c["state"] for c in status_of(tmp_path)["components"]]
    assert all(s.startswith("CANCELLED") for s in states), (states, batch_log[-2000:])
    assert f"tokenflow cancel {tmp_path}" in batch_log, batch_log[-2000:]
    for role in ("trainer", "generator"):
        report = json.loads((tmp_path / f"probe/{role}.0.attempt-0.json").read_text())
        assert report.get("stop_requested"), f"{role} never saw the stop: {report}"
    assert not list((tmp_path / "probe").glob("*.attempt-1.json")), "the job was requeued"
