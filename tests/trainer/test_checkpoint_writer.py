"""Checkpoints written in the background while training goes on, their completion and retention
(`pipeline.trainer.checkpoint_writer`).

The two-rank scenario runs this file as a script on TP 2 (gloo): each rank's write is held at a
gate (the test replaces the writer module's `write_snapshot` with one that waits for the test's
go), so the next training step provably runs while the save is in flight; the completed
checkpoint is compared tensor by tensor with a synchronous save taken at the same point, and a
load of it restores the parameters as they were at the snapshot, not after the step that followed.
"""
from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import pytest

from pipeline.run_files import CHECKPOINTS_DIR
from pipeline.trainer.checkpoint_writer import complete_checkpoints, prune_checkpoints
from support.oracle import make_samples, sharpened_checkpoint


def _make_dirs(run: Path, complete: list[int], partial: list[int], unmarked: list[int]) -> None:
    for k in complete + unmarked:
        d = run / CHECKPOINTS_DIR / f"step-{k}"
        d.mkdir(parents=True)
        (d / "model-r00000-00000.safetensors").write_bytes(b"x")
        if k in complete:
            (d / "COMPLETE").write_text(str(k))
    for k in partial:
        (run / CHECKPOINTS_DIR / f"step-{k}.partial").mkdir(parents=True)


def test_retention_keeps_the_newest_complete_and_never_touches_a_save_in_flight(tmp_path):
    _make_dirs(tmp_path, complete=[5, 10, 15, 20, 30], partial=[40], unmarked=[12, 35])
    gone = prune_checkpoints(tmp_path, keep=2)
    assert sorted(d.name for d in gone) == ["step-10", "step-15", "step-5"]
    assert [k for k, _ in complete_checkpoints(tmp_path)] == [20, 30]
    left = sorted(p.name for p in (tmp_path / CHECKPOINTS_DIR).iterdir())
    # step-12: a remnant of an earlier failed deletion, swept; in flight / newer: untouched
    assert left == ["step-20", "step-30", "step-35", "step-40.partial"]
    assert prune_checkpoints(tmp_path, keep=1) and [k for k, _ in complete_checkpoints(tmp_path)] == [30]
    assert prune_checkpoints(tmp_path, keep=0) == [] and complete_checkpoints(tmp_path)


def test_a_deletion_that_fails_leaves_no_checkpoint_and_is_retried(tmp_path):
    """A checkpoint that cannot be deleted yet (an immutable file here; on the cluster, a file of the
    checkpoint a resume had loaded, still open on sshfs): retention neither fails nor leaves a
    checkpoint a resume would take, and the next call deletes it once it can (the old code raised
    OSError "Directory not empty" and the trainer failed)."""
    import subprocess
    _make_dirs(tmp_path, complete=[2, 4, 6], partial=[], unmarked=[])
    stuck = tmp_path / CHECKPOINTS_DIR / "step-2" / "model-r00000-00000.safetensors"
    if subprocess.run(["chattr", "+i", str(stuck)], capture_output=True).returncode:
        pytest.skip("chattr +i is not available here (needs root and ext2/3/4 or similar)")
    try:
        assert [d.name for d in prune_checkpoints(tmp_path, keep=2)] == ["step-2"]
        assert [k for k, _ in complete_checkpoints(tmp_path)] == [4, 6] and stuck.exists()
    finally:
        subprocess.run(["chattr", "-i", str(stuck)], check=True)
    _make_dirs(tmp_path, complete=[8], partial=[], unmarked=[])
    prune_checkpoints(tmp_path, keep=2)
    assert sorted(p.name for p in (tmp_path / CHECKPOINTS_DIR).iterdir()) == ["step-6", "step-8"]


