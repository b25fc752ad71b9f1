"""Typed records over the wire: one record class per message kind of a channel, decoded by type.

A `Channel` is one conversation between processes (the orchestrator's control plane, the scorer
pool, an environment process, ...). Each declares its records with ``@CHANNEL.message``: a frozen
dataclass with ``KIND`` (and ``ARRAYS`` when it carries raw frames). `encode` turns a record into
the wire's ``(kind, meta, arrays)`` (`pipeline.protocol.wire`: msgpack header, raw array frames,
GMAC over everything); ``CHANNEL.decode`` turns a received `wire.Message` back into its record,
checking every field's type and every required array frame, or raises `MessageError` naming the
kind and the problem. Nothing past ``decode`` indexes a metadata dict. A record that travels as
plain bytes instead (a store value, a broadcast tensor, a REQ/REP answer:
no array frames) is `pack`'d into one msgpack document ``{"kind": KIND, field: value, ...}`` and
`unpack`'d by its class with the same checks.

Invariants:
- within a channel a kind names exactly one record class (``CHANNEL.kinds``); the same kind may
  mean different records on different channels; the record's fields are the header's ``meta``
  (nested records travel as maps), except the field ``arrays``, which travels as raw frames and
  must hold at least the record's ``ARRAYS``;
- ``decode`` never raises anything but `MessageError`: an unknown kind, a missing, unknown or
  ill-typed field, a value out of range (a record's ``__post_init__`` checks, which also stop a
  sender from building it), a missing frame all become one clear error;
- ``encode(decode(m))`` reproduces ``m``'s kind, meta and arrays.

Fields may be ``int``, ``float``, ``str``, ``bool``, ``bytes``, ``X | None``, ``list[X]``, ``dict[str, X]``,
``Any`` (a plain msgpack value, checked by the receiver) or another record.

Worked example: on a channel with ``@C.message class Ping: KIND = "ping"; n: int``,
``encode(Ping(3))`` is ``("ping", {"n": 3}, None)`` and a ``ping`` whose ``n`` is ``"3"`` decodes to
``MessageError("ping: n: expected int, got str")``; ``pack(Ping(3))`` is the msgpack of
``{"kind": "ping", "n": 3}``.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import field
from typing import Any, Union

import msgpack
import numpy as np

from pipeline.protocol.wire import Message


class MessageError(ValueError):
    """A received message is not a well-formed record of a known kind."""

    def __init__(self, kind: str, detail: str):
        super().__init__(f"{kind}: {detail}")
        self.kind, self.detail = kind, detail


class Channel:
    """The record classes of one conversation, by kind (see the module docstring)."""

    def __init__(self, name: str):
        self.name = name
        self.kinds: dict[str, type] = {}
        """Message kind -> its record class."""

    def message(self, cls: type) -> type:
        """Register a record class under its ``KIND``."""
        if cls.KIND in self.kinds:
            raise ValueError(f"{self.name}: message kind {cls.KIND!r} defined twice")
        self.kinds[cls.KIND] = cls
        return cls

    def decode(self, raw: Message) -> Any:
        """The record of a received message, or `MessageError`."""
        cls = self.kinds.get(raw.kind)
        if cls is None:
            raise MessageError(raw.kind, f"unknown message kind on the {self.name} channel")
        try:
            values = _record(cls, raw.meta, "")
            if "arrays" in _hints(cls):
                missing = [a for a in getattr(cls, "ARRAYS", ()) if a not in raw.arrays]
                if missing:
                    raise _Bad(f"missing array frame(s) {', '.join(missing)}")
                values["arrays"] = raw.arrays
            elif raw.arrays:
                raise _Bad("carries array frames it does not define")
            return cls(**values)
        except (_Bad, ValueError) as exc:  # ValueError: a record's own value checks
            raise MessageError(raw.kind, str(exc)) from None


def arrays_field() -> dict[str, np.ndarray]:
    """The ``arrays`` field of a record that carries raw frames."""
    return field(default_factory=dict, repr=False)


MAX_VERSION = 2**31 - 1
"""The largest policy version a message may name: versions travel and are stored as int32 (a
token's ``versions`` column), so a larger one would wrap where a generator stamps its tokens."""


def version_fields(record: Any, *names: str) -> None:
    """`at_least` 0 and at most `MAX_VERSION`: `ValueError` naming the field."""
    at_least(record, 0, *names)
    for name in names:
        value = getattr(record, name)
        if value is not None and value > MAX_VERSION:
            raise ValueError(f"{name} must be <= {MAX_VERSION} (int32), got {value}")


def at_least(record: Any, low: int, *names: str) -> None:
    """Value checks of a record (run when it is built, on either end): `ValueError` naming the field."""
    for name in names:
        value = getattr(record, name)
        if value is not None and value < low:
            raise ValueError(f"{name} must be >= {low}, got {value}")


def encode(msg: Any) -> tuple[str, dict, dict[str, np.ndarray] | None]:
    """``(kind, meta, arrays)`` for `MessageServer.send` / `MessageClient.send`."""
    meta = {f.name: _plain(getattr(msg, f.name)) for f in dataclasses.fields(msg) if f.name != "arrays"}
    arrays = getattr(msg, "arrays", None)
    return msg.KIND, meta, (dict(arrays) if arrays else None)


def pack(record: Any) -> bytes:
    """``record`` (no array frames) as one msgpack document: kind and fields (module docstring)."""
    kind, meta, arrays = encode(record)
    if arrays:
        raise ValueError(f"{kind}: a record with array frames travels as a wire message, not packed")
    return msgpack.packb({"kind": kind, **meta}, use_bin_type=True)


R = typing.TypeVar("R")


def unpack(cls: type[R], raw: bytes | memoryview) -> R:
    """The record of class ``cls`` that `pack` wrote into ``raw``, or `MessageError`."""
    try:
        doc = msgpack.unpackb(raw, raw=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise MessageError(cls.KIND, f"not msgpack ({type(exc).__name__}, {len(raw)} bytes)") from None
    if not isinstance(doc, dict) or doc.get("kind") != cls.KIND:
        got = doc.get("kind") if isinstance(doc, dict) else type(doc).__name__
        raise MessageError(cls.KIND, f"got {str(got)[:80]} instead")
    try:
        return cls(**_record(cls, {k: v for k, v in doc.items() if k != "kind"}, ""))
    except (_Bad, ValueError) as exc:  # ValueError: a record's own value checks
        raise MessageError(cls.KIND, str(exc)) from None


class _Bad(Exception):
    pass


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):  # list[Record]
        return [_plain(v) for v in value]
    return value


def _record(cls: type, meta: Any, where: str) -> dict:
    if not isinstance(meta, dict):
        raise _Bad(f"{where or 'meta'}: expected a map, got {type(meta).__name__}")
    hints = _hints(cls)
    fields = _meta_fields(cls)
    extra = meta.keys() - fields.keys()
    if extra:
        raise _Bad(f"unknown field(s) {', '.join(sorted(map(str, extra)))}")
    out = {}
    for name, f in fields.items():
        if name not in meta:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise _Bad(f"missing field {where}{name}")
            continue
        out[name] = _check(hints[name], meta[name], f"{where}{name}")
    return out


def _check(tp: Any, value: Any, where: str) -> Any:
    origin, args = _parts(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        for arm in args:
            try:
                return _check(arm, value, where)
            except _Bad:
                continue
        raise _Bad(f"{where}: expected {_name(tp)}, got {type(value).__name__}")
    if tp is type(None):
        if value is None:
            return None
    elif dataclasses.is_dataclass(tp):
        return tp(**_record(tp, value, where + "."))
    elif origin is list and isinstance(value, list):
        exact = _exact_types(args[0])
        if exact is not None and all(type(v) in exact for v in value):  # scalars: no call per element
            return list(value)
        return [_check(args[0], v, f"{where}[{i}]") for i, v in enumerate(value)]
    elif origin is dict and isinstance(value, dict):
        return {_check(args[0], k, where): _check(args[1], v, f"{where}[{k!r}]") for k, v in value.items()}
    elif tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    elif tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    elif tp in (str, bool, bytes) and type(value) is tp:
        return value
    raise _Bad(f"{where}: expected {_name(tp)}, got {type(value).__name__}")


def _exact_types(tp: Any) -> frozenset | None:
    """The exact Python types a value of ``tp`` may have when ``tp`` is a scalar `_check` passes
    through unchanged (``int``, ``str``, ``bool``, ``bytes``, ``None``, or a union of them), else
    None; looked up once per type. (``float`` is not: `_check` converts an int to it.)"""
    try:
        return _EXACT[tp]
    except KeyError:
        origin, args = _parts(tp)
        arms = args if origin in (Union, types.UnionType) else (tp,)
        ok = all(arm in (int, str, bool, bytes, type(None)) for arm in arms)
        _EXACT[tp] = found = frozenset(arms) if ok else None
        return found


def _name(tp: Any) -> str:
    origin, args = _parts(tp)
    if origin in (Union, types.UnionType):  # "int | str" for Union[int, str] too, not "Union"
        return " | ".join("None" if arm is type(None) else _name(arm) for arm in args)
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


_HINTS: dict[type, dict[str, Any]] = {}
_PARTS: dict[Any, tuple[Any, tuple]] = {}
_EXACT: dict[Any, frozenset | None] = {}
_FIELDS: dict[type, dict[str, dataclasses.Field]] = {}


def _meta_fields(cls: type) -> dict[str, dataclasses.Field]:
    """A record's fields that travel in the header (all but ``arrays``), looked up once per class."""
    if cls not in _FIELDS:
        _FIELDS[cls] = {f.name: f for f in dataclasses.fields(cls) if f.name != "arrays"}
    return _FIELDS[cls]


def _parts(tp: Any) -> tuple[Any, tuple]:
    """``typing.get_origin`` and ``get_args`` of a field type, looked up once per type."""
    try:
        return _PARTS[tp]
    except KeyError:
        _PARTS[tp] = found = (typing.get_origin(tp), typing.get_args(tp))
        return found


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]
