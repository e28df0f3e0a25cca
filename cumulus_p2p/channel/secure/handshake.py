"""Sans-IO handshake for the secure session channel: new sessions and resumption.

Theory of operation
-------------------
Handshake messages travel as ``u16 length | body`` (``MAX_HANDSHAKE_MESSAGE`` at most);
``body[0]`` is the message type. A *new* session is a SIGMA-style exchange built only
from library primitives (X25519, ed25519 via ``cumulus_p2p.identity``, HKDF-SHA256,
AES-256-GCM)::

    C -> S  NEW_HELLO     magic | c_eph | c_static
    S -> C  SERVER_AUTH   s_eph | s_static | sign_s("server" | th2)
    C -> S  CLIENT_AUTH   AEAD_hs( sign_c("client" | th3) | lease_token )
    S -> C  RESULT        AEAD_hs( accept | session_id  or  refuse | reason )

``th2 = H(protocol | NEW_HELLO | s_eph | s_static)`` covers both ephemeral keys and both
static identities, so each signature binds the whole exchange to both identities: a man in
the middle can neither splice its own ephemeral key in nor replay a signature into another
session. The consumer names the provider it expects; a different ``s_static`` or a bad
signature is an impostor. Traffic keys, one per direction, and the session's resume secret
come from HKDF over the ephemeral DH with the full transcript as salt.

The consumer's static key travels in the clear in the first message (the provider needs it
to sign a transcript that names both parties). The lease token and the consumer's
signature are encrypted.

*Resumption* proves knowledge of the resume secret with fresh nonces from both sides
(HMAC-SHA256), so a recorded handshake cannot be replayed::

    C -> S  RESUME_HELLO  magic | c_nonce | session_id | c_received
    S -> C  RESUME_CHALLENGE  s_nonce | mac_s("server" | thr)
    C -> S  RESUME_PROOF  mac_c("client" | thr)
    S -> C  RESUMED       s_received | mac_s("resumed" | thr | s_received)

A resumed connection continues the same record stream (same keys, same counters): each
side retransmits, from its retransmit buffer, the records the other did not receive.
``c_received``/``s_received`` say how many records each side holds. The server reports
its count only after the proof, so an unauthenticated resume attempt cannot disturb a
live connection.

A server that rejects input sends ``ERROR | reason`` (unauthenticated plain text) so the
peer gets a clear message, then closes. No method here performs I/O or reads a clock.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from ..._errors import (
    HandshakeError,
    PeerAuthenticationError,
    SessionRefusedError,
)
from ...identity import verify

PROTOCOL = b"cumulus-secure/1 X25519 Ed25519 AES256-GCM HKDF-SHA256"
MAGIC = b"CUMSEC\x00\x01"
MAX_HANDSHAKE_MESSAGE = 8192
#: Bound on the lease token the consumer may present (a signed lease is far smaller).
MAX_LEASE_TOKEN = 4096
MAX_REASON = 1024
LENGTH = struct.Struct(">H")
_U64 = struct.Struct(">Q")

NEW_HELLO = 0x01
RESUME_HELLO = 0x02
SERVER_AUTH = 0x11
RESUME_CHALLENGE = 0x12
CLIENT_AUTH = 0x21
RESUME_PROOF = 0x22
RESULT = 0x31
RESUMED = 0x32
ERROR = 0x7F

_ACCEPT = 0x00
_REFUSE = 0x01
_KEY = 32
_SIG = 64
_MAC = 32
SESSION_ID_SIZE = 16
_NONCE0 = bytes(12)
_NONCE1 = bytes(11) + b"\x01"


@dataclass(frozen=True, slots=True)
class SessionKeys:
    """What a finished handshake yields: traffic keys and the resume secret."""

    send_key: bytes
    recv_key: bytes
    resume_secret: bytes
    session_id: bytes
    peer_public_key: bytes


def encode_message(body: bytes) -> bytes:
    """Prefix a handshake body with its length."""
    if len(body) > MAX_HANDSHAKE_MESSAGE:
        raise ValueError("handshake message too large")
    return LENGTH.pack(len(body)) + body


def parse_length(prefix: bytes) -> int:
    """Decode a handshake length prefix, refusing oversized messages before reading them.

    Raises:
        HandshakeError: the announced length is zero or above ``MAX_HANDSHAKE_MESSAGE``.
    """
    (n,) = LENGTH.unpack(prefix)
    if n == 0 or n > MAX_HANDSHAKE_MESSAGE:
        raise HandshakeError(
            f"handshake message of {n} bytes announced; limit is {MAX_HANDSHAKE_MESSAGE}"
        )
    return n


def error_message(reason: str) -> bytes:
    """An ``ERROR`` message (length-prefixed) carrying ``reason`` for the peer."""
    return encode_message(bytes([ERROR]) + reason.encode("utf-8", "replace")[:MAX_REASON])


def _peer_error(body: bytes) -> str:
    return body[1 : 1 + MAX_REASON].decode("utf-8", "replace")


def _hash(*parts: bytes) -> bytes:
    h = hashlib.sha256()
    for p in parts:
        h.update(p)
    return h.digest()


def _hkdf(secret: bytes, *, salt: bytes, info: bytes, length: int) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=salt, info=info).derive(secret)


def _dh(private: X25519PrivateKey, peer_public: bytes) -> bytes:
    try:
        shared = private.exchange(X25519PublicKey.from_public_bytes(peer_public))
    except ValueError as exc:
        # cryptography refuses low-order points (an all-zero shared secret).
        raise HandshakeError(f"invalid ephemeral key from peer: {exc}") from exc
    return shared


def _handshake_keys(shared: bytes, th2: bytes) -> tuple[AESGCM, AESGCM]:
    okm = _hkdf(shared, salt=th2, info=PROTOCOL + b" handshake", length=2 * _KEY)
    return AESGCM(okm[:_KEY]), AESGCM(okm[_KEY:])


def _session_keys(shared: bytes, th4: bytes) -> tuple[bytes, bytes, bytes]:
    okm = _hkdf(shared, salt=th4, info=PROTOCOL + b" session", length=3 * _KEY)
    return okm[:_KEY], okm[_KEY : 2 * _KEY], okm[2 * _KEY :]


def _check_type(body: bytes, expected: int, what: str) -> None:
    if not body:
        raise HandshakeError(f"empty handshake message where {what} was expected")
    if body[0] == ERROR:
        # Only the provider sends ERROR to a consumer: it refused us (unauthenticated, so
        # it is a reason to stop, never evidence against anyone).
        raise SessionRefusedError(_peer_error(body))
    if body[0] != expected:
        raise HandshakeError(f"expected {what} (type {expected:#x}), got type {body[0]:#x}")


def _mac(secret: bytes, label: bytes, *parts: bytes) -> bytes:
    m = hmac.new(secret, label, hashlib.sha256)
    for p in parts:
        m.update(p)
    return m.digest()


# --- new sessions ---------------------------------------------------------------------


class ClientHandshake:
    """The consumer's side of a new-session handshake.

    Drive it with ``hello()``, then ``on_server_auth(body)`` (returns the next message),
    then ``on_result(body)`` (returns ``SessionKeys`` or raises).

    Args:
        public_key: This consumer's ed25519 public key (32 bytes).
        sign: Signs bytes with this consumer's node key.
        expected_peer_public_key: The provider's ed25519 public key; anything else is an
            impostor.
        lease_token: Opaque bytes the provider's ``authorize`` checks (for example a
            countersigned lease), or ``None``.
    """

    def __init__(
        self,
        public_key: bytes,
        sign: Callable[[bytes], bytes],
        expected_peer_public_key: bytes,
        lease_token: bytes | None = None,
    ) -> None:
        if len(expected_peer_public_key) != _KEY:
            raise ValueError("expected_peer_public_key must be 32 raw bytes")
        if lease_token is not None and len(lease_token) > MAX_LEASE_TOKEN:
            raise ValueError(f"lease token above {MAX_LEASE_TOKEN} bytes")
        self._public_key = public_key
        self._sign = sign
        self._expected = expected_peer_public_key
        self._lease = lease_token
        self._eph = X25519PrivateKey.generate()
        self._hello = b""
        self._th4 = b""
        self._shared = b""
        self._s2c_hs: AESGCM | None = None

    def hello(self) -> bytes:
        """The first message to send (length-prefixed)."""
        eph = self._eph.public_key().public_bytes_raw()
        self._hello = bytes([NEW_HELLO]) + MAGIC + eph + self._public_key
        return encode_message(self._hello)

    def on_server_auth(self, body: bytes) -> bytes:
        """Check the provider's identity and signature; return ``CLIENT_AUTH`` to send.

        Raises:
            PeerAuthenticationError: the provider is not the expected one, or its
                signature over the transcript is invalid.
            HandshakeError: the message is malformed.
        """
        _check_type(body, SERVER_AUTH, "SERVER_AUTH")
        if len(body) != 1 + 2 * _KEY + _SIG:
            raise HandshakeError(f"SERVER_AUTH has {len(body)} bytes")
        s_eph = body[1 : 1 + _KEY]
        s_static = body[1 + _KEY : 1 + 2 * _KEY]
        sig_s = body[1 + 2 * _KEY :]
        if not hmac.compare_digest(s_static, self._expected):
            raise PeerAuthenticationError(
                f"provider identity mismatch: expected key {self._expected.hex()[:16]}…, "
                f"got {s_static.hex()[:16]}… (impostor or wrong address)"
            )
        th2 = _hash(PROTOCOL, self._hello, s_eph, s_static)
        if not verify(s_static, b"server" + th2, sig_s):
            raise PeerAuthenticationError("provider's transcript signature is invalid")
        self._shared = _dh(self._eph, s_eph)
        c2s_hs, self._s2c_hs = _handshake_keys(self._shared, th2)
        th3 = _hash(th2, sig_s)
        payload = self._sign(b"client" + th3) + (self._lease or b"")
        sealed = c2s_hs.encrypt(_NONCE0, payload, bytes([CLIENT_AUTH]))
        body3 = bytes([CLIENT_AUTH]) + sealed
        self._th4 = _hash(th3, body3)
        return encode_message(body3)

    def on_result(self, body: bytes) -> SessionKeys:
        """Read the provider's verdict.

        Raises:
            SessionRefusedError: the provider refused the consumer (``.reason`` says why).
            HandshakeError: the message is malformed or fails authentication.
        """
        _check_type(body, RESULT, "RESULT")
        if self._s2c_hs is None:
            raise HandshakeError("RESULT before SERVER_AUTH")
        try:
            plain = self._s2c_hs.decrypt(_NONCE1, body[1:], bytes([RESULT]))
        except InvalidTag as exc:
            raise HandshakeError("RESULT failed authentication") from exc
        if plain[:1] == bytes([_REFUSE]):
            reason = plain[1 : 1 + MAX_REASON].decode("utf-8", "replace")
            raise SessionRefusedError(reason)
        if plain[:1] != bytes([_ACCEPT]) or len(plain) != 1 + SESSION_ID_SIZE:
            raise HandshakeError("malformed RESULT")
        c2s, s2c, resume = _session_keys(self._shared, self._th4)
        return SessionKeys(c2s, s2c, resume, bytes(plain[1:]), self._expected)


class ServerHandshake:
    """The provider's side of a handshake: new sessions and resumptions.

    Feed the first message to ``on_hello(body)``. For a new session it returns
    ``SERVER_AUTH``; then ``on_client_auth(body)`` returns the consumer's public key and
    lease token, the shell asks ``authorize``, and ``accept()``/``refuse(reason)`` give the
    final message. For a resumption ``on_hello`` returns ``None`` and the shell continues
    with ``ServerResume``; ``resume_request`` then holds the parsed hello.

    Args:
        public_key: This provider's ed25519 public key.
        sign: Signs bytes with this provider's node key.
    """

    def __init__(self, public_key: bytes, sign: Callable[[bytes], bytes]) -> None:
        self._public_key = public_key
        self._sign = sign
        self.resume_request: ResumeHello | None = None
        self._c_static = b""
        self._shared = b""
        self._th3 = b""
        self._th4 = b""
        self._hs: tuple[AESGCM, AESGCM] | None = None

    def on_hello(self, body: bytes) -> bytes | None:
        """Parse the client's first message.

        Raises:
            HandshakeError: bad magic, unknown type or wrong size.
        """
        if len(body) < 1 + len(MAGIC) or body[1 : 1 + len(MAGIC)] != MAGIC:
            raise HandshakeError("not a cumulus secure-channel client (bad magic or version)")
        if body[0] == RESUME_HELLO:
            self.resume_request = ResumeHello.parse(body)
            return None
        if body[0] != NEW_HELLO:
            raise HandshakeError(f"unknown first handshake message type {body[0]:#x}")
        if len(body) != 1 + len(MAGIC) + 2 * _KEY:
            raise HandshakeError(f"NEW_HELLO has {len(body)} bytes")
        off = 1 + len(MAGIC)
        c_eph = body[off : off + _KEY]
        self._c_static = bytes(body[off + _KEY :])
        eph = X25519PrivateKey.generate()
        s_eph = eph.public_key().public_bytes_raw()
        self._shared = _dh(eph, c_eph)
        th2 = _hash(PROTOCOL, body, s_eph, self._public_key)
        sig_s = self._sign(b"server" + th2)
        self._hs = _handshake_keys(self._shared, th2)
        self._th3 = _hash(th2, sig_s)
        return encode_message(bytes([SERVER_AUTH]) + s_eph + self._public_key + sig_s)

    def on_client_auth(self, body: bytes) -> tuple[bytes, bytes | None]:
        """Check the consumer's signature. Returns ``(consumer_public_key, lease_token)``.

        Raises:
            PeerAuthenticationError: the consumer's signature does not match its claimed
                identity (wrong key, or a relayed handshake).
            HandshakeError: the message is malformed.
        """
        _check_type(body, CLIENT_AUTH, "CLIENT_AUTH")
        if self._hs is None:
            raise HandshakeError("CLIENT_AUTH before NEW_HELLO")
        try:
            plain = self._hs[0].decrypt(_NONCE0, body[1:], bytes([CLIENT_AUTH]))
        except InvalidTag as exc:
            raise HandshakeError("CLIENT_AUTH failed authentication") from exc
        if len(plain) < _SIG or len(plain) > _SIG + MAX_LEASE_TOKEN:
            raise HandshakeError(f"CLIENT_AUTH payload of {len(plain)} bytes")
        if not verify(self._c_static, b"client" + self._th3, plain[:_SIG]):
            raise PeerAuthenticationError(
                "consumer's transcript signature does not match its claimed identity"
            )
        self._th4 = _hash(self._th3, body)
        lease = bytes(plain[_SIG:]) if len(plain) > _SIG else None
        return self._c_static, lease

    def accept(self, session_id: bytes) -> tuple[bytes, SessionKeys]:
        """Accept the consumer: returns the ``RESULT`` message and the session keys."""
        if self._hs is None or not self._th4:
            raise HandshakeError("accept() before a verified CLIENT_AUTH")
        msg = self._hs[1].encrypt(_NONCE1, bytes([_ACCEPT]) + session_id, bytes([RESULT]))
        c2s, s2c, resume = _session_keys(self._shared, self._th4)
        keys = SessionKeys(s2c, c2s, resume, session_id, self._c_static)
        return encode_message(bytes([RESULT]) + msg), keys

    def refuse(self, reason: str) -> bytes:
        """The ``RESULT`` message refusing the consumer with ``reason``."""
        if self._hs is None:
            return error_message(reason)
        plain = bytes([_REFUSE]) + reason.encode("utf-8", "replace")[:MAX_REASON]
        return encode_message(bytes([RESULT]) + self._hs[1].encrypt(_NONCE1, plain, b"\x31"))


# --- resumption -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ResumeHello:
    """A parsed ``RESUME_HELLO``."""

    raw: bytes
    nonce: bytes
    session_id: bytes
    received: int

    @classmethod
    def parse(cls, body: bytes) -> ResumeHello:
        off = 1 + len(MAGIC)
        if len(body) != off + _KEY + SESSION_ID_SIZE + 8:
            raise HandshakeError(f"RESUME_HELLO has {len(body)} bytes")
        nonce = bytes(body[off : off + _KEY])
        sid = bytes(body[off + _KEY : off + _KEY + SESSION_ID_SIZE])
        (received,) = _U64.unpack_from(body, off + _KEY + SESSION_ID_SIZE)
        return cls(bytes(body), nonce, sid, received)


class ClientResume:
    """The consumer's side of a resumption.

    Args:
        session_id: From the original handshake.
        resume_secret: From the original handshake; never sent.
        received: How many records this consumer has received in the session.
    """

    def __init__(self, session_id: bytes, resume_secret: bytes, received: int) -> None:
        self._secret = resume_secret
        self._hello = (
            bytes([RESUME_HELLO]) + MAGIC + os.urandom(_KEY) + session_id + _U64.pack(received)
        )
        self._thr = b""

    def hello(self) -> bytes:
        """The first message to send."""
        return encode_message(self._hello)

    def on_challenge(self, body: bytes) -> bytes:
        """Check the provider knows the secret; return ``RESUME_PROOF``.

        Raises:
            SessionRefusedError: the provider does not know the session (expired).
            PeerAuthenticationError: the provider's MAC is wrong (not the same provider).
        """
        if body[:1] == bytes([ERROR]):
            raise SessionRefusedError(_peer_error(body))
        _check_type(body, RESUME_CHALLENGE, "RESUME_CHALLENGE")
        if len(body) != 1 + _KEY + _MAC:
            raise HandshakeError(f"RESUME_CHALLENGE has {len(body)} bytes")
        s_nonce = body[1 : 1 + _KEY]
        self._thr = _hash(PROTOCOL, self._hello, s_nonce)
        if not hmac.compare_digest(_mac(self._secret, b"server", self._thr), body[1 + _KEY :]):
            raise PeerAuthenticationError("provider failed to prove the session's resume secret")
        return encode_message(bytes([RESUME_PROOF]) + _mac(self._secret, b"client", self._thr))

    def on_resumed(self, body: bytes) -> int:
        """Returns how many of our records the provider holds (retransmit the rest).

        Raises:
            SessionRefusedError: the provider gave up on the session.
            PeerAuthenticationError: the message's MAC is wrong.
        """
        if body[:1] == bytes([ERROR]):
            raise SessionRefusedError(_peer_error(body))
        _check_type(body, RESUMED, "RESUMED")
        if len(body) != 1 + 8 + _MAC:
            raise HandshakeError(f"RESUMED has {len(body)} bytes")
        count = body[1:9]
        if not hmac.compare_digest(_mac(self._secret, b"resumed", self._thr, count), body[9:]):
            raise PeerAuthenticationError("RESUMED failed authentication")
        return _U64.unpack(count)[0]


class ServerResume:
    """The provider's side of a resumption, once the session is found.

    Args:
        hello: The parsed ``RESUME_HELLO``.
        resume_secret: The session's secret.
    """

    def __init__(self, hello: ResumeHello, resume_secret: bytes) -> None:
        self._secret = resume_secret
        self._thr = _hash(PROTOCOL, hello.raw, s_nonce := os.urandom(_KEY))
        self._challenge = (
            bytes([RESUME_CHALLENGE]) + s_nonce + _mac(resume_secret, b"server", self._thr)
        )

    def challenge(self) -> bytes:
        """The ``RESUME_CHALLENGE`` message."""
        return encode_message(self._challenge)

    def on_proof(self, body: bytes) -> None:
        """Check the consumer knows the secret.

        Raises:
            PeerAuthenticationError: the MAC is wrong.
        """
        _check_type(body, RESUME_PROOF, "RESUME_PROOF")
        if len(body) != 1 + _MAC or not hmac.compare_digest(
            _mac(self._secret, b"client", self._thr), body[1:]
        ):
            raise PeerAuthenticationError("resumption proof is invalid")

    def resumed(self, received: int) -> bytes:
        """The ``RESUMED`` message telling the consumer how many records we hold."""
        count = _U64.pack(received)
        return encode_message(
            bytes([RESUMED]) + count + _mac(self._secret, b"resumed", self._thr, count)
        )