# ----------------------------------------------------------------------------- scenario (ranks)
def scenario_async(outdir: Path, args: dict) -> None:
    import torch
    import torch.distributed as td
    from safetensors.torch import load_file

    from pipeline.trainer import checkpoint_writer
    from pipeline.trainer.checkpoint import save_checkpoint
    from pipeline.trainer.config import ParallelConfig, TrainerConfig
    from pipeline.trainer.engine import Trainer
    from test_trainer import perturb_behaviour

    trainer = Trainer(TrainerConfig(model_dir=args["model_dir"], parallel=ParallelConfig(tp=2), lr=1e-3,
                                    grad_clip=0.0, micro_batch_tokens=96))
    rank = td.get_rank()
    samples = make_samples(3, 4, trainer.hf_config.vocab_size)
    perturb_behaviour(samples, trainer.logprobs(samples), 1)
    gate, real_write = threading.Event(), checkpoint_writer.write_snapshot
    fail_on = {}

    def gated_write(snapshot, directory):
        gate.wait(120)
        if fail_on.get(rank):
            raise OSError(28, "No space left on device (the test's)")
        real_write(snapshot, directory)

    checkpoint_writer.write_snapshot = gated_write
    run = outdir / "run"
    writer = checkpoint_writer.CheckpointWriter(trainer, run, keep=2, asynchronous=True)
    result = {}
    trainer.train_step(samples)
    save_checkpoint(trainer, outdir / "sync-1")  # the reference: written now, synchronously
    at_save = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    writer.save(1)
    trainer.train_step(samples)  # the write is held at the gate: this step runs while it is in flight
    writer.poll()
    result["in_flight_after_step"] = writer.in_flight()
    result["complete_while_held"] = [k for k, _ in complete_checkpoints(run)]
    result["params_moved"] = any(not torch.equal(p, at_save[n]) for n, p in trainer.model.named_parameters())
    gate.set()
    writer.wait()
    result["complete_after_wait"] = [k for k, _ in complete_checkpoints(run)]
    ckpt = run / CHECKPOINTS_DIR / "step-1"
    same = True
    for f in sorted((outdir / "sync-1").glob("*-r*.safetensors")):
        if f.name.startswith("rng-"):
            continue
        a, b = load_file(str(f)), load_file(str(ckpt / f.name))
        same &= a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    result["files_equal_sync_save"] = bool(same)
    trainer.load(ckpt)
    result["load_restores_snapshot"] = all(torch.equal(p, at_save[n]) for n, p in trainer.model.named_parameters())
    for k in (2, 3):  # retention: keep 2
        writer.save(k)
        trainer.train_step(samples)
    writer.wait()
    result["complete_after_retention"] = [k for k, _ in complete_checkpoints(run)]
    gate.clear()
    fail_on[1] = True  # rank 1's write fails: the save fails on both ranks, nothing completes
    writer.save(4)
    gate.set()
    try:
        writer.wait()
        result["failure"] = None
    except RuntimeError as exc:
        result["failure"] = str(exc)
    result["complete_after_failure"] = [k for k, _ in complete_checkpoints(run)]
    (outdir / f"result{rank}.json").write_text(json.dumps(result))
    trainer.close()


@pytest.mark.engine
def test_save_in_flight_lets_training_go_on_and_completes_as_a_synchronous_save(tmp_path):
    """Two TP ranks: a held write lets the next step train, completes only once written, equals a
    synchronous save of the same state, loads the parameters of the snapshot; retention keeps two;
    a write failing on one rank fails the save on both. About 25 s on 2 cores."""
    from test_trainer import launch

    model = sharpened_checkpoint("dense", tmp_path / "dense")
    launch("async", 2, tmp_path / "out", {"model_dir": str(model)}, script=Path(__file__))
    for rank in (0, 1):
        r = json.loads((tmp_path / "out" / f"result{rank}.json").read_text())
        assert r["in_flight_after_step"] == 1 and r["complete_while_held"] == [], r
        assert r["params_moved"], "the step during the save did not change the weights: nothing proven"
        assert r["complete_after_wait"] == [1]
        assert r["files_equal_sync_save"], "the background save differs from a synchronous save"
        assert r["load_restores_snapshot"], "the checkpoint holds weights from after the snapshot"
        assert r["complete_after_retention"] == [2, 3]
        assert r["failure"] and "could not be written" in r["failure"], r["failure"]
        assert r["complete_after_failure"] == [2, 3]


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(Path(__file__).parent))
    scenario, outdir, args = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    globals()[f"scenario_{scenario}"](outdir, args)
