"""The orchestrator's view of starting generators: what counts as start progress (`GeneratorPool`)."""
from __future__ import annotations

from pipeline.orchestrator.members import PROGRESS_CPU_S, GeneratorPool
from pipeline.protocol.messages import StartProgress


def test_the_pool_counts_growing_cpu_seconds_or_a_new_phase_as_progress():
    pool, peer = GeneratorPool(dead_after_s=10), b"gen-0"
    pool.start_progress(peer, StartProgress(0, "engine", 3.0))
    first = pool.starting[peer].progressed
    pool.start_progress(peer, StartProgress(0, "engine", 3.0 + PROGRESS_CPU_S / 2))  # too little: no progress
    assert pool.starting[peer].progressed == first and pool.starts()[0].cpu_s == 3.0 + PROGRESS_CPU_S / 2
    pool.start_progress(peer, StartProgress(0, "engine", 3.0 + PROGRESS_CPU_S))
    assert pool.starting[peer].progressed > first
    second = pool.starting[peer].progressed
    pool.start_progress(peer, StartProgress(0, "warm-up", 3.0 + PROGRESS_CPU_S))  # a new phase
    assert pool.starting[peer].progressed > second and pool.starts()[0].phase == "warm-up"
    pool.hello(peer)
    assert pool.starts() == []
