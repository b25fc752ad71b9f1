"""Packing named tensors into fixed-size flat byte buckets, and unpacking them without copies.

Weights travel between the trainer and the generators as a few large flat ``uint8`` tensors
("buckets") instead of hundreds of small ones: one collective per bucket reaches the bandwidth of
one large transfer. A `BucketPlan` fixes the layout before any byte moves, from names, dtypes and
shapes alone, so a sender can broadcast the plan first and then stream each bucket as it fills.

Invariants:
- Tensors keep their order; each lies in exactly one bucket at an offset aligned to `ALIGN` bytes
  (so a ``uint8`` slice can be viewed as any dtype without copying).
- A bucket holds tensors until the next one would overflow ``bucket_bytes``; a tensor larger than
  ``bucket_bytes`` gets a bucket of its own, sized to it. No bucket is empty.
- The plan is plain data (`to_wire`/`from_wire` give msgpack-able lists), so it can cross any
  transport; `unpack` returns views into the bucket's storage (no copy).

Worked example, ``ALIGN = 64``: tensors a: fp32[100] (400 B), b: bf16[300] (600 B),
c: fp32[1000] (4000 B), d: fp32[10] (40 B).
With ``bucket_bytes = 2048``: b starts at 448 (400 rounded up to 64) and ends at 1048, so bucket 0 =
[a @ 0, b @ 448] (1048 B); c would end at 1088 + 4000 > 2048, so bucket 1 = [c @ 0] (4000 B, larger
than a bucket, alone); d would end at 4032 + 40 > 2048, so bucket 2 = [d @ 0] (40 B).
With ``bucket_bytes = 1024`` b no longer fits after a: four buckets [a], [b], [c], [d].
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Sequence

if TYPE_CHECKING:
    import torch

#: Byte alignment of every tensor's offset inside a bucket.
ALIGN = 64

#: Supported dtypes by wire name (the name is what travels; torch dtypes are resolved lazily).
DTYPE_NAMES = ("float32", "bfloat16", "float16", "float64", "int64", "int32", "int16", "int8",
               "uint8", "bool")


class BucketError(ValueError):
    """A bucket plan or bucket does not match the tensors or bytes it describes."""


def _torch_dtype(name: str):
    import torch

    if name not in DTYPE_NAMES:
        raise BucketError(f"unsupported dtype {name!r}; supported: {DTYPE_NAMES}")
    return getattr(torch, name)


def dtype_name(dtype) -> str:
    """Wire name of a torch dtype, e.g. torch.bfloat16 -> 'bfloat16'."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise BucketError(f"unsupported dtype {dtype}; supported: {DTYPE_NAMES}")
    return name


def _itemsize(name: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "int64": 8, "int32": 4,
            "int16": 2, "int8": 1, "uint8": 1, "bool": 1}[name]


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor lies in its bucket."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        n = _itemsize(self.dtype)
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class BucketPlan:
    """The layout of every bucket: ``buckets[i]`` lists the slots of bucket i, ``sizes[i]`` its bytes."""

    buckets: tuple[tuple[TensorSlot, ...], ...]
    sizes: tuple[int, ...]

    @classmethod
    def from_specs(cls, specs: Iterable[tuple[str, str, Sequence[int]]], bucket_bytes: int) -> "BucketPlan":
        """Plan buckets for ``(name, dtype name, shape)`` specs, in order (see module docstring)."""
        if bucket_bytes <= 0:
            raise BucketError(f"bucket_bytes must be positive, got {bucket_bytes}")
        buckets: list[list[TensorSlot]] = []
        sizes: list[int] = []
        current: list[TensorSlot] = []
        end = 0
        seen: set[str] = set()
        for name, dtype, shape in specs:
            if name in seen:
                raise BucketError(f"tensor {name!r} appears twice in one weight update")
            seen.add(name)
            slot = TensorSlot(str(name), dtype_name(_torch_dtype(dtype)), tuple(int(s) for s in shape), 0)
            start = -(-end // ALIGN) * ALIGN
            if current and start + slot.nbytes > bucket_bytes:
                buckets.append(current)
                sizes.append(end)
                current, start = [], 0
            current.append(TensorSlot(slot.name, slot.dtype, slot.shape, start))
            end = start + slot.nbytes
        if current:
            buckets.append(current)
            sizes.append(end)
        return cls(tuple(tuple(b) for b in buckets), tuple(sizes))

    @classmethod
    def for_tensors(cls, named: Sequence[tuple[str, "torch.Tensor"]], bucket_bytes: int) -> "BucketPlan":
        return cls.from_specs(((n, dtype_name(t.dtype), tuple(t.shape)) for n, t in named), bucket_bytes)

    @property
    def num_tensors(self) -> int:
        return sum(len(b) for b in self.buckets)

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes)

    def to_wire(self) -> list[Any]:
        """msgpack-able form: ``[[size, [[name, dtype, shape, offset], ...]], ...]``."""
        return [[size, [[s.name, s.dtype, list(s.shape), s.offset] for s in slots]]
                for size, slots in zip(self.sizes, self.buckets)]

    @classmethod
    def from_wire(cls, wire: Sequence[Any]) -> "BucketPlan":
        try:
            sizes = tuple(int(size) for size, _ in wire)
            buckets = tuple(tuple(TensorSlot(str(n), str(d), tuple(int(x) for x in shp), int(off))
                                  for n, d, shp, off in slots) for _, slots in wire)
        except (TypeError, ValueError) as e:
            raise BucketError(f"malformed bucket plan on the wire: {e}") from e
        for size, slots in zip(sizes, buckets):
            for s in slots:
                _torch_dtype(s.dtype)
                if s.offset % ALIGN or s.offset + s.nbytes > size:
                    raise BucketError(f"tensor {s.name!r} at offset {s.offset} does not fit its "
                                      f"{size}-byte bucket or is misaligned")
        return cls(buckets, sizes)


