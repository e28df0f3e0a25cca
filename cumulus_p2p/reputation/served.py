"""``BlobServed``: a host's signed word on the bytes it served another host. Sans-IO.

Theory of operation
-------------------
Hosts fetch public blobs from hosts (``node/blobshare.py``), and a blob is named by the
digest of its bytes, so the fetcher knows at once when a peer sent other bytes. Knowing is
not proving: a report that a peer "sent garbage" is the reporter's word against the peer's.
So every answer carries a statement the serving host signs, naming the piece asked for,
the digest of the bytes it sends, and the peer it sends them to.

- An honest host reads a piece back through its store, which checks the digest, so it
  only ever signs ``sent == name``.
- A host that signs ``sent != name`` has signed that it served other bytes: anyone can
  check that from the statement alone, without the 16 MiB piece. The fetcher gossips it
  as ``BadBlob`` evidence (``evidence.py``).
- A host that signs ``sent == name`` and sends other bytes anyway has lied in its
  signature; the fetcher sees that (the bytes do not hash to ``sent``) but cannot prove it
  to anyone. It drops that peer and never asks it again; nothing is gossiped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import msgpack

from .._errors import InvalidMessageError, MalformedMessageError
from ..envelope import Envelope, seal
from ..identity import NodeIdentity

__all__ = ["BLOB_SERVED_KIND", "DIGEST_BYTES", "BlobServed", "open_served", "seal_served"]

BLOB_SERVED_KIND = "blob/served"
#: A blob's name is the 32-byte digest of its bytes (hex on disk, raw here).
DIGEST_BYTES = 32
#: Seconds a statement stays valid as evidence material.
SERVED_TTL_S = 86_400.0
_MAX_PEER_ID = 128


@dataclass(frozen=True, slots=True)
class BlobServed:
    """What a host says it served.

    Attributes:
        name: The digest of the piece asked for.
        sent: The digest of the bytes the host sent.
        requester: The peer ID of the host that asked.
        served_at: When (Unix seconds).
    """

    name: bytes
    sent: bytes
    requester: str
    served_at: float

    def __post_init__(self) -> None:
        for field_name in ("name", "sent"):
            value = getattr(self, field_name)
            if type(value) is not bytes or len(value) != DIGEST_BYTES:
                raise InvalidMessageError(f"BlobServed.{field_name} must be a digest")
        if type(self.requester) is not str or not 0 < len(self.requester) <= _MAX_PEER_ID:
            raise InvalidMessageError("BlobServed.requester must be a peer ID")
        at = self.served_at
        if type(at) is not float or not math.isfinite(at) or at < 0:
            raise InvalidMessageError("BlobServed.served_at must be a non-negative float")

    def to_body(self) -> bytes:
        """The canonical msgpack body."""
        return msgpack.packb(
            [self.name, self.sent, self.requester, self.served_at],
            use_bin_type=True,
            strict_types=True,
        )


def seal_served(identity: NodeIdentity, served: BlobServed, *, nonce: int) -> Envelope:
    """Sign ``served`` as the serving host."""
    return seal(
        identity,
        BLOB_SERVED_KIND,
        served.to_body(),
        now=served.served_at,
        ttl=SERVED_TTL_S,
        nonce=nonce,
    )


def open_served(statement: Envelope) -> BlobServed:
    """Check a statement's kind and signature and decode it.

    Raises:
        MalformedMessageError: Not a ``BlobServed`` statement, not signed by its author,
            or a body of the wrong shape.
    """
    if statement.kind != BLOB_SERVED_KIND:
        raise MalformedMessageError(f"not a served-blob statement: {statement.kind!r}")
    if not statement.has_valid_signature():
        raise MalformedMessageError("the statement's signature does not check")
    try:
        values = msgpack.unpackb(statement.body, raw=False, use_list=True)
    except (ValueError, msgpack.UnpackException) as exc:
        raise MalformedMessageError(f"statement body is not msgpack: {exc}") from exc
    if type(values) is not list or len(values) != 4:
        raise MalformedMessageError("a statement is an array of 4 fields")
    try:
        served = BlobServed(*values)
    except InvalidMessageError as exc:
        raise MalformedMessageError(str(exc)) from exc
    if served.to_body() != statement.body:
        raise MalformedMessageError("statement body is not the canonical encoding")
    return served
