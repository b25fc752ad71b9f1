"""The run's checkpoint directories: saves written in the background while training goes on,
their completion, and retention.

``RUN/checkpoints/step-K/`` is written as ``step-K.partial/`` and renamed once complete: every
rank's files, then (rank 0) the indexes and ``trainer.json`` (`pipeline.trainer.checkpoint`), then
``COMPLETE``, then the rename. A resume loads the newest complete one (`complete_checkpoints`).

Invariants:
- `CheckpointWriter.save` takes the snapshot between two steps (host copies of every rank's share,
  `snapshot_checkpoint`) and, with ``asynchronous``, writes it in a background thread: the next
  step trains meanwhile. At most one save is in flight: a save first completes the one before it;
- a save completes only once every rank's write ended: `poll` (at each step boundary; with several
  ranks one all-reduce) completes it as soon as all are done, `wait` (before the next save, at the
  end of the run and on a stop) whatever it takes. A write that failed on any rank fails the save
  on every rank, in the main thread (as a synchronous save would);
- retention (``keep`` >= 1): after each completion the complete checkpoints beyond the newest
  ``keep`` are deleted, oldest first. The save in flight (a ``.partial`` directory) is never
  touched, and the newest complete checkpoint, the one a resume would load, is always kept;
  ``keep`` 0 keeps every checkpoint. A deletion that fails (a file still open on a network
  filesystem) never fails the run: the directory stops being a checkpoint first, and is retried;
- host memory: an asynchronous save holds one snapshot, the rank's share of weights and both Adam
  moments in float32 (12 bytes per parameter it writes) until its write ended; a synchronous one
  streams (`pipeline.trainer.hf_shards.SHARD_BYTES` at most).

Worked example: ``run.checkpoint_every=10``, ``run.keep_checkpoints=2``, 35 steps: step-10 is
snapshotted after step 9 and written while steps 10, 11, ... train, and completed at the first
step boundary after its write ended; step-20 and step-30 likewise (step-10 deleted when step-30
completes); the run's last save, step-35, is completed before the trainer returns; step-30 and
step-35 remain.
"""
from __future__ import annotations

import logging
import os
import shutil
import threading
from pathlib import Path

from pipeline.run_files import CHECKPOINTS_DIR, checkpoint_name

from .checkpoint import CheckpointSnapshot, seal_checkpoint, snapshot_checkpoint, write_snapshot

log = logging.getLogger(__name__)
COMPLETE_MARKER = "COMPLETE"
PARTIAL_SUFFIX = ".partial"


def complete_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(steps done, directory) of every complete checkpoint of the run, oldest first."""
    found = []
    for d in (Path(run_dir) / CHECKPOINTS_DIR).glob(checkpoint_name("*")):
        if d.is_dir() and (d / COMPLETE_MARKER).exists():
            found.append((int(d.name.split("-")[1]), d))
    return sorted(found)


def prune_checkpoints(run_dir: Path, keep: int) -> list[Path]:
    """Delete the complete checkpoints beyond the newest ``keep`` (0: none); returns them.

    ``COMPLETE`` goes first, so a directory whose deletion fails half-way (a file still open on a
    network filesystem: NFS's ``.nfs*``, FUSE's ``.fuse_hidden*``) is no checkpoint any more; it is
    logged, and swept by a later call: a ``step-K`` directory without ``COMPLETE`` older than the
    newest complete checkpoint can only be such a remnant (saves are renamed into place complete)."""
    if keep < 1:
        return []
    found = complete_checkpoints(run_dir)
    gone = [d for _, d in found[:-keep]]
    for d in gone:
        (d / COMPLETE_MARKER).unlink()
    newest = found[-1][0] if found else 0
    remnants = [d for d in (Path(run_dir) / CHECKPOINTS_DIR).glob(checkpoint_name("*"))
                if d.is_dir() and d.name.split("-")[1].isdigit() and int(d.name.split("-")[1]) < newest
                and not (d / COMPLETE_MARKER).exists() and d not in gone]
    for d in gone + remnants:
        try:
            shutil.rmtree(d)
        except OSError as exc:
            log.warning("checkpoint %s is no longer complete but could not be deleted yet (%s); a later "
                        "save retries", d.name, exc)
    return gone


class CheckpointWriter:
    """Saves of one trainer into ``run_dir/checkpoints`` (every trainer rank holds one and calls
    `save`, `poll` and `wait` at the same points: they are collectives)."""

    def __init__(self, trainer, run_dir: Path, *, keep: int, asynchronous: bool) -> None:
        import torch.distributed as td

        self.trainer, self.run_dir, self.keep, self.asynchronous = trainer, Path(run_dir), keep, asynchronous
        self.rank, self.world = td.get_rank(), td.get_world_size()
        self.pending: tuple[int, Path, CheckpointSnapshot] | None = None  # (steps, .partial dir, snapshot)
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def directory(self, steps_done: int) -> Path:
        return self.run_dir / CHECKPOINTS_DIR / checkpoint_name(steps_done)

    def save(self, steps_done: int) -> None:
        """Snapshot now; write in the background (``asynchronous``) or before returning."""
        import torch.distributed as td

        self.wait()
        tmp = self.directory(steps_done).with_name(checkpoint_name(steps_done) + PARTIAL_SUFFIX)
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        td.barrier()
        snapshot = snapshot_checkpoint(self.trainer)
        self.pending, self.error = (steps_done, tmp, snapshot), None
        if self.asynchronous:
            self.thread = threading.Thread(target=self._write, name=f"checkpoint-{steps_done}", daemon=True)
            self.thread.start()
        else:
            self._write()
            self._complete()

    def in_flight(self) -> int | None:
        """Steps of the save being written (not yet complete), None when there is none."""
        return self.pending[0] if self.pending else None

    def poll(self) -> None:
        """At a step boundary: complete the save in flight if every rank's write has ended."""
        if self.pending is None:
            return
        writing = self.thread is not None and self.thread.is_alive()
        if self._any_rank(writing):
            return
        self._complete()

    def wait(self) -> None:
        """Complete the save in flight, waiting for its write."""
        if self.pending is not None:
            self._complete()

    def _write(self) -> None:
        steps, tmp, snapshot = self.pending
        try:
            write_snapshot(snapshot, tmp)
        except BaseException as exc:  # reported in the main thread by _complete
            self.error = exc

    def _complete(self) -> None:
        import torch.distributed as td

        if self.thread is not None:
            self.thread.join()
            self.thread = None
        steps, tmp, snapshot = self.pending
        self.pending = None
        if self._any_rank(self.error is not None):
            raise RuntimeError(f"checkpoint {tmp} could not be written on every rank"
                               + (f": {self.error!r}" if self.error else " (another rank failed)")) from self.error
        td.barrier()
        if self.rank == 0:
            seal_checkpoint(snapshot, tmp)
            (tmp / COMPLETE_MARKER).write_text(str(steps))
            final = self.directory(steps)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            for d in prune_checkpoints(self.run_dir, self.keep):
                log.info("deleted checkpoint %s (run.keep_checkpoints=%d)", d.name, self.keep)
        td.barrier()

    def _any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any trainer rank (a collective with several ranks)."""
        if self.world == 1:
            return flag
        import torch
        import torch.distributed as td

        t = torch.tensor([int(flag)], dtype=torch.int64, device="cuda" if self.trainer.cuda else "cpu")
        td.all_reduce(t, op=td.ReduceOp.MAX)
        return bool(t.item())
