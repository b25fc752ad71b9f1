"""The rollout log journal's entries as typed records: the header and the flushes.

A journal entry on disk is one `pipeline.protocol.wire` message (framing and checksum:
`pipeline.rollout_log.journal`); its kind and header decode, by type (`codec`), into one record of
`JOURNAL`: `JournalHeader` (kind ``journal``, the first entry and its copy) or `FlushEntry` (kind
``flush``, every later one). A journal entry whose fields do not decode is damage like a failed
checksum: the reader skips it (`MessageError`), nothing past decoding indexes a metadata dict.

Invariants:
- what older Tokenflow wrote still decodes: fields added since are optional with the value their
  absence meant (a flush without ``row`` starts where the previous one ended; a header without
  ``carried`` carries nothing; a quarantine without ``lost_entries`` recorded no loss);
- a header's ``layout`` is the log layout version of its flushes' datasets
  (`pipeline.rollout_log.format.SCHEMA_VERSION` when written; a reader maps older dataset names
  with `format.stored_name`).

Worked example: the header of generation 4 whose log holds segments 0 and 2 (rows 0-99, 100-139)
has ``start_seq`` 15, ``start_row`` 140 and arrays ``segments`` [0, 2], ``segment_first_rows``
[0, 100], ``segment_rows`` [100, 40]; its next flush of 8 rows is ``FlushEntry(seq=15, row=140,
...)`` and the one after it ``FlushEntry(seq=16, row=148, ...)``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from pipeline.protocol.codec import Channel, arrays_field

JOURNAL = Channel("rollout log journal")


@dataclass(frozen=True)
class Predecessor:
    """Where the journal this generation took over from validly ended."""
    gen: int
    writer: str
    valid_end: int
    """Bytes of its valid prefix; anything a stale writer appended after it is ignored."""
    last_seq: int
    torn: str | None
    """Why it was read only up to ``valid_end`` (None: read whole)."""


@dataclass(frozen=True)
class CarriedJournal:
    """A damaged journal copied aside (``*.tfj.damaged``) whose intact entries stay in the log,
    and what its damage cost (`pipeline.rollout_log.scan.LogLoss`)."""
    file: str
    gen: int
    valid_end: int
    lost_entries: int | None = None
    """None: written before quarantines recorded their loss."""
    lost_segments: int = 0
    lost_rows: int = 0
    lost_step_records: int = 0
    withhold_below: int = 0


@JOURNAL.message
@dataclass(frozen=True)
class JournalHeader:
    KIND: ClassVar[str] = "journal"
    ARRAYS: ClassVar[tuple[str, ...]] = ("segments",)
    """Also, since layout 3: ``segment_first_rows``, ``segment_rows``, ``segment_layouts`` (int64,
    one per listed segment)."""
    layout: int
    run_id: str
    gen: int
    record_schema: dict[str, Any]
    """`RecordSchema.to_dict()`."""
    writer: str
    start_seq: int
    """Sequence number of this generation's first flush."""
    start_row: int
    """Global row of this generation's first sample."""
    meta: dict[str, Any]
    created: float
    predecessor: Predecessor | None = None
    carried: list[CarriedJournal] = field(default_factory=list)
    arrays: dict[str, np.ndarray] = arrays_field()


@JOURNAL.message
@dataclass(frozen=True)
class FlushEntry:
    KIND: ClassVar[str] = "flush"
    seq: int
    t: float | None = None
    """Writer's wall-clock time of the flush (None: not recorded)."""
    row: int | None = None
    """Global row of its first sample (None: where the previous flush ended)."""
    prompt_at: int = 0
    completion_at: int = 0
    """This generation's prompt / completion token offsets before it."""
    steps_at: int | None = None
    """Step records before it in this generation (None: where the previous flush ended)."""
    arrays: dict[str, np.ndarray] = arrays_field()
    """The new rows of every dataset of the log layout (a writer may give a dataset as its
    `pipeline.protocol.wire.Pieces`, written as one frame; read back, each is one array)."""
