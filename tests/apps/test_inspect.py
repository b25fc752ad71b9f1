"""`tokenflow inspect`: the summary's values from a log whose contents the test knows."""
from __future__ import annotations

import json

import h5py
import numpy as np
import pytest

from pipeline.apps.inspect_log import main
from pipeline.rollout_log.format import GroupOutcome
from pipeline.protocol.record import FINISH_REASONS, RecordSchema
from pipeline.protocol.sample_batch import SampleBatch
from pipeline.rollout_log.writer import RolloutLogWriter
from support.log_places import list_segments
from support.rollout_data import make_batch

SCHEMA = RecordSchema()


@pytest.fixture
def known_log(tmp_path):
    """20 samples: 8 of version 0 (reward 0.25), 8 of version 1 (reward 0.75), 4 of version 2
    (unscored). Step 0 at trainer version 1 consumes rows 0..7, step 1 at trainer version 2
    consumes rows 8..11; rows 12..19 are not consumed yet."""
    parts = [make_batch(SCHEMA, 1, 8, first_group=0, version=0, reward=0.25),
             make_batch(SCHEMA, 2, 8, first_group=2, version=1, reward=0.75),
             make_batch(SCHEMA, 3, 4, first_group=4, version=2, reward=float("nan"))]
    log_dir = tmp_path / "run" / "rollouts"
    with RolloutLogWriter(log_dir, SCHEMA, "known", {"group_size": 4}) as w:
        for b in parts[:2]:
            w.append_samples(b)
        w.append_groups(np.arange(4), 0, GroupOutcome.STORED, np.arange(4) * 4, 4, [0, 0, 1, 1], 1.0)
        w.append_groups([10, 11], 0, GroupOutcome.FILTERED, -1, 0, 0, 1.0)
        w.append_steps(0, np.arange(8), 0, trainer_step=1, t=2.0)
    with RolloutLogWriter(log_dir, SCHEMA, "known", {"group_size": 4}) as w:  # a second segment
        w.append_samples(parts[2])
        w.append_groups([4, 12], 0, [GroupOutcome.STORED, GroupOutcome.DROPPED_STALE], [16, -1],
                        [4, 0], [2, 0], 3.0)
        w.append_steps(1, np.arange(8, 12), [0, 1, 0, 1], trainer_step=2, t=4.0)
    return tmp_path / "run", SampleBatch.concat(parts)


def _run_json(capsys, *argv, code=0):
    assert main([*map(str, argv), "--json"]) == code
    out = capsys.readouterr().out
    assert out.count("\n") == 1  # one JSON object, the only line on stdout
    return json.loads(out)


def test_json_summary_values(known_log, capsys):
    run_dir, data = known_log
    s = _run_json(capsys, run_dir)
    c = data.columns
    assert s["run_id"] == "known" and s["segments"] == 2 and s["problems"] == []
    assert s["meta"] == {"group_size": 4} and s["record_schema"] == SCHEMA.to_dict()
    assert s["samples"] == 20 and s["consumed_samples"] == 12 and s["lost_rows"] == 0
    assert s["groups"] == {"total": 8, "stored": 5, "filtered": 2, "dropped_stale": 1,
                           "dropped_invalid": 0, "evicted_stale": 0, "dropped_rollback": 0}
    assert s["steps"] == 2 and s["last_step"] == 1
    assert s["tokens"] == {"prompt": int(c["prompt_len"].sum()),
                           "completion": int(c["completion_len"].sum()),
                           "total": int(c["prompt_len"].sum() + c["completion_len"].sum())}
    rv = s["reward_by_version"]
    assert rv["0"] == {"samples": 8, "scored": 8, "mean": pytest.approx(0.25)}
    assert rv["1"] == {"samples": 8, "scored": 8, "mean": pytest.approx(0.75)}
    assert rv["2"] == {"samples": 4, "scored": 0, "mean": None}
    assert s["reward"] == {"mean": pytest.approx(0.5), "scored": 16}
    # consumed: rows 0..7 (v0 at trainer 1) and 8..11 (v1 at trainer 2) -> staleness 1;
    # unconsumed vs the latest trainer version 2: rows 12..15 (v1) -> 1, rows 16..19 (v2) -> 0
    st = s["staleness"]
    assert st["consumed"] == {"1": 12} and st["unconsumed"] == {"0": 4, "1": 4}
    assert st["all"] == {"0": 4, "1": 16} and st["reference_version"] == 2
    for name in ("prompt_len", "completion_len"):
        x = c[name]
        assert s[name]["min"] == x.min() and s[name]["max"] == x.max()
        assert s[name]["mean"] == pytest.approx(x.mean())
        assert s[name]["p50"] == pytest.approx(np.percentile(x, 50))
    assert sum(s["length_histogram"]["completion"]) == 20
    counts = np.bincount(c["finish_reason"], minlength=len(FINISH_REASONS))
    assert s["finish_reasons"] == dict(zip(FINISH_REASONS, counts.tolist()))


