"""Packing named tensors into the flat byte buckets of a `BucketPlan`, and unpacking them without copies.

The plan (`pipeline.weights.bucket_plan`) fixes where every tensor lies; this module moves the
bytes: the sender packs each bucket as it fills (`pack`), or sends its large tensors from their own
memory (`segments`), the receiver views each bucket's tensors in place (`unpack`) and reassembles
the tensors split over buckets (`Assembly`), both ends streaming through a `BufferRing`.

Invariants:
- `unpack` returns views into the bucket's storage (no copy); a split tensor is handed out whole,
  from an `Assembly`, once its last piece is in, and its pieces must arrive in order.
- `pack` consumes its tensors lazily, one bucket at a time, and raises `BucketError` when a
  tensor's name, dtype or shape differs from the plan, or the tensors end early or run over.
- A bucket travels as its `segments`: a slot of at least `ALONE_BYTES` alone (from the tensor's
  own memory), each run of smaller slots together (packed); the receiver's bucket gets the same
  bytes at the same offsets either way.
- `BufferRing` is the streaming memory of one end: two flat buffers, bucket k in buffer k % 2,
  each grown to the largest bucket it held; it counts the bytes it allocated (``allocated``), so a
  streamed sync's memory is measured by the code, not read from RSS.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Iterator, Sequence

from pipeline.weights.bucket_plan import BucketError, BucketPlan, TensorSlot, dtype_name, torch_dtype

if TYPE_CHECKING:
    import torch

#: A tensor (or piece) of at least this many bytes travels as a broadcast of its own memory
#: (`segments`) instead of being copied into its bucket's buffer on the sender. Measured side by
#: side on a 0.92 B Qwen3-shaped set, 64 MiB buckets, gloo loopback, 2 cores (packed / one flat
#: tensor): 4 MiB 0.81 (every projection alone: a broadcast each), 16 MiB 1.00 (attention
#: projections packed together, MLP ones alone), 32 and 64 MiB 0.81-0.83 (all copied).
ALONE_BYTES = 16 << 20


class BufferRing:
    """``slots`` reusable flat uint8 buffers on one device: bucket k is built or received in
    buffer k % slots (both ends of a stream use two: `pipeline.weights.group`).

    ``reserve(B)`` (the largest bucket of the stream) makes every (re)allocation at least B, so
    a stream of buckets of at most B bytes allocates at most ``slots`` x B, reused by later
    streams whose buckets are no larger; ``allocated`` counts every byte ever allocated here (the
    streamed-sync memory the benchmark reports).
    """

    def __init__(self, device=None, slots: int = 2):
        if slots < 1:
            raise ValueError(f"a buffer ring needs at least one slot, got {slots}")
        self.device = device
        self.slots = slots
        self._bufs: list = [None] * slots
        self._min = 0
        self.allocated = 0

    def reserve(self, size: int) -> None:
        """The largest bucket of the stream about to pass through: size new buffers for it (a
        buffer already larger is kept and reused)."""
        self._min = int(size)

    @property
    def resident(self) -> int:
        """Bytes held now."""
        return sum(b.numel() for b in self._bufs if b is not None)

    def get(self, index: int, size: int, device=None) -> "torch.Tensor":
        """A ``size``-byte view of buffer ``index % slots`` (grown if needed)."""
        import torch

        dev = torch.device(device if device is not None else (self.device or "cpu"))
        buf = self._bufs[index % self.slots]
        if buf is None or buf.numel() < size or buf.device != dev:
            buf = torch.empty(max(size, self._min), dtype=torch.uint8, device=dev)
            self._bufs[index % self.slots] = buf
            self.allocated += buf.numel()
        return buf[:size]

    def held(self, index: int) -> "torch.Tensor | None":
        """The buffer bucket ``index`` would reuse (None if not allocated yet)."""
        return self._bufs[index % self.slots]

    def release(self) -> None:
        self._bufs = [None] * self.slots


def lone(slots: Sequence[TensorSlot], size: int) -> TensorSlot | None:
    """The one slot that is the whole of a ``size``-byte bucket (a piece of a split tensor filling
    it, or a tensor alone in it), else None: such a bucket's bytes are that tensor's bytes."""
    return slots[0] if len(slots) == 1 and slots[0].offset == 0 and slots[0].nbytes == size else None


def segments(slots: Sequence[TensorSlot], size: int) -> list[tuple[int, int, int | None]]:
    """How one bucket travels: its byte ranges ``(start, end, slot)``, in order, one broadcast
    each, into the same offsets of the receiver's bucket: a slot of at least `ALONE_BYTES` alone
    (``slot`` = its index: the sender sends the tensor's own memory, uncopied), each run of
    smaller slots together (``slot`` None: packed into the sender's bucket buffer). Alignment
    padding outside a run and empty ranges are not sent. E.g. (16 MiB) slots of 24 MiB @ 0,
    4 KiB @ 24 MiB, 2 KiB @ 24 MiB + 4 KiB, 24 MiB @ 24 MiB + 6 KiB -> (0, 24 MiB, 0),
    (24 MiB, 24 MiB + 6 KiB, None), (24 MiB + 6 KiB, 48 MiB + 6 KiB, 3): three broadcasts, of
    which 6 KiB copied."""
    out: list[tuple[int, int, int | None]] = []
    run: list[int] | None = None
    for j, slot in enumerate(slots):
        end = slot.offset + slot.nbytes
        if slot.nbytes >= ALONE_BYTES:
            if run is not None:
                out.append((run[0], run[1], None))
                run = None
            out.append((slot.offset, end, j))
        elif run is None:
            run = [slot.offset, end]
        else:
            run[1] = end
    if run is not None:
        out.append((run[0], run[1], None))
    if out and out[-1][1] > size:
        raise BucketError(f"the slots of a {size}-byte bucket end at byte {out[-1][1]}")
    return [seg for seg in out if seg[1] > seg[0]]


def pack(plan: BucketPlan, named: Iterable[tuple[str, "torch.Tensor"]], device=None,
         buffers: BufferRing | None = None, indices: Sequence[int] | None = None,
         borrow: bool = False) -> Iterator[Any]:
    """Yield buckets of `plan` (``indices``, default all, in order) as flat uint8 tensors filled
    from `named`, which holds exactly those buckets' tensors in plan order.

    Consumes `named` lazily, one bucket at a time, so a sender gathers the next tensors while the
    previous bucket is in flight; a split tensor is taken once, at its first piece, and held until
    its last. With ``buffers`` the bucket yielded k-th lives in buffer k % slots: the consumer must
    be done with it before asking for bucket k + slots. Without, each bucket is new. With ``borrow``
    each bucket is yielded as the list of its `segments`' tensors instead: a segment of one large
    tensor already on the device is a view of that tensor's own bytes, uncopied (the consumer must
    not write to it); the others are views of the bucket's buffer, where only they were packed.
    Raises `BucketError` when a tensor's name, dtype or shape differs from the plan, or when
    `named` ends early or has extra tensors.
    """
    import torch

    it = iter(named)
    indices = range(len(plan.sizes)) if indices is None else indices
    if buffers is not None and len(indices):
        buffers.reserve(max(plan.sizes[i] for i in indices))
    split = None  # the flat bytes of the split tensor whose pieces are being packed
    for k, index in enumerate(indices):
        size, slots = plan.sizes[index], plan.buckets[index]
        segs = segments(slots, size) if borrow else []
        alone = {j for _, _, j in segs if j is not None}
        own: dict[int, "torch.Tensor"] = {}  # slot index -> its tensor's bytes, sent uncopied
        buf = None
        for j, slot in enumerate(slots):
            if slot.part_start == 0:
                try:
                    name, t = next(it)
                except StopIteration:
                    raise BucketError(f"tensors ended before {slot.name!r} of the plan") from None
                if name != slot.name or dtype_name(t.dtype) != slot.dtype or tuple(t.shape) != slot.shape:
                    raise BucketError(f"tensor {name!r} {dtype_name(t.dtype)}{list(t.shape)} does not match "
                                      f"the plan's {slot.name!r} {slot.dtype}{list(slot.shape)}")
                flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
                split = flat if slot.is_piece else None
            elif split is None:
                raise BucketError(f"a piece of {slot.name!r} is packed without its first piece")
            else:
                flat = split
            dev = device if device is not None else flat.device
            piece = flat[slot.part_start:slot.part_start + slot.nbytes]
            if j in alone and flat.device == torch.device(dev):
                own[j] = piece
                continue
            if buf is None:
                buf = (buffers.get(k, size, dev) if buffers is not None
                       else torch.empty(size, dtype=torch.uint8, device=dev))
            buf[slot.offset:slot.offset + slot.nbytes].copy_(piece)
        yield [own[j] if j in own else buf[start:end] for start, end, j in segs] if borrow else buf
    extra = next(it, None)
    if extra is not None:
        raise BucketError(f"tensor {extra[0]!r} is not in the bucket plan")


class Assembly:
    """Reassembles tensors split over buckets on a receiver into memory of the whole tensor's
    size, handed out when its last piece is in: a piece is copied in, or received there directly
    (`target`: a bucket that is one piece, `lone`). ``allocated`` counts the bytes allocated (the
    largest split tensor is what a receiver needs beyond its bucket buffers).

    ``keep`` (a dict owned by the caller, name -> memory) makes the memory outlive the update: a
    later Assembly given the same dict reassembles a tensor of the same name and size in the same
    memory, allocating nothing (a streamed receiver's next update; fresh memory would be
    page-faulted in while gloo writes into it, which cost more than the transfer itself: 1.0 s
    against 0.3 s for a 622 MB embedding on loopback). The tensors handed out then stay valid only
    until the next update that shares ``keep`` begins.
    """

    def __init__(self, keep: dict[str, "torch.Tensor"] | None = None):
        self.allocated = 0
        self._keep = keep
        self._open: dict[str, list] = {}  # name -> [whole tensor's bytes, bytes filled]

    def _whole(self, slot: TensorSlot, device) -> list:
        import torch

        entry = self._open.get(slot.name)
        if entry is None:
            if slot.part_start != 0:
                raise BucketError(f"piece of {slot.name!r} at byte {slot.part_start} arrived before its first")
            kept = None if self._keep is None else self._keep.get(slot.name)
            if kept is None or kept.numel() != slot.tensor_bytes or kept.device != torch.device(device):
                kept = torch.empty(slot.tensor_bytes, dtype=torch.uint8, device=device)
                self.allocated += slot.tensor_bytes
                if self._keep is not None:
                    self._keep[slot.name] = kept
            entry = self._open[slot.name] = [kept, 0]
        return entry

    def target(self, slot: TensorSlot, device) -> "torch.Tensor":
        """Where a bucket that is exactly this piece can be received: the piece's bytes of the whole."""
        whole = self._whole(slot, device)[0]
        return whole[slot.part_start:slot.part_start + slot.nbytes]

    def add(self, slot: TensorSlot, piece: "torch.Tensor") -> "torch.Tensor | None":
        """Take one piece (copied unless it was received in place); the whole tensor once complete
        (else None). Pieces of one tensor must come in order."""
        entry = self._whole(slot, piece.device)
        whole, filled = entry
        if filled != slot.part_start:
            raise BucketError(f"piece of {slot.name!r} at byte {slot.part_start} arrived out of order "
                              f"({filled} bytes filled)")
        dst = whole[slot.part_start:slot.part_start + slot.nbytes]
        if dst.data_ptr() != piece.data_ptr():
            dst.copy_(piece)
        entry[1] = filled = slot.part_start + slot.nbytes
        if filled < slot.tensor_bytes:
            return None
        del self._open[slot.name]
        return whole.view(torch_dtype(slot.dtype)).view(slot.shape)

    def check_complete(self) -> None:
        """Raise if a split tensor still lacks pieces (the update ended early)."""
        if self._open:
            name, (whole, filled) = next(iter(self._open.items()))
            raise BucketError(f"tensor {name!r} is incomplete: {filled} of {whole.numel()} bytes arrived")


def unpack(slots: Sequence[TensorSlot], bucket: "torch.Tensor",
           assembly: Assembly | None = None) -> Iterator[tuple[str, "torch.Tensor"]]:
    """Yield ``(name, tensor)`` views of one bucket's bytes (no copies; they alias `bucket`); a
    split tensor's pieces go to ``assembly``, which yields it whole after its last piece."""
    import torch

    if bucket.dtype != torch.uint8 or bucket.dim() != 1:
        raise BucketError(f"a bucket is a flat uint8 tensor, got {bucket.dtype}{list(bucket.shape)}")
    for s in slots:
        if s.offset + s.nbytes > bucket.numel():
            raise BucketError(f"tensor {s.name!r} ends at byte {s.offset + s.nbytes} beyond the "
                              f"{bucket.numel()}-byte bucket")
        raw = bucket[s.offset:s.offset + s.nbytes]
        if not s.is_piece:
            yield s.name, raw.view(torch_dtype(s.dtype)).view(s.shape)
            continue
        if assembly is None:
            raise BucketError(f"tensor {s.name!r} is split over buckets: unpacking it needs an Assembly")
        whole = assembly.add(s, raw)
        if whole is not None:
            yield s.name, whole
