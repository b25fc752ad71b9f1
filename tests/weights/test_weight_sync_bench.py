"""bench/weight_sync.py's bandwidth part at quick sizes, checked in detail: every mode moved every
byte, and the report is complete and consistent (its smoke mode, with the others, is in
`tests/bench/test_bench_smoke.py`)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_weight_sync_bandwidth_quick_reports_every_mode():
    """bench/weight_sync.py's bandwidth part at quick sizes, one repetition: every mode moved every
    byte and the report is complete and consistent (the benchmark itself raises when a mode
    receives the wrong byte count). Two real processes over a real gloo `TorchDistChannel`."""
    proc = subprocess.run([sys.executable, str(BENCH / "weight_sync.py"), "--quick", "--part", "bandwidth",
                           "--reps", "1", "--big-layers", "1", "--big-vocab", "4096"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["bench"] == "weight_sync" and "stall" not in report and "layouts" not in report
    sets = report["bandwidth"]["sets"]
    assert set(sets) == {"tiny-dense", "tiny-moe", "big"}
    big = sets["big"]
    params = 50_336_000 + 2048 * 4096 + 2048  # one layer, the embedding, the final norm
    assert big["tensors"] == 13 and big["bytes"] == 2 * params and big["params"] == params
    for name, r in sets.items():
        assert r["buckets"] >= 1, name
        for mode in ("packed", "single", "unbatched"):
            assert r[f"{mode}_s"] > 0, (name, mode)
            assert abs(r[f"{mode}_GBps"] - r["bytes"] / r[f"{mode}_s"] / 1e9) < 1e-6 * r[f"{mode}_GBps"]
        assert abs(r["ratio"] - r["packed_GBps"] / r["single_GBps"]) < 1e-9
    assert report["bandwidth"]["big_params"] == params
    assert report["bandwidth_met"] is False  # the target needs the set of >= 1 B parameters
    memory = report["bandwidth"]["sync_memory"]
    assert memory["model_bytes"] == big["bytes"]
    # every tensor of this set is below one bucket: the bounds are two buckets of at most 64 MiB on either end
    assert memory["largest_bucket_bytes"] <= report["bucket_bytes"]
    assert memory["sender_bound_bytes"] == 2 * memory["largest_bucket_bytes"]
    assert memory["receiver_bound_bytes"] == 2 * memory["largest_bucket_bytes"]
    # the streamed sync's buffers: two buckets at most on either end, whatever the model's size
    assert 0 < memory["sender_bytes"] <= memory["sender_bound_bytes"]
    assert 0 < memory["receiver_bytes"] <= memory["receiver_bound_bytes"]
    assert memory["within_bound"]
