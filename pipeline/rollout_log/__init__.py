"""The durable rollout log: an fdatasync'd journal of wire frames sealed into immutable HDF5 segments.

Public surface (everything else is the package's own):
- `RolloutLogWriter` (open, append, flush, seal, close) in `writer`;
- `RolloutLog` (read any node's copy: rows, steps, resume state) in `reader`;
- `scan_log` (what a directory holds, damage included) in `scan`;
- the layout, outcomes and errors in `format`; the journal's entries in `journal`; a sealed
  segment's block digests in `digests` and its map (rows readable without HDF5 metadata) in
  `segment_map`; damage and what it cost in `scan` (`LogLoss`) and `reader.ResumeState`; what a
  writer refuses in `write_checks`; a segment file's HDF5 superblock in `hdf5_superblock`.
"""
from pipeline.rollout_log.format import GroupOutcome, LogError
from pipeline.rollout_log.reader import RolloutLog
from pipeline.rollout_log.scan import scan_log
from pipeline.rollout_log.writer import RolloutLogWriter

__all__ = ["GroupOutcome", "LogError", "RolloutLog", "RolloutLogWriter", "scan_log"]
