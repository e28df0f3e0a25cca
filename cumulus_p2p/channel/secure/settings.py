"""The tuning of the secure channel, on each side defined once and passed down.

``serve_secure``, ``serve_secure_libp2p``, ``open_secure_server`` and ``SecureServer`` take
one ``SessionSettings``; every session the server runs reads it from there, and a session
handed to another process carries it along (``as_state``/``from_state``), so the process
that continues it keeps the same limits. ``connect_secure`` and ``connect_secure_libp2p``
take one ``ClientSettings``, which the consumer's channel keeps for its session.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..transport import DEFAULT_MAX_FRAME
from .record import DEFAULT_MAX_RECORD, DEFAULT_REKEY_BYTES, RECORD_LIMIT
from .resume import DEFAULT_MAX_UNACKED


@dataclass(frozen=True, slots=True)
class CoreLimits:
    """The limits one side's ``SessionCore`` runs under, common to both sides' settings."""

    #: Largest frame accepted from the peer, in bytes. A frame's length comes in its first
    #: record and its buffer is allocated whole, so this bounds what one announced frame
    #: can make this side allocate. Large uploads are split by the client.
    max_frame: int = DEFAULT_MAX_FRAME
    #: Largest plaintext this side puts in one record, in bytes: big frames are cut into
    #: records of this size, so each piece is authenticated, and held for retransmission,
    #: in bounded size. Each side picks its own, up to ``RECORD_LIMIT``, which every
    #: receiver accepts, so it need not match the peer's.
    max_record: int = DEFAULT_MAX_RECORD
    #: Ciphertext sent under one key before both sides derive the next one, in bytes. It
    #: limits how much one leaked key exposes. The receiver rekeys at the same point
    #: without a message, so it must match the peer's.
    rekey_bytes: int = DEFAULT_REKEY_BYTES
    #: Most bytes of sealed records a session keeps until the peer acknowledges them (the
    #: retransmit buffer, what a resume resends). A sender that sends more waits for
    #: acknowledgements, so a peer that stops reading holds at most this much memory.
    max_unacked: int = DEFAULT_MAX_UNACKED

    @property
    def core_limits(self) -> dict[str, int]:
        """The keyword arguments a ``SessionCore`` takes from these settings."""
        return {
            "max_frame": self.max_frame,
            "max_record": self.max_record,
            "rekey_bytes": self.rekey_bytes,
            "max_unacked": self.max_unacked,
        }


@dataclass(frozen=True, slots=True)
class SessionSettings(CoreLimits):
    """How a provider runs its secure sessions; the defaults suit a provider on the internet.

    Raises:
        ValueError: a field is out of range (checked on construction, so a server never
            starts with settings its first session would reject).
    """

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


@dataclass(frozen=True, slots=True)
class ClientSettings(CoreLimits):
    """How a consumer runs its secure session; ``rekey_bytes`` must match the provider's."""

    #: Seconds for reaching the provider and for each handshake (a new session's or a
    #: resume's).
    timeout: float = 10.0
    #: Seconds a session whose connection broke is retried before it is declared lost.
    #: Keep it at or below the provider's ``grace_period``: past that, the provider has
    #: ended the session and a resume is refused anyway.
    resume_timeout: float = 30.0
    #: Seconds a wait for a frame may hear nothing, not even a keepalive, before the
    #: host is taken as hung (``HostSilentError``, no resume: the host holds the
    #: connection, it just does not work); None waits for ever.
    silence_s: float | None = None


#: ``SessionSettings()``, the default of every function that takes settings.
DEFAULT_SETTINGS = SessionSettings()
#: ``ClientSettings()``, the default of every function that opens a consumer's session.
DEFAULT_CLIENT_SETTINGS = ClientSettings()
