"""A full disk (ENOSPC) under the rollout log's writer, on a real filesystem: a few-MB ext4 image
mounted on a loop device by the test (root only; the writer refuses nothing here, tmpfs would do
for kill -9 but not give this error the way a disk does)."""
from __future__ import annotations

import os
import shutil
import subprocess

import numpy as np
import pytest

from pipeline.protocol.record import RecordSchema
from pipeline.protocol.sample_batch import SampleBatch
from pipeline.rollout_log.format import LogFullError
from pipeline.rollout_log.reader import RolloutLog
from pipeline.rollout_log.writer import RolloutLogWriter
from support.rollout_data import assert_batches_equal, make_batch

SCHEMA = RecordSchema()


@pytest.fixture
def small_ext4(tmp_path):
    """A mounted 8 MB ext4 filesystem (unmounted after the test)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a loop device needs root (CI runs the suite as root)")
    image, mnt = tmp_path / "disk.img", tmp_path / "mnt"
    mnt.mkdir()
    with open(image, "wb") as fh:
        fh.truncate(8 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], check=True, timeout=60)
    subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], check=True, timeout=60)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True, timeout=60)


def _fill(path) -> None:
    """Write ``path`` until the filesystem is full."""
    with open(path, "wb") as fh:
        try:
            while True:
                fh.write(bytes(64 << 10))
                fh.flush()
                os.fsync(fh.fileno())
        except OSError:
            pass


def test_disk_full_stops_the_writer_cleanly_and_a_start_after_freeing_space_resumes(small_ext4):
    log_dir = small_ext4 / "run" / "rollouts"
    w = RolloutLogWriter(log_dir, SCHEMA, "full", {}, seal_interval_s=3600)
    with open(small_ext4 / "filler", "wb") as fh:  # leave ~1.5 MB: a few flushes fill it
        fh.write(bytes(shutil.disk_usage(small_ext4).free - 1_500_000))
    acked: list[SampleBatch] = []
    with pytest.raises(LogFullError, match="no space left") as stopped:
        for i in range(1000):
            batch = make_batch(SCHEMA, i, 8, first_group=2 * i, completion_len=(500, 1000))
            w.append_samples(batch)
            w.flush()
            acked.append(batch)
    assert acked and "tmpfs" not in str(stopped.value) and "cannot hold" not in str(stopped.value)
    with pytest.raises(LogFullError):  # stopped: nothing more is taken
        w.append_samples(acked[0])
    w.close()  # closes its files; sealing is the next start's work

    def files():
        return sorted(os.listdir(log_dir))
    assert [n for n in files() if n.startswith("journal")] == ["journal-00000000.tfj"]
    assert not [n for n in files() if n.endswith(".tmp") or n.startswith(".")]
    n = 8 * len(acked)
    with RolloutLog.open(log_dir) as log:  # every acknowledged flush, nothing torn
        assert log.num_samples == n and not log.problems and log.scan.torn is None
        assert_batches_equal(log.read(np.arange(n)), SampleBatch.concat(acked))

    _fill(small_ext4 / "rest")  # now nothing at all is free: the start's probe fails
    before = files()
    with pytest.raises(LogFullError, match="no space left") as refused:
        RolloutLogWriter(log_dir, SCHEMA, "full", {})
    assert "cannot hold" not in str(refused.value) and files() == before
    (small_ext4 / "rest").unlink()  # a little space: the probe passes, sealing does not fit
    with pytest.raises(LogFullError, match="no space left"):
        RolloutLogWriter(log_dir, SCHEMA, "full", {})
    assert files() == before  # no empty claimed journal, no half-written segment

    (small_ext4 / "filler").unlink()  # space freed: the next start resumes
    with RolloutLogWriter(log_dir, SCHEMA, "full", {}) as w2:
        assert w2.first_row == n
        extra = make_batch(SCHEMA, 999, 3, first_group=5000)
        w2.append_samples(extra)
    with RolloutLog.open(log_dir) as log:
        assert log.num_samples == n + 3 and not log.problems
        assert_batches_equal(log.read(np.arange(n + 3)), SampleBatch.concat(acked + [extra]))
