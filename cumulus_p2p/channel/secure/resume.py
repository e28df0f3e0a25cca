"""Sans-IO session core: frames over records, acknowledgements and retransmission.

Theory of operation
-------------------
Every record a side seals gets the next *index* (0, 1, 2, … for the whole session, across
connections). Indexes are implicit, exactly like the AEAD nonce counter: the receiver
knows which record comes next, and a record out of place fails authentication.

Each record header carries ``ack``: how many of the peer's records the sender has received.
A sealed record stays in the ``RetransmitBuffer`` until the peer acknowledges it. When a
TCP connection drops, the resumption handshake tells each side how many records the other
holds, and each side resends the rest from its buffer, unchanged (same keys and nonces:
the bytes are identical to what an eavesdropper may already have seen). The peer's opener
continues where it stopped, so every frame arrives exactly once and in order, including a
frame that was cut in half by the drop.

Acknowledgements ride on every outgoing record. A side that only receives sends an
``ACK`` record once ``ack_bytes`` of payload or ``ack_records`` records are
unacknowledged; ``ACK`` records themselves never make an ``ACK`` due, so two idle sides do
not ping-pong. A sender whose buffer holds more than ``max_unacked`` bytes must wait for
acknowledgements (the shell does the waiting), which bounds memory per session.

Frames are cut into records of at most ``max_record`` bytes: the first (``FRAME``) carries
the frame's total length in the header, so the receiver allocates once, checks the limit
before allocating, and decrypts each record straight into place.

No method performs I/O or reads the clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ..._errors import FrameTooLargeError, LocalProtocolError, RemoteProtocolError
from ..transport import nbytes
from .record import (
    ACK,
    CLOSE,
    DEFAULT_MAX_RECORD,
    DEFAULT_REKEY_BYTES,
    FRAME,
    HEADER_SIZE,
    MORE,
    RECORD_LIMIT,
    TAG_SIZE,
    RecordOpener,
    RecordSealer,
)

Buffer = bytes | bytearray | memoryview
Record = tuple[bytes, bytes]  #: (header, ciphertext)

DEFAULT_ACK_BYTES = 4 * 1024 * 1024
DEFAULT_ACK_RECORDS = 64
DEFAULT_MAX_UNACKED = 64 * 1024 * 1024
_MAX_CLOSE_REASON = 1024


class RetransmitBuffer:
    """Sealed records the peer has not acknowledged yet, oldest first."""

    __slots__ = ("_records", "base", "nbytes")

    def __init__(self) -> None:
        self._records: deque[Record] = deque()
        #: Index of the oldest record held (everything before it is acknowledged).
        self.base = 0
        self.nbytes = 0

    @property
    def end(self) -> int:
        """Index the next sealed record will get."""
        return self.base + len(self._records)

    def append(self, record: Record) -> None:
        self._records.append(record)
        self.nbytes += len(record[0]) + len(record[1])

    def acknowledge(self, count: int) -> None:
        """The peer holds records ``[0, count)``: forget them.

        Raises:
            RemoteProtocolError: ``count`` acknowledges records never sent.
        """
        if count > self.base + len(self._records):
            raise RemoteProtocolError(f"peer acknowledged {count} records; only {self.end} sent")
        while self.base < count:
            header, ct = self._records.popleft()
            self.nbytes -= len(header) + len(ct)
            self.base += 1

    def since(self, count: int) -> list[Record]:
        """The records from index ``count`` on, for retransmission after a resume.

        Raises:
            RemoteProtocolError: ``count`` is outside what the buffer can resend.
        """
        if count < self.base or count > self.end:
            raise RemoteProtocolError(
                f"peer resumes at record {count}; this side can resend [{self.base}, {self.end}]"
            )
        self.acknowledge(count)
        return list(self._records)


@dataclass(frozen=True, slots=True)
class Closed:
    """The peer ended the session in order (a ``CLOSE`` record)."""

    reason: str


class SessionCore:
    """Both directions of one session: sealing frames, opening records, acks, resends.

    Args:
        send_key: Traffic key for records this side sends.
        recv_key: Traffic key for records this side receives.
        max_frame: Largest frame accepted from the peer (and allowed to send).
        max_record: Largest plaintext per record this side sends (at most
            ``RECORD_LIMIT``, which is what every receiver accepts).
        rekey_bytes: Ciphertext under one key before the implicit rekey (must match the
            peer).
        ack_bytes: Payload received before an ``ACK`` record is due.
        ack_records: Records received before an ``ACK`` record is due.
        max_unacked: Bytes the retransmit buffer may hold before the sender must wait.
    """

    def __init__(
        self,
        send_key: bytes,
        recv_key: bytes,
        *,
        max_frame: int,
        max_record: int = DEFAULT_MAX_RECORD,
        rekey_bytes: int = DEFAULT_REKEY_BYTES,
        ack_bytes: int = DEFAULT_ACK_BYTES,
        ack_records: int = DEFAULT_ACK_RECORDS,
        max_unacked: int = DEFAULT_MAX_UNACKED,
    ) -> None:
        if not 0 < max_record <= RECORD_LIMIT:
            raise ValueError(f"max_record must be in (0, {RECORD_LIMIT}]")
        self.max_frame = max_frame
        self.max_record = max_record
        self.max_unacked = max_unacked
        self._sealer = RecordSealer(send_key, rekey_bytes)
        self._opener = RecordOpener(recv_key, rekey_bytes)
        self.buffer = RetransmitBuffer()
        #: Records received from the peer (the next expected index).
        self.received = 0
        self._ack_bytes = ack_bytes
        self._ack_records = ack_records
        self._unacked_in_bytes = 0
        self._unacked_in_records = 0
        # Frame being reassembled: buffer and how much of it is filled.
        self._frame: bytearray | None = None
        self._filled = 0
        self._pending: tuple[int, int, int, int] | None = None
        self.closed_by_peer: str | None = None

    # --- sending ----------------------------------------------------------------------

    @property
    def sent(self) -> int:
        """Records sealed so far."""
        return self.buffer.end

    @property
    def must_wait(self) -> bool:
        """True when the retransmit buffer is full: wait for acknowledgements."""
        return self.buffer.nbytes >= self.max_unacked

    @property
    def ack_due(self) -> bool:
        """True when this side owes the peer an acknowledgement."""
        return (
            self._unacked_in_bytes >= self._ack_bytes
            or self._unacked_in_records >= self._ack_records
        )

    def _seal(self, kind: int, arg: int, payload: Buffer) -> Record:
        record = self._sealer.seal(kind, self.received, arg, payload)
        self._unacked_in_bytes = 0
        self._unacked_in_records = 0
        self.buffer.append(record)
        return record

    def seal_frame(self, parts: Sequence[Buffer]) -> Iterator[Record]:
        """Cut a frame into sealed records, yielding each as it is sealed.

        Each yielded record is already in the retransmit buffer: the shell must send them
        in order and must not abandon the iterator halfway (the peer would see a torn
        frame).

        Raises:
            FrameTooLargeError: the frame is larger than ``max_frame``.
        """
        total = nbytes(parts)
        if total > self.max_frame:
            raise FrameTooLargeError(
                f"frame of {total} bytes exceeds the limit of {self.max_frame}"
            )
        kind, arg = FRAME, total
        for chunk in _chunks(parts, self.max_record, total):
            yield self._seal(kind, arg, chunk)
            kind, arg = MORE, 0

    def seal_single(self, parts: Sequence[Buffer]) -> Record | None:
        """Seal a frame that fits in one record, or return ``None`` (use ``seal_frame``).

        The small-frame fast path of the round trip: one record, sealed at once, with no
        generator and no chunking. Parts are joined (a copy, but of at most one record).

        Raises:
            FrameTooLargeError: the frame is larger than ``max_frame``.
        """
        if len(parts) == 1:
            payload = parts[0]
            if type(payload) is not bytes and type(payload) is not bytearray:
                payload = memoryview(payload).cast("B")  # len() must count bytes
            total = len(payload)
        else:
            total = nbytes(parts)
            payload = None
        if total > self.max_frame:
            raise FrameTooLargeError(
                f"frame of {total} bytes exceeds the limit of {self.max_frame}"
            )
        if total > self.max_record:
            return None
        if payload is None:
            payload = b"".join(parts)
        return self._seal(FRAME, total, payload)

    def seal_ack(self) -> Record:
        """An ``ACK`` record carrying the current receive count."""
        return self._seal(ACK, 0, b"")

    def seal_close(self, reason: str) -> Record:
        """A ``CLOSE`` record ending the session in order."""
        return self._seal(CLOSE, 0, reason.encode("utf-8", "replace")[:_MAX_CLOSE_REASON])

    def resend_from(self, peer_received: int) -> list[Record]:
        """Records to resend on a new connection, given how many the peer holds."""
        return self.buffer.since(peer_received)

    def resumed(self) -> None:
        """The resume handshake told the peer our receive count: that is an ack."""
        self._unacked_in_bytes = 0
        self._unacked_in_records = 0

    # --- handing over -----------------------------------------------------------------

    def export(self) -> list:
        """The session between frames as plain values, for another process to continue
        it (``SessionCore.continued``): both directions' keys and counters, the counts,
        the records the peer has not acknowledged.

        Raises:
            LocalProtocolError: a frame is half received.
        """
        if self._frame is not None or self._pending is not None:
            raise LocalProtocolError("a session can be handed over only between frames")
        records = [list(record) for record in self.buffer.since(self.buffer.base)]
        return [
            self._sealer.export(),
            self._opener.export(),
            self.received,
            self._unacked_in_bytes,
            self._unacked_in_records,
            self.buffer.base,
            records,
        ]

    @classmethod
    def continued(cls, state: list, **limits) -> SessionCore:
        """The core ``export`` described, continuing where it stood; ``limits`` are the
        constructor's keyword arguments (they must be the exporting core's).

        Raises:
            ValueError: ``state`` is not what ``export`` returns.
        """
        try:
            sealer, opener, received, in_bytes, in_records, base, records = state
            core = cls(sealer[0], opener[0], **limits)
            core._sealer.resume(sealer)
            core._opener.resume(opener)
            counts = (received, in_bytes, in_records, base)
            if not all(type(v) is int and v >= 0 for v in counts):
                raise ValueError("counts are non-negative integers")
            core.received, core._unacked_in_bytes, core._unacked_in_records = counts[:3]
            core.buffer.base = base
            for header, ciphertext in records:
                core.buffer.append((bytes(header), bytes(ciphertext)))
        except (TypeError, IndexError) as exc:
            raise ValueError(f"not an exported session core: {exc}") from exc
        return core

    # --- receiving --------------------------------------------------------------------

    def receive_header(self, header: Buffer) -> int:
        """Decode the next record's header; returns how many ciphertext bytes follow.

        Raises:
            RemoteProtocolError: the header is invalid (unknown kind, bad size, a frame
                boundary in the wrong place, an impossible acknowledgement).
            FrameTooLargeError: the record opens a frame above ``max_frame``.
        """
        if self._pending is not None:
            raise LocalProtocolError("receive_header() twice without receive_body()")
        ct_len, kind, ack, arg = self._opener.parse_header(header)
        if kind == FRAME:
            if self._frame is not None:
                raise RemoteProtocolError("new frame started before the previous one ended")
            if arg > self.max_frame:
                raise FrameTooLargeError(
                    f"peer announced a {arg}-byte frame; limit is {self.max_frame}"
                )
            if ct_len - TAG_SIZE > arg:
                raise RemoteProtocolError("record is longer than its frame")
        elif kind == MORE:
            if self._frame is None:
                raise RemoteProtocolError("frame continuation without a frame")
            if ct_len - TAG_SIZE > len(self._frame) - self._filled:
                raise RemoteProtocolError("record overruns its frame")
        elif kind == ACK:
            # An ACK may sit between a frame's records: a sender waiting for
            # acknowledgements mid-frame still owes its own.
            if ct_len != TAG_SIZE:
                raise RemoteProtocolError("ACK record with a payload")
        elif self._frame is not None:
            raise RemoteProtocolError("CLOSE record inside a frame")
        # The ack is checked only after the record authenticates (see receive_body).
        self._pending = (ct_len, kind, ack, arg)
        return ct_len

    def receive_body(self, header: Buffer, ciphertext: Buffer) -> bytearray | Closed | None:
        """Authenticate and absorb the record whose header was just given.

        Returns:
            A complete frame, a ``Closed`` event, or ``None`` (more records needed).

        Raises:
            RecordAuthenticationError: tampered, replayed, reordered or forged record.
            RemoteProtocolError: the record acknowledges records never sent.
        """
        if self._pending is None:
            raise LocalProtocolError("receive_body() without receive_header()")
        ct_len, kind, ack, arg = self._pending
        n = ct_len - TAG_SIZE
        if kind == FRAME:
            frame = bytearray(arg)
            # A frame in one record (the common small case) needs no view to fill.
            self._opener.open_into(header, ciphertext, frame if n == arg else memoryview(frame)[:n])
            self._frame, self._filled = frame, 0
        elif kind == MORE:
            assert self._frame is not None  # checked in receive_header (our own state)
            frame = self._frame
            self._opener.open_into(
                header, ciphertext, memoryview(frame)[self._filled : self._filled + n]
            )
        else:
            plain = self._opener.open(header, ciphertext)
        self._pending = None
        self.received += 1
        # Retransmitted records carry old, smaller acks; only forward progress matters.
        if ack > self.buffer.base:
            self.buffer.acknowledge(ack)
        if kind == ACK:
            return None
        self._unacked_in_records += 1
        self._unacked_in_bytes += n
        if kind == CLOSE:
            self.closed_by_peer = plain.decode("utf-8", "replace")
            return Closed(self.closed_by_peer)
        self._filled += n
        if self._filled == len(frame):
            self._frame = None
            return frame
        return None

    def abort_partial_read(self) -> None:
        """Forget a header whose body never arrived (the connection dropped)."""
        self._pending = None


def _chunks(parts: Sequence[Buffer], max_record: int, total: int) -> Iterator[Buffer]:
    """Split ``parts`` into contiguous pieces of ``max_record`` bytes (the last shorter).

    Pieces inside one part are zero-copy slices; only pieces spanning parts are joined.
    """
    if total == 0:
        yield b""
        return
    pending: list[memoryview] = []
    pending_len = 0
    for part in parts:
        view = memoryview(part).cast("B")
        while view.nbytes:
            if not pending and view.nbytes >= max_record:
                yield view[:max_record]
                view = view[max_record:]
                continue
            take = view[: max_record - pending_len]
            pending.append(take)
            pending_len += take.nbytes
            view = view[take.nbytes :]
            if pending_len == max_record:
                yield pending[0] if len(pending) == 1 else b"".join(pending)
                pending, pending_len = [], 0
    if pending:
        yield pending[0] if len(pending) == 1 else b"".join(pending)


__all__ = [
    "HEADER_SIZE",
    "Closed",
    "Record",
    "RetransmitBuffer",
    "SessionCore",
]
