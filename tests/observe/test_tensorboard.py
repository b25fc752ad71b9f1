"""The TensorBoard mirror (pipeline.observe.tensorboard) writes its event files without torch; what
it writes is read back with TensorBoard's own reader and compared with the same records written
through ``torch.utils.tensorboard.SummaryWriter`` (the writer it replaced), scalars and HParams
session alike. ~3 s (the reference imports torch)."""
from __future__ import annotations

import subprocess
import sys

from pipeline.metrics import MetricsWriter
from pipeline.observe.follow import MetricsFollower, record_scalars


def read_events(tb_dir):
    """(scalars {tag: [(step, wall_time, value)]}, HParams plugin data {tag: HParamsPluginData}) by
    TensorBoard's reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    scalars = {tag: [(e.step, e.wall_time, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    return scalars, {tag: HParamsPluginData.FromString(content)
                     for tag, content in acc.PluginTagToContent("hparams").items()}


def write_with_torch(run_dir, out_dir, params, summary):
    """The same stream through torch's SummaryWriter, as the mirror wrote it before."""
    from torch.utils.tensorboard import SummaryWriter
    from torch.utils.tensorboard.summary import hparams

    writer, step = SummaryWriter(log_dir=str(out_dir)), 0
    for rec in MetricsFollower(run_dir).poll():
        step, at, scalars = record_scalars(rec, step)
        for tag, value in scalars.items():
            writer.add_scalar(tag, value, at, walltime=rec.get("t"))
    metrics = {f"hparams/{k}": float(v) for k, v in summary.items()}
    for proto in hparams(params, metrics):
        writer.file_writer.add_summary(proto)
    for tag, value in metrics.items():
        writer.add_scalar(tag, value, step)
    writer.close()


def test_scalars_and_hparams_equal_torchs_writer(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    m = MetricsWriter(run, "trainer")
    for s in range(4):
        m.log("train_step", step=s, version=s, reward_mean=0.1 * s + 0.05, loss=-0.5 * s)
        m.log("orchestrator", buffer_groups=s, drops=0)
        if s % 2:
            m.log("eval", step=s - 1, version=s - 1, accuracy=0.25 * s, n=200, pass_at_k=0.75, k=4)
    m.close()
    params = {"trainer.lr": 0.0002, "task.name": "sort", "run.steps": 4, "run.progress": False, "skipped": None}
    summary = {"final_accuracy": 0.75, "steps_done": 4}

    mirrored = subprocess.run(  # in a fresh process, as the launcher runs it: torch never imported
        [sys.executable, "-c", "import sys; from pipeline.observe.tensorboard import TensorBoardMirror; "
         f"TensorBoardMirror({str(run)!r}).close(hparams=({params!r}, {summary!r})); "
         "assert 'torch' not in sys.modules, 'torch imported'"], capture_output=True, text=True, timeout=120)
    assert mirrored.returncode == 0, mirrored.stderr
    mine, mine_hparams = read_events(run / "tensorboard")
    write_with_torch(run, tmp_path / "torch", params, summary)
    ref, ref_hparams = read_events(tmp_path / "torch")

    def comparable(scalars):  # the HParams metrics are written at close, stamped with the time of writing
        return {tag: [(step, None if tag.startswith("hparams/") else t, value) for step, t, value in events]
                for tag, events in scalars.items()}

    assert comparable(mine) == comparable(ref)
    assert [(step, round(value, 6)) for step, _, value in mine["train_step/reward_mean"]] == \
        [(s, round(0.1 * s + 0.05, 6)) for s in range(4)]
    assert len(mine["orchestrator/buffer_groups"]) == 4 and mine["hparams/final_accuracy"][0][2] == 0.75
    assert mine_hparams == ref_hparams and len(mine_hparams) == 3  # experiment, session start, session end
    assert mine_hparams["_hparams_/session_start_info"].session_start_info.hparams["task.name"].string_value == "sort"