def test_text_summary_and_plot(known_log, capsys, tmp_path):
    run_dir, _ = known_log
    png = tmp_path / "summary.png"
    assert main([str(list_segments(run_dir / "rollouts")[0][1]), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "reading the whole log" in out
    assert "samples       20" in out and "stored 5, filtered 2, dropped_stale 1" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image
    img = matplotlib.image.imread(png)
    assert img.shape[0] > 200 and img.shape[1] > 600 and img.std() > 0.01  # not a blank canvas


def test_damaged_segment_is_reported_and_the_rest_summarised(known_log, capsys):
    run_dir, data = known_log
    seg1 = list_segments(run_dir / "rollouts")[1][1]
    seg1.write_bytes(seg1.read_bytes()[:1000])
    s = _run_json(capsys, run_dir, code=1)  # damage: reported, exit 1
    assert s["samples"] == 16 and s["lost_rows"] == 4 and len(s["problems"]) == 2  # the header knows
    assert seg1.name in capsys.readouterr().err or seg1.name in s["problems"][0]


def test_bad_paths_exit_2_naming_the_problem(tmp_path, capsys):
    junk = tmp_path / "junk.h5"
    junk.write_bytes(b"definitely not hdf5" * 100)
    foreign = tmp_path / "foreign.h5"
    with h5py.File(foreign, "w") as f:
        f["x"] = np.arange(3)
    newer = tmp_path / "newer"
    with RolloutLogWriter(newer / "rollouts", SCHEMA, "n", {}) as w:
        w.append_samples(make_batch(SCHEMA, 0, 2))
    with h5py.File(list_segments(newer / "rollouts")[0][1], "r+") as f:
        f.attrs["tokenflow_schema_version"] = 5
    for journal in (newer / "rollouts").glob("*.tfj"):  # segments only: their attributes decide
        journal.unlink()
    for path, problem in ((tmp_path / "nope", "no such file"), (junk, "not an HDF5 file"),
                          (foreign, "not a Tokenflow rollout log"), (newer, "version 5"),
                          (tmp_path, "no rollout log here")):
        assert main([str(path), "--json"]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and problem in captured.err and "error" in captured.err
    assert main(["--no-such-flag", str(junk)]) == 2


def test_unconsumed_staleness_uses_the_newest_known_version(tmp_path, capsys):
    log_dir = tmp_path / "rollouts"
    with RolloutLogWriter(log_dir, SCHEMA, "n", {}) as w:
        w.append_samples(make_batch(SCHEMA, 0, 2, version=0))
        w.append_samples(make_batch(SCHEMA, 1, 2, version=3))  # generated after the last step
        w.append_steps(0, [0], 0, trainer_step=1, t=0.0)
    st = _run_json(capsys, log_dir)["staleness"]
    assert st["reference_version"] == 3 and st["consumed"] == {"1": 1}
    assert st["unconsumed"] == {"0": 2, "3": 1} and st["all"] == {"0": 2, "1": 1, "3": 1}


def test_live_log_shows_unsealed_rows_and_how_far_behind_it_may_be(known_log, capsys):
    run_dir, data = known_log
    w = RolloutLogWriter(run_dir / "rollouts", SCHEMA, "known", {"group_size": 4},
                         seal_interval_s=3600)
    try:
        extra = make_batch(SCHEMA, 9, 4, first_group=20, version=2)
        w.append_samples(extra)
        w.flush()  # acknowledged: in the journal, not sealed
        s = _run_json(capsys, run_dir)
        assert s["samples"] == 24 and s["segments"] == 3  # two sealed + the journal's rows
        assert s["tokens"]["total"] == int(data.num_tokens + extra.num_tokens)
        assert s["journal"].startswith(f"read {w.path.name} up to byte {w.path.stat().st_size}")
    finally:
        w.close()
    s = _run_json(capsys, run_dir)
    assert s["samples"] == 24 and s["segments"] == 3  # now all sealed
