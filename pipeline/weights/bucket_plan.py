"""The layout of weight buckets: which tensor, or piece of one, lies where in which flat byte bucket.

Weights travel between the trainer and the generators as a few large flat ``uint8`` tensors
("buckets") instead of hundreds of small ones: one collective per bucket reaches the bandwidth of
one large transfer. A `BucketPlan` fixes the layout before any byte moves, from names, dtypes and
shapes alone, so a sender can broadcast the plan first and then stream each bucket as it fills
(packing, unpacking and the streaming memory: `pipeline.weights.buckets`).

Invariants:
- Tensors keep their order; each lies in one bucket at an offset aligned to `ALIGN` bytes (so a
  ``uint8`` slice can be viewed as any dtype without copying), except a tensor larger than
  ``bucket_bytes``, which is split into pieces (byte ranges) over consecutive buckets.
- No bucket exceeds ``bucket_bytes`` and none is empty: a bucket holds tensors until the next one
  would overflow it; a tensor larger than a bucket starts a new bucket and fills whole buckets,
  its last piece's bucket taking the tensors after it as usual. So the two buffers of either end
  hold at most two buckets whatever the model's largest tensor (a 1 GB embedding streams through
  2 x bucket_bytes); a receiver that must hand whole tensors on reassembles a split tensor into
  memory of its own size (`pipeline.weights.buckets.Assembly`, counted apart), receiving its
  whole-bucket pieces there directly (they never occupy a bucket buffer).
- The tensors of one fused module (`fused_module`: q/k/v, gate/up, an expert's w1/w3, with their
  biases), consecutive in the specs, share a bucket when they fit in one: a bucket closes before
  such a run that would overflow it. A receiver loading module by module (vLLM's layerwise
  reload) then finishes each module within its bucket and holds no view of the bucket before.
- Every tensor has a source (the sender rank that owns it; 0 unless given) and a bucket holds the
  tensors of one source only: a change of source closes the bucket, so several senders (one per
  expert-parallel rank) can stream their own buckets of one plan.
- The plan is plain data (`to_wire`/`from_wire` give msgpack-able lists), so it can cross any
  transport; `from_wire` rejects a slot that is misaligned, outside its bucket or of an unknown dtype.

Worked example, ``ALIGN = 64``: tensors a: fp32[100] (400 B), b: bf16[300] (600 B),
c: fp32[1000] (4000 B), d: fp32[10] (40 B).
With ``bucket_bytes = 2048``: b starts at 448 (400 rounded up to 64) and ends at 1048, so bucket 0 =
[a @ 0, b @ 448] (1048 B); c (4000 B) is larger than a bucket: bucket 1 = [c bytes 0-2047 @ 0]
(2048 B), bucket 2 = [c bytes 2048-3999 @ 0, d @ 1984] (2024 B).
With ``bucket_bytes = 1024`` b no longer fits after a: [a], [b], then c in pieces of 1024, 1024,
1024 and 928 bytes, d joining the last: [c 3072-3999 @ 0, d @ 960] (1000 B) - six buckets.
Fused modules, ``bucket_bytes = 2048``: x.norm.weight fp32[100] (400 B), then x.q_proj.weight,
x.k_proj.weight, x.v_proj.weight, bf16[300] (600 B) each. Alone, q (448-1048) and k (1088-1688)
would join the norm's bucket and v start the next; as one module (1880 B with alignment) they do
not fit after the norm, but do fit in a bucket: bucket 0 = [norm], bucket 1 = [q @ 0, k @ 640,
v @ 1280].
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Sequence

if TYPE_CHECKING:
    import torch

#: Byte alignment of every tensor's offset inside a bucket.
ALIGN = 64

#: Supported dtypes by wire name (the name is what travels; torch dtypes are resolved lazily).
DTYPE_NAMES = ("float32", "bfloat16", "float16", "float64", "int64", "int32", "int16", "int8",
               "uint8", "bool")


#: Members of a module vLLM fuses on loading: q/k/v into qkv_proj, gate/up into gate_up_proj (also
#: an expert's), Mixtral-style w1/w3 into w13.
_FUSED = re.compile(r"(?<=\.)(?:(q|k|v)_proj|(gate|up)_proj|(w1|w3))(?=\.[^.]+$)")


def fused_module(name: str) -> str:
    """The module a tensor is loaded into: its name without the leaf, fused members named alike,
    e.g. 'model.layers.0.self_attn.k_proj.bias' -> 'model.layers.0.self_attn.qkv'."""
    stem = _FUSED.sub(lambda m: "qkv" if m.group(1) else ("gate_up" if m.group(2) else "w13"), name)
    return stem.rsplit(".", 1)[0]


class BucketError(ValueError):
    """A bucket plan or bucket does not match the tensors or bytes it describes."""


def torch_dtype(name: str):
    """The torch dtype of a wire name, e.g. 'bfloat16' -> torch.bfloat16."""
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


def itemsize(name: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "int64": 8, "int32": 4,
            "int16": 2, "int8": 1, "uint8": 1, "bool": 1}[name]


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor (or one piece of a split tensor) lies in its bucket."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    part_start: int = 0
    """First byte of the tensor this slot holds (a piece of a split tensor starts later than 0)."""
    part_bytes: int | None = None
    """Bytes of the tensor this slot holds (None: the whole tensor)."""

    @property
    def tensor_bytes(self) -> int:
        n = itemsize(self.dtype)
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        """Bytes this slot occupies in its bucket."""
        return self.tensor_bytes if self.part_bytes is None else self.part_bytes

    @property
    def is_piece(self) -> bool:
        return self.part_bytes is not None


@dataclass(frozen=True)
class BucketPlan:
    """The layout of every bucket: ``buckets[i]`` lists the slots of bucket i, ``sizes[i]`` its
    bytes, ``sources[i]`` the sender that streams it."""

    buckets: tuple[tuple[TensorSlot, ...], ...]
    sizes: tuple[int, ...]
    sources: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.sources:
            object.__setattr__(self, "sources", (0,) * len(self.sizes))
        if len(self.sources) != len(self.sizes) or len(self.buckets) != len(self.sizes):
            raise BucketError(f"a plan of {len(self.buckets)} buckets has {len(self.sizes)} sizes "
                              f"and {len(self.sources)} sources")

    @classmethod
    def from_specs(cls, specs: Iterable[Sequence[Any]], bucket_bytes: int) -> "BucketPlan":
        """Plan buckets for ``(name, dtype name, shape[, source])`` specs, in order (module docstring)."""
        if bucket_bytes <= 0:
            raise BucketError(f"bucket_bytes must be positive, got {bucket_bytes}")
        specs = [(str(sp[0]), dtype_name(torch_dtype(sp[1])), tuple(int(x) for x in sp[2]),
                  int(sp[3]) if len(sp) > 3 else 0) for sp in specs]
        modules = [(fused_module(name), src) for name, _, _, src in specs]
        joins_next = [a == b for a, b in zip(modules, modules[1:])] + [False]  # same module, same sender
        run = [0] * (len(specs) + 1)  # bytes from tensor i to the end of its module's run (aligned)
        for i in reversed(range(len(specs))):
            nbytes = TensorSlot(*specs[i][:3], 0).nbytes
            run[i] = -(-nbytes // ALIGN) * ALIGN + run[i + 1] if joins_next[i] else nbytes
        buckets: list[list[TensorSlot]] = []
        sizes: list[int] = []
        sources: list[int] = []
        current: list[TensorSlot] = []
        end, source = 0, 0
        seen: set[str] = set()
        for i, (name, dtype, shape, src) in enumerate(specs):
            if name in seen:
                raise BucketError(f"tensor {name!r} appears twice in one weight update")
            seen.add(name)
            slot = TensorSlot(name, dtype, shape, 0)
            start = -(-end // ALIGN) * ALIGN
            starts_module = i == 0 or not joins_next[i - 1]
            need = run[i] if starts_module and run[i] <= bucket_bytes else slot.nbytes
            if current and (start + need > bucket_bytes or src != source):
                buckets.append(current)
                sizes.append(end)
                sources.append(source)
                current, start = [], 0
            source = src
            if slot.nbytes <= bucket_bytes:
                current.append(TensorSlot(slot.name, slot.dtype, slot.shape, start))
                end = start + slot.nbytes
                continue
            for first in range(0, slot.nbytes, bucket_bytes):  # split: whole buckets, then the rest
                part = min(bucket_bytes, slot.nbytes - first)
                current = [TensorSlot(slot.name, slot.dtype, slot.shape, 0, first, part)]
                end = part
                if first + part < slot.nbytes:
                    buckets.append(current)
                    sizes.append(end)
                    sources.append(source)
        if current:
            buckets.append(current)
            sizes.append(end)
            sources.append(source)
        return cls(tuple(tuple(b) for b in buckets), tuple(sizes), tuple(sources))

    @classmethod
    def for_tensors(cls, named: Sequence[tuple[str, "torch.Tensor"]], bucket_bytes: int) -> "BucketPlan":
        return cls.from_specs(((n, dtype_name(t.dtype), tuple(t.shape)) for n, t in named), bucket_bytes)

    @property
    def num_tensors(self) -> int:
        """Tensors in the plan (a split tensor counts once)."""
        return sum(1 for b in self.buckets for s in b if s.part_start == 0)

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes)

    def of_source(self, source: int) -> list[int]:
        """Indices of the buckets `source` streams, in order."""
        return [i for i, s in enumerate(self.sources) if s == source]

    def to_wire(self) -> list[Any]:
        """msgpack-able form: ``[[size, source, [[name, dtype, shape, offset(, part_start,
        part_bytes)], ...]], ...]`` (the piece fields only for a piece of a split tensor)."""
        return [[size, src, [[s.name, s.dtype, list(s.shape), s.offset]
                             + ([s.part_start, s.part_bytes] if s.is_piece else []) for s in slots]]
                for size, src, slots in zip(self.sizes, self.sources, self.buckets)]

    @classmethod
    def from_wire(cls, wire: Sequence[Any]) -> "BucketPlan":
        try:
            sizes = tuple(int(size) for size, _, _ in wire)
            sources = tuple(int(src) for _, src, _ in wire)
            buckets = tuple(tuple(TensorSlot(str(n), str(d), tuple(int(x) for x in shp), int(off),
                                             *(int(x) for x in piece))
                                  for n, d, shp, off, *piece in slots) for _, _, slots in wire)
        except (TypeError, ValueError) as e:
            raise BucketError(f"malformed bucket plan on the wire: {e}") from e
        for size, slots in zip(sizes, buckets):
            for s in slots:
                torch_dtype(s.dtype)
                if s.offset % ALIGN or s.offset + s.nbytes > size:
                    raise BucketError(f"tensor {s.name!r} at offset {s.offset} does not fit its "
                                      f"{size}-byte bucket or is misaligned")
                if s.is_piece and not (0 <= s.part_start and 0 < s.part_bytes
                                       and s.part_start + s.part_bytes <= s.tensor_bytes):
                    raise BucketError(f"piece of tensor {s.name!r} (bytes {s.part_start}+{s.part_bytes}) "
                                      f"lies outside its {s.tensor_bytes} bytes")
        return cls(buckets, sizes, sources)
