"""Decoding the native device's batches: the wire records of ``csrc/record.h``.

A sans-IO reader (no torch, no sockets): ``decode(batch, names)`` turns the bytes that
``take_batch()`` returns into typed records, with op indexes resolved through the name
table (``op_names()``). The tests use it to check what the device recorded; the
executor's replay loop (``csrc/replay.cpp``) reads the same format. Malformed bytes
raise ``MalformedMessageError``, since a batch is a peer's input on the executor.

``encode(records, names)`` is the inverse: a session's checkpoints read and restore
storages with it (``checkpoint.py``), and tests feed the executor batches the device
would not write (forged handles, unknown ops, truncations).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .._errors import MalformedMessageError

_HEAD = struct.Struct("<BI")
#: Bytes of a record's header (its kind and its body's length).
HEAD_BYTES = _HEAD.size
#: TENSOR_BITS flags: a lazily conjugated or negated view.
CONJ_BIT, NEG_BIT = 1, 2
#: c10::ScalarType's numbering, the `dtype` byte of tensor values (torch's names).
DTYPES = (
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "float16",
    "float32",
    "float64",
    "complex32",
    "complex64",
    "complex128",
    "bool",
    "qint8",
    "quint8",
    "qint32",
    "bfloat16",
    "quint4x2",
    "quint2x4",
    "bits1x8",
    "bits2x4",
    "bits4x2",
    "bits8",
    "bits16",
    "float8_e5m2",
    "float8_e4m3fn",
    "float8_e5m2fnuz",
    "float8_e4m3fnuz",
    "uint16",
    "uint32",
    "uint64",
)


@dataclass(frozen=True)
class TensorRef:
    """A view of a device storage: the executor caches one view per distinct reference."""

    handle: int
    offset: int
    dtype: str
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    #: ``CONJ_BIT`` and ``NEG_BIT``: a lazily conjugated or negated view (TENSOR_BITS).
    bits: int = 0


@dataclass(frozen=True)
class HostTensor:
    """A host tensor sent by value (an upload's source, a CPU scalar argument)."""

    dtype: str
    sizes: tuple[int, ...]
    data: bytes
    #: A Python number torch wrapped as a 0-dim tensor (NUMBER): promoted as a scalar.
    number: bool = False


@dataclass(frozen=True)
class Device:
    type: int
    index: int


@dataclass(frozen=True)
class Generator:
    """The session's generator on the executor."""


@dataclass(frozen=True)
class Op:
    op: str
    args: tuple[Any, ...]
    outs: tuple[Any, ...]


@dataclass(frozen=True)
class Alloc:
    handle: int
    nbytes: int


@dataclass(frozen=True)
class Upload:
    dst: TensorRef
    src: HostTensor


@dataclass(frozen=True)
class Readback:
    src: TensorRef


@dataclass(frozen=True)
class Free:
    handle: int


@dataclass(frozen=True)
class Resize:
    handle: int
    nbytes: int


@dataclass(frozen=True)
class Dyn:
    """An op only running can shape: the executor binds its tensor results to
    ``handles`` (0 for a non-tensor return) and answers with their shapes."""

    name: str
    args: tuple
    handles: tuple[int, ...]


@dataclass(frozen=True)
class Seed:
    """The session's generator starts over from ``seed``."""

    seed: int


@dataclass(frozen=True)
class RngGet:
    """The client waits for the session generator's state."""


@dataclass(frozen=True)
class RngSet:
    """The session's generator takes ``state`` (bytes an RNG_GET read)."""

    state: bytes


@dataclass(frozen=True)
class Graph:
    """A compiled graph's definition (``wire/graph_def.py``'s bytes), kept under ``graph``."""

    graph: int
    definition: bytes


@dataclass(frozen=True)
class Run:
    """One call of graph ``graph``: its inputs, and a new-handle tensor for each output
    the client needs (None for the others)."""

    graph: int
    args: tuple
    outs: tuple


Record = Op | Alloc | Upload | Readback | Free | Resize | Dyn | Seed | RngGet | RngSet | Graph | Run


class _Reader:
    """A cursor over one record's bytes; every read is bounds-checked."""

    def __init__(self, data: bytes | memoryview) -> None:
        self.data = memoryview(data)
        self.at = 0

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.at + size > len(self.data):
            raise MalformedMessageError(f"record truncated at byte {self.at}")
        (value,) = struct.unpack_from(fmt, self.data, self.at)
        self.at += size
        return value

    def ints(self, n: int) -> tuple[int, ...]:
        return tuple(self.take("<q") for _ in range(n))

    def raw(self, n: int) -> bytes:
        if self.at + n > len(self.data):
            raise MalformedMessageError(f"record truncated at byte {self.at}")
        self.at += n
        return bytes(self.data[self.at - n : self.at])

    def dtype(self) -> str:
        code = self.take("<B")
        if code >= len(DTYPES):
            raise MalformedMessageError(f"unknown dtype code {code}")
        return DTYPES[code]


def _tensor(r: _Reader, bits: int = 0) -> TensorRef:
    handle, offset, dtype = r.take("<Q"), r.take("<q"), r.dtype()
    ndim = r.take("<B")
    return TensorRef(handle, offset, dtype, r.ints(ndim), r.ints(ndim), bits)


def _tensor_bits(r: _Reader) -> TensorRef:
    bits = r.take("<B")
    if bits & ~(CONJ_BIT | NEG_BIT):
        raise MalformedMessageError(f"unknown tensor bits {bits}")
    return _tensor(r, bits)


def _host_tensor(r: _Reader, number: bool = False) -> HostTensor:
    dtype = r.dtype()
    sizes = r.ints(r.take("<B"))
    return HostTensor(dtype, sizes, r.raw(r.take("<Q")), number)


def _string(r: _Reader) -> str:
    return r.raw(r.take("<I")).decode()


_VALUES: dict[int, Callable[[_Reader], Any]] = {
    0: lambda r: None,
    1: _tensor,
    2: _host_tensor,
    3: lambda r: r.take("<q"),
    4: lambda r: r.take("<d"),
    5: lambda r: bool(r.take("<B")),
    6: lambda r: complex(r.take("<d"), r.take("<d")),
    7: _string,
    8: lambda r: tuple(_value(r) for _ in range(r.take("<I"))),
    9: lambda r: r.ints(r.take("<I")),
    10: lambda r: Device(r.take("<b"), r.take("<b")),
    11: lambda r: Generator(),
    12: _tensor_bits,
    13: lambda r: _host_tensor(r, number=True),
}


def _value(r: _Reader) -> Any:
    tag = r.take("<B")
    if tag not in _VALUES:
        raise MalformedMessageError(f"unknown value tag {tag}")
    return _VALUES[tag](r)


def _op_name(r: _Reader, names: Sequence[str]) -> str:
    index = r.take("<I")
    if index >= len(names):
        raise MalformedMessageError(f"op index {index} is not in the name table")
    return names[index]


def _values(r: _Reader) -> tuple[Any, ...]:
    """A count (u16), then that many values: an op's or a graph call's arguments or
    outputs."""
    return tuple(_value(r) for _ in range(r.take("<H")))


def _op(r: _Reader, names: Sequence[str]) -> Op:
    op = _op_name(r, names)
    args = _values(r)
    return Op(op, args, _values(r))


def _dyn(r: _Reader, names: Sequence[str]) -> Dyn:
    op = _op_name(r, names)
    args = _values(r)
    return Dyn(op, args, tuple(r.take("<Q") for _ in range(r.take("<H"))))


def _run(r: _Reader) -> Run:
    graph = r.take("<I")
    args = _values(r)
    return Run(graph, args, _values(r))


def _expect(r: _Reader, kind: type) -> Any:
    value = _value(r)
    if not isinstance(value, kind):
        raise MalformedMessageError(f"expected a {kind.__name__}, got {type(value).__name__}")
    return value


_KINDS: dict[int, Callable[[_Reader, Sequence[str]], Record]] = {
    1: _op,
    2: lambda r, _: Alloc(r.take("<Q"), r.take("<Q")),
    3: lambda r, _: Upload(_expect(r, TensorRef), _expect(r, HostTensor)),
    4: lambda r, _: Readback(_expect(r, TensorRef)),
    5: lambda r, _: Free(r.take("<Q")),
    6: lambda r, _: Resize(r.take("<Q"), r.take("<Q")),
    7: lambda r, names: _dyn(r, names),
    8: lambda r, _: Seed(r.take("<Q")),
    9: lambda r, _: RngGet(),
    10: lambda r, _: RngSet(r.raw(r.take("<I"))),
    11: lambda r, _: Graph(r.take("<I"), r.raw(r.take("<I"))),
    12: lambda r, _: _run(r),
}


def decode(batch: bytes, names: Sequence[str]) -> list[Record]:
    """The records of a batch, in order.

    Args:
        batch: bytes from ``take_batch()``.
        names: the op name table (``op_names()``), taken after the batch.

    Raises:
        MalformedMessageError: a truncated record, an unknown kind, tag, dtype or op
            index, or a record whose body is longer than its fields.
    """
    outer = _Reader(batch)
    records: list[Record] = []
    while outer.at < len(outer.data):
        kind, length = outer.take("<B"), outer.take("<I")
        if kind not in _KINDS:
            raise MalformedMessageError(f"unknown record kind {kind}")
        body = _Reader(outer.raw(length))
        records.append(_KINDS[kind](body, names))
        if body.at != length:
            raise MalformedMessageError(f"{length - body.at} stray bytes after a record")
    return records


def spans(batch: bytes | memoryview) -> Iterator[tuple[int, int, int]]:
    """``(kind, start, end)`` of each record's body in ``batch``, in order, without
    decoding the bodies (a record's header is its kind and its body's length).

    Raises:
        MalformedMessageError: a record runs past the batch's end.
    """
    view, at = memoryview(batch), 0
    while at < len(view):
        if at + _HEAD.size > len(view):
            raise MalformedMessageError(f"record truncated at byte {at}")
        kind, length = _HEAD.unpack_from(view, at)
        start = at + _HEAD.size
        if start + length > len(view):
            raise MalformedMessageError(f"record truncated at byte {at}")
        yield kind, start, start + length
        at = start + length


def upload_data(body: memoryview) -> tuple[int, int]:
    """Where an UPLOAD record's host bytes lie in its ``body``: ``(start, end)``; what
    comes before them is its destination and the host tensor's dtype and shape.

    Raises:
        MalformedMessageError: the body is not an UPLOAD's.
    """
    r = _Reader(body)
    _expect(r, TensorRef)
    if r.take("<B") != 2:  # a host tensor's tag (not a number's)
        raise MalformedMessageError("an upload's source is not a host tensor")
    r.dtype()
    r.ints(r.take("<B"))
    nbytes = r.take("<Q")
    if r.at + nbytes != len(body):
        raise MalformedMessageError("an upload's bytes do not fill its record")
    return r.at, r.at + nbytes


def head(kind: int, length: int) -> bytes:
    """A record's header: its kind and its body's length."""
    return _HEAD.pack(kind, length)


# ---- encoding (checkpoints; tests: batches the device would not write) -----------------


def _put_value(out: bytearray, value: Any) -> None:
    if value is None:
        out += b"\x00"
    elif isinstance(value, TensorRef):
        out += struct.pack("<BB", 12, value.bits) if value.bits else b"\x01"
        dtype = DTYPES.index(value.dtype)
        out += struct.pack("<QqBB", value.handle, value.offset, dtype, len(value.sizes))
        out += struct.pack(f"<{len(value.sizes)}q", *value.sizes)
        out += struct.pack(f"<{len(value.strides)}q", *value.strides)
    elif isinstance(value, HostTensor):
        tag = 13 if value.number else 2
        out += struct.pack("<BBB", tag, DTYPES.index(value.dtype), len(value.sizes))
        out += struct.pack(f"<{len(value.sizes)}qQ", *value.sizes, len(value.data))
        out += value.data
    elif isinstance(value, bool):
        out += struct.pack("<BB", 5, value)
    elif isinstance(value, int):
        out += struct.pack("<Bq", 3, value)
    elif isinstance(value, float):
        out += struct.pack("<Bd", 4, value)
    elif isinstance(value, complex):
        out += struct.pack("<Bdd", 6, value.real, value.imag)
    elif isinstance(value, str):
        data = value.encode()
        out += struct.pack("<BI", 7, len(data)) + data
    elif isinstance(value, (tuple, list)):
        if all(type(v) is int for v in value):  # int lists travel as INTS, as the device writes
            out += struct.pack(f"<BI{len(value)}q", 9, len(value), *value)
        else:
            out += struct.pack("<BI", 8, len(value))
            for item in value:
                _put_value(out, item)
    elif isinstance(value, Device):
        out += struct.pack("<Bbb", 10, value.type, value.index)
    elif isinstance(value, Generator):
        out += b"\x0b"
    else:
        raise TypeError(f"cannot encode a {type(value).__name__}")


def _put_values(out: bytearray, values: tuple) -> None:
    """A count (u16), then that many values: what ``_values`` reads."""
    out += struct.pack("<H", len(values))
    for value in values:
        _put_value(out, value)


def _op_head(out: bytearray, name: str, args: tuple, names: list[str]) -> None:
    if name not in names:
        names.append(name)
    out += struct.pack("<I", names.index(name))
    _put_values(out, args)


def _body(record: Record, names: list[str]) -> tuple[int, bytes]:
    out = bytearray()
    if isinstance(record, Op):
        _op_head(out, record.op, record.args, names)
        _put_values(out, record.outs)
        return 1, bytes(out)
    if isinstance(record, Dyn):
        _op_head(out, record.name, record.args, names)
        out += struct.pack(f"<H{len(record.handles)}Q", len(record.handles), *record.handles)
        return 7, bytes(out)
    if isinstance(record, Alloc):
        return 2, struct.pack("<QQ", record.handle, record.nbytes)
    if isinstance(record, Upload):
        _put_value(out, record.dst)
        _put_value(out, record.src)
        return 3, bytes(out)
    if isinstance(record, Readback):
        _put_value(out, record.src)
        return 4, bytes(out)
    if isinstance(record, Free):
        return 5, struct.pack("<Q", record.handle)
    if isinstance(record, Resize):
        return 6, struct.pack("<QQ", record.handle, record.nbytes)
    if isinstance(record, Seed):
        return 8, struct.pack("<Q", record.seed)
    if isinstance(record, RngGet):
        return 9, b""
    if isinstance(record, RngSet):
        return 10, struct.pack("<I", len(record.state)) + record.state
    if isinstance(record, Graph):
        return 11, struct.pack("<II", record.graph, len(record.definition)) + record.definition
    if isinstance(record, Run):
        out += struct.pack("<I", record.graph)
        _put_values(out, record.args)
        _put_values(out, record.outs)
        return 12, bytes(out)
    raise TypeError(f"not a record: {record!r}")


def encode(records: Sequence[Record], names: list[str]) -> bytes:
    """The batch the device would write for ``records``; op names are interned into
    ``names`` (appended when new), whose indexes the records then carry."""
    out = bytearray()
    for record in records:
        kind, body = _body(record, names)
        out += struct.pack("<BI", kind, len(body)) + body
    return bytes(out)