def reusable(pool: list | None, index: int, size: int, device) -> "torch.Tensor":
    """Bucket buffer ``index`` of ``pool`` if it has this size and device, else a new one kept there.

    Reusing buffers across updates avoids touching freshly allocated pages every time (for 64 MiB
    buckets that cost ~4x the copy into them on CPU).
    """
    import torch

    if pool is not None and index < len(pool):
        buf = pool[index]
        if buf.numel() == size and (device is None or buf.device == torch.device(device)):
            return buf
    buf = torch.empty(size, dtype=torch.uint8, device=device)
    if pool is not None:
        if index < len(pool):
            pool[index] = buf
        else:
            pool.append(buf)
    return buf


def pack(plan: BucketPlan, named: Iterable[tuple[str, "torch.Tensor"]], device=None,
         pool: list | None = None) -> Iterator["torch.Tensor"]:
    """Yield each bucket of `plan` as a flat uint8 tensor, filled from `named` in plan order.

    Consumes `named` lazily, one bucket at a time, so a sender can gather the next tensors while
    the previous bucket is in flight. With ``pool`` (a list the caller keeps), bucket buffers are
    reused across calls. Raises `BucketError` when a tensor's name, dtype or shape differs from
    the plan, or when `named` ends early or has extra tensors.
    """
    import torch

    it = iter(named)
    for index, (size, slots) in enumerate(zip(plan.sizes, plan.buckets)):
        buf = None
        for slot in slots:
            try:
                name, t = next(it)
            except StopIteration:
                raise BucketError(f"tensors ended before {slot.name!r} of the plan") from None
            if name != slot.name or dtype_name(t.dtype) != slot.dtype or tuple(t.shape) != slot.shape:
                raise BucketError(f"tensor {name!r} {dtype_name(t.dtype)}{list(t.shape)} does not match "
                                  f"the plan's {slot.name!r} {slot.dtype}{list(slot.shape)}")
            if buf is None:
                buf = reusable(pool, index, size, device if device is not None else t.device)
            flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
            buf[slot.offset:slot.offset + slot.nbytes].copy_(flat)
        yield buf
    extra = next(it, None)
    if extra is not None:
        raise BucketError(f"tensor {extra[0]!r} is not in the bucket plan")


def unpack(slots: Sequence[TensorSlot], bucket: "torch.Tensor") -> Iterator[tuple[str, "torch.Tensor"]]:
    """Yield ``(name, tensor)`` views of one bucket's bytes (no copies; they alias `bucket`)."""
    import torch

    if bucket.dtype != torch.uint8 or bucket.dim() != 1:
        raise BucketError(f"a bucket is a flat uint8 tensor, got {bucket.dtype}{list(bucket.shape)}")
    for s in slots:
        if s.offset + s.nbytes > bucket.numel():
            raise BucketError(f"tensor {s.name!r} ends at byte {s.offset + s.nbytes} beyond the "
                              f"{bucket.numel()}-byte bucket")
        raw = bucket[s.offset:s.offset + s.nbytes]
        yield s.name, raw.view(_torch_dtype(s.dtype)).view(s.shape)
