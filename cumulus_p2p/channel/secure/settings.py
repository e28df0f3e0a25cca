"""The provider's tuning of the secure channel, defined once and passed down.

``serve_secure``, ``serve_secure_libp2p``, ``open_secure_server`` and ``SecureServer`` take
one ``SessionSettings``; every session the server runs reads it from there, and a session
handed to another process carries it along (``as_state``/``from_state``), so the process
that continues it keeps the same limits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..transport import DEFAULT_MAX_FRAME
from .record import DEFAULT_MAX_RECORD, DEFAULT_REKEY_BYTES, RECORD_LIMIT
from .resume import DEFAULT_MAX_UNACKED


@dataclass(frozen=True, slots=True)
class SessionSettings:
    """How a provider runs its secure sessions; the defaults suit a provider on the internet.

    Raises:
        ValueError: a field is out of range (checked on construction, so a server never
            starts with settings its first session would reject).
    """

    #: Largest frame accepted from a consumer, in bytes. A frame's length comes in its
    #: first record and its buffer is allocated whole, so this bounds what one announced
    #: frame can make the provider allocate. Large uploads are split by the client.
    max_frame: int = DEFAULT_MAX_FRAME
    #: Largest plaintext the provider puts in one record, in bytes: big frames are cut into
    #: records of this size, so each piece is authenticated, and held for retransmission,
    #: in bounded size. Each side picks its own, up to ``RECORD_LIMIT``, which every
    #: receiver accepts, so it need not match the consumer's.
    max_record: int = DEFAULT_MAX_RECORD
    #: Ciphertext sent under one key before both sides derive the next one, in bytes. It
    #: limits how much one leaked key exposes. The receiver rekeys at the same point
    #: without a message, so it must match the consumer's.
    rekey_bytes: int = DEFAULT_REKEY_BYTES
    #: Most bytes of sealed records a session keeps until the consumer acknowledges them
    #: (the retransmit buffer, what a resume resends). A handler that sends more waits for
    #: acknowledgements, so a consumer that stops reading holds at most this much memory.
    max_unacked: int = DEFAULT_MAX_UNACKED
    #: Seconds a session without a connection waits for its consumer to resume before it
    #: ends and the handler sees ``SessionClosedError``. Long enough to ride out a Wi-Fi
    #: handover or a NAT rebinding; the consumer's ``resume_timeout`` should not exceed it.
    grace_period: float = 30.0
    #: Seconds a new connection may take to finish its handshake (a new session's or a
    #: resume's). A peer that connects and stalls holds a connection no longer than this.
    handshake_timeout: float = 10.0

    def __post_init__(self) -> None:
        if not 0 < self.max_record <= RECORD_LIMIT:
            raise ValueError(f"max_record must be in (0, {RECORD_LIMIT}], not {self.max_record}")
        for name in ("max_frame", "rekey_bytes", "max_unacked", "handshake_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, not {getattr(self, name)}")
        if not self.grace_period >= 0:
            raise ValueError(f"grace_period must not be negative, not {self.grace_period}")

    @property
    def core_limits(self) -> dict[str, int]:
        """The keyword arguments a ``SessionCore`` takes from these settings."""
        return {
            "max_frame": self.max_frame,
            "max_record": self.max_record,
            "rekey_bytes": self.rekey_bytes,
            "max_unacked": self.max_unacked,
        }

    def as_state(self) -> dict[str, Any]:
        """These settings as plain data, for a handed-over session's state."""
        return dataclasses.asdict(self)

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> SessionSettings:
        """The settings ``as_state`` described.

        Raises:
            ValueError: ``state`` is not what ``as_state`` returns.
        """
        try:
            return cls(**state)
        except TypeError as exc:
            raise ValueError(f"not session settings: {exc}") from exc


#: ``SessionSettings()``, the default of every function that takes settings.
DEFAULT_SETTINGS = SessionSettings()
