"""Sans-IO AEAD record layer: one direction of encrypted, numbered records.

Theory of operation
-------------------
A record on the wire is a 21-byte header followed by ciphertext::

    u32 ciphertext_length | u8 kind | u64 ack | u64 arg | AES-256-GCM(payload) + 16-byte tag

The header stays readable (the shell needs the length before reading the body, and kind,
ack and frame length reveal nothing that packet sizes do not) but it is the AEAD's
associated data, so changing any header byte fails authentication.

The nonce is never sent: it is ``4 zero bytes | u64 counter``, the number of records
sealed under the current key. A replayed, dropped, duplicated or reordered record is
therefore opened with the wrong nonce and fails authentication like a tampered one;
nothing is accepted twice or out of order.

Rekeying is implicit and deterministic: after ``rekey_bytes`` of ciphertext (or 2**32
records) under one key, both directions' sealer and opener replace the key with
``HKDF(key, info="rekey")`` and restart the counter. Both ends cross the threshold at the
same record, so no message is needed, and old keys are forgotten (forward secrecy within
the session).

No method performs I/O or reads the clock.
"""

from __future__ import annotations

import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from ..._errors import RecordAuthenticationError, RemoteProtocolError

HEADER = struct.Struct(">IBQQ")
HEADER_SIZE = HEADER.size
TAG_SIZE = 16
_NONCE = struct.Struct(">4xQ")

#: Largest plaintext in one record. Big frames are cut into records of this size, so the
#: receiver authenticates (and the retransmit buffer holds) bounded pieces.
DEFAULT_MAX_RECORD = 512 * 1024
#: Largest record plaintext any receiver accepts; each sender picks its own size up to it.
RECORD_LIMIT = 1024 * 1024
#: Ciphertext under one key before rekeying. AES-GCM is safe far beyond this; the bound
#: limits how much one leaked key exposes.
DEFAULT_REKEY_BYTES = 1 << 30
_REKEY_RECORDS = 1 << 32
_REKEY_INFO = b"cumulus-secure/1 rekey"

# Record kinds.
FRAME = 1  #: first record of a frame; ``arg`` is the frame's total length
MORE = 2  #: a continuation of the current frame
ACK = 3  #: acknowledgement only, empty payload
CLOSE = 4  #: orderly end of the session; payload is a UTF-8 reason
KINDS = frozenset({FRAME, MORE, ACK, CLOSE})


def _next_key(key: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_REKEY_INFO).derive(key)


class _Direction:
    __slots__ = ("_key", "_aead", "_counter", "_bytes", "_rekey_bytes", "rekeys")

    def __init__(self, key: bytes, rekey_bytes: int) -> None:
        if len(key) != 32:
            raise ValueError("record keys are 32 bytes")
        self._key = key
        self._aead = AESGCM(key)
        self._counter = 0
        self._bytes = 0
        self._rekey_bytes = rekey_bytes
        self.rekeys = 0

    def _advance(self, ct_len: int) -> None:
        self._counter += 1
        self._bytes += ct_len
        if self._bytes >= self._rekey_bytes or self._counter >= _REKEY_RECORDS:
            self._rekey()

    def _rekey(self) -> None:
        self._key = _next_key(self._key)
        self._aead = AESGCM(self._key)
        self._counter = 0
        self._bytes = 0
        self.rekeys += 1

    def export(self) -> list:
        """Where this direction stands (its current key, counters), to continue it in
        another process; ``resume`` takes it."""
        return [self._key, self._counter, self._bytes, self.rekeys]

    def resume(self, state: list) -> None:
        """Continue from ``export``'s values (those of a fresh direction are replaced).

        Raises:
            ValueError: ``state`` is not what ``export`` returns.
        """
        key, counter, nbytes, rekeys = state
        if not (isinstance(key, bytes) and len(key) == 32):
            raise ValueError("record keys are 32 bytes")
        if not all(type(v) is int and v >= 0 for v in (counter, nbytes, rekeys)):
            raise ValueError("record counters are non-negative integers")
        self._key, self._aead = key, AESGCM(key)
        self._counter, self._bytes, self.rekeys = counter, nbytes, rekeys


class RecordSealer(_Direction):
    """Seals outgoing records for one direction.

    Args:
        key: The 32-byte traffic key for this direction.
        rekey_bytes: Ciphertext bytes under one key before the implicit rekey.
    """

    def seal(
        self, kind: int, ack: int, arg: int, payload: bytes | bytearray | memoryview
    ) -> tuple[bytes, bytes]:
        """Encrypt one record. Returns ``(header, ciphertext)``, to be sent in that order."""
        header = HEADER.pack(len(payload) + TAG_SIZE, kind, ack, arg)
        ct = self._aead.encrypt(_NONCE.pack(self._counter), payload, header)
        # _advance, inlined: this runs for every record on the round-trip path.
        self._counter += 1
        self._bytes += len(ct)
        if self._bytes >= self._rekey_bytes or self._counter >= _REKEY_RECORDS:
            self._rekey()
        return header, ct


class RecordOpener(_Direction):
    """Opens incoming records for one direction, in order.

    Args:
        key: The 32-byte traffic key for this direction.
        rekey_bytes: Must equal the peer sealer's setting.
        max_record: Largest plaintext accepted in one record.
    """

    __slots__ = ("max_record",)

    def __init__(self, key: bytes, rekey_bytes: int, max_record: int = RECORD_LIMIT) -> None:
        super().__init__(key, rekey_bytes)
        self.max_record = max_record

    def parse_header(self, header: bytes | bytearray | memoryview) -> tuple[int, int, int, int]:
        """Decode a header: ``(ciphertext_length, kind, ack, arg)``.

        Raises:
            RemoteProtocolError: unknown kind, or a length outside the limits (checked
                before the body is read or allocated).
        """
        ct_len, kind, ack, arg = HEADER.unpack(header)
        if kind not in KINDS:
            raise RemoteProtocolError(f"unknown record kind {kind}")
        if ct_len < TAG_SIZE or ct_len > self.max_record + TAG_SIZE:
            raise RemoteProtocolError(
                f"record of {ct_len} bytes; limit is {self.max_record + TAG_SIZE}"
            )
        return ct_len, kind, ack, arg

    def open(
        self, header: bytes | bytearray | memoryview, ciphertext: bytes | bytearray | memoryview
    ) -> bytes:
        """Authenticate and decrypt the next record.

        Raises:
            RecordAuthenticationError: tampered, replayed, reordered or forged record.
        """
        try:
            plain = self._aead.decrypt(_NONCE.pack(self._counter), ciphertext, header)
        except InvalidTag as exc:
            raise RecordAuthenticationError(self._why()) from exc
        self._advance(len(ciphertext))
        return plain

    def open_into(
        self,
        header: bytes | bytearray | memoryview,
        ciphertext: bytes | bytearray | memoryview,
        out: bytearray | memoryview,
    ) -> None:
        """Like ``open`` but decrypts straight into ``out`` (exactly the plaintext size)."""
        try:
            self._aead.decrypt_into(_NONCE.pack(self._counter), ciphertext, header, out)
        except InvalidTag as exc:
            raise RecordAuthenticationError(self._why()) from exc
        # _advance, inlined: this runs for every record on the round-trip path.
        self._counter += 1
        self._bytes += len(ciphertext)
        if self._bytes >= self._rekey_bytes or self._counter >= _REKEY_RECORDS:
            self._rekey()

    def _why(self) -> str:
        return (
            f"record {self._counter} after rekey {self.rekeys} failed authentication "
            "(tampered, replayed, reordered or forged)"
        )
