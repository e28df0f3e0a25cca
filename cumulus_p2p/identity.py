"""A node's identity: one ed25519 key, from which its libp2p peer ID derives.

Public API (stable; the mesh room imports it):

- ``NodeIdentity.generate() -> NodeIdentity``: a fresh random key (tests, throwaway nodes).
- ``NodeIdentity.load_or_create(data_dir: Path) -> NodeIdentity``: the node's persistent key,
  read from ``data_dir / KEY_FILE_NAME`` or created there with mode 0600. A corrupt file is
  refused with ``IdentityFileError``; it is never overwritten.
- ``NodeIdentity.from_seed(seed: bytes) -> NodeIdentity``: a key from its 32-byte seed.
- ``identity.public_key -> bytes``: the 32 raw public-key bytes (what envelopes carry).
- ``identity.peer_id -> libp2p.peer.id.ID``: the libp2p peer ID of that key.
- ``identity.peer_id_text -> str``: the same peer ID in base58, without loading libp2p.
- ``identity.key_pair -> libp2p.crypto.keys.KeyPair``: pass to ``libp2p.new_host(key_pair=...)``.
- ``identity.sign(data: bytes) -> bytes``: a 64-byte ed25519 signature.
- ``verify(public_key: bytes, data: bytes, signature: bytes) -> bool``: never raises on
  malformed keys or signatures (peer input); it returns ``False``.
- ``peer_id_from_public_key(public_key: bytes) -> ID``: the peer ID of a raw public key, so
  a receiver can check that an envelope's author is the peer it claims to be.

The key is a PyNaCl ``SigningKey``, the very key libp2p's ``Ed25519PrivateKey`` wraps, so
the key that signs market messages is the one behind the Noise handshake and the peer
ID. libp2p is imported only when a libp2p object is asked for: the executor, the shim and
the op stream, which need only to sign and verify, start without loading the mesh stack.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import base58
from nacl.bindings import crypto_core_ed25519_is_valid_point
from nacl.exceptions import BadSignatureError, CryptoError
from nacl.signing import SigningKey, VerifyKey

from ._errors import IdentityFileError

if TYPE_CHECKING:
    from libp2p.crypto.keys import KeyPair
    from libp2p.peer.id import ID

__all__ = [
    "KEY_FILE_NAME",
    "PUBLIC_KEY_SIZE",
    "SIGNATURE_SIZE",
    "NodeIdentity",
    "peer_id_from_public_key",
    "verify",
]

KEY_FILE_NAME = "node_key"
PUBLIC_KEY_SIZE = 32
SIGNATURE_SIZE = 64
_SEED_SIZE = 32
# A self-describing first line lets a future key type or format be told apart from damage.
_KEY_FILE_MAGIC = "cumulus-ed25519-seed-v1"
# A libp2p peer ID of an ed25519 key is the identity multihash (code 0, length 36) of the
# key's protobuf encoding: field 1 KeyType = 1 (Ed25519), field 2 Data = the 32 bytes.
_PEER_ID_PREFIX = bytes([0x00, 0x24, 0x08, 0x01, 0x12, 0x20])


class NodeIdentity:
    """An ed25519 signing key and everything derived from it.

    Build one with ``generate``, ``load_or_create`` or ``from_seed``.
    """

    __slots__ = ("_signing", "_public_key", "_peer_id_bytes")

    def __init__(self, signing_key: SigningKey) -> None:
        """Wrap a PyNaCl signing key. Prefer the named constructors.

        Raises:
            ValueError: the key's public key is not a valid curve point.
        """
        public_key = bytes(signing_key.verify_key)
        if not crypto_core_ed25519_is_valid_point(public_key):
            raise ValueError("the key's public key is not a valid ed25519 curve point")
        self._signing = signing_key
        self._public_key = public_key
        self._peer_id_bytes = _PEER_ID_PREFIX + public_key

    @classmethod
    def generate(cls) -> NodeIdentity:
        """Return a new identity with a random key."""
        while True:  # a random key is an invalid point about once in 2**250 draws
            try:
                return cls(SigningKey.generate())
            except ValueError:
                continue

    @classmethod
    def from_seed(cls, seed: bytes) -> NodeIdentity:
        """Return the identity whose private key is the given 32-byte seed.

        Raises:
            ValueError: ``seed`` is not 32 bytes or gives an invalid public key.
        """
        if len(seed) != _SEED_SIZE:
            raise ValueError(f"an ed25519 seed is {_SEED_SIZE} bytes, got {len(seed)}")
        return cls(SigningKey(seed))

    @classmethod
    def load_or_create(cls, data_dir: Path) -> NodeIdentity:
        """Load the node key from ``data_dir``, creating it (mode 0600) if absent.

        Creation writes a temporary file, fsyncs it and hard-links it into place, so a
        crash never leaves a half-written key and two racing processes agree on one key.

        Args:
            data_dir: The node's data directory; created if missing.

        Returns:
            The node's identity.

        Raises:
            IdentityFileError: The key file exists but is not a valid key. It is left
                untouched; the message says how to recover.
        """
        data_dir = Path(data_dir)
        data_dir.mkdir(parents=True, exist_ok=True)
        path = data_dir / KEY_FILE_NAME
        if not path.exists():
            identity = cls.generate()
            _create_key_file(path, bytes(identity._signing))
            # Another process may have won the race to create the file: read what is there.
        return cls._load(path)

    @classmethod
    def _load(cls, path: Path) -> NodeIdentity:
        def corrupt(why: str) -> IdentityFileError:
            return IdentityFileError(
                f"node key file {path} is corrupt ({why}). It was left untouched. Restore it "
                f"from a backup, or move it away to start over with a new identity (the node "
                f"then gets a new peer ID and loses its reputation)."
            )

        try:
            text = path.read_text(encoding="ascii")
        except UnicodeDecodeError as exc:
            raise corrupt("not ASCII text") from exc
        lines = text.splitlines()
        if len(lines) != 2 or lines[0] != _KEY_FILE_MAGIC:
            raise corrupt(f"expected the line {_KEY_FILE_MAGIC!r} then a hex seed")
        try:
            seed = bytes.fromhex(lines[1])
        except ValueError as exc:
            raise corrupt("the seed is not hex") from exc
        if len(seed) != _SEED_SIZE:
            raise corrupt(f"the seed is {len(seed)} bytes, not {_SEED_SIZE}")
        try:
            return cls.from_seed(seed)
        except ValueError as exc:
            raise corrupt(str(exc)) from exc

    @property
    def public_key(self) -> bytes:
        """The 32 raw bytes of the ed25519 public key."""
        return self._public_key

    @property
    def peer_id(self) -> ID:
        """The libp2p peer ID derived from the public key."""
        from libp2p.peer.id import ID

        return ID(self._peer_id_bytes)

    @property
    def peer_id_text(self) -> str:
        """The peer ID in base58, as ``peer_id.to_base58()`` gives it."""
        return base58.b58encode(self._peer_id_bytes).decode("ascii")

    @property
    def key_pair(self) -> KeyPair:
        """The libp2p key pair, for ``libp2p.new_host(key_pair=...)``."""
        from libp2p.crypto.ed25519 import Ed25519PrivateKey
        from libp2p.crypto.keys import KeyPair

        private = Ed25519PrivateKey(self._signing)
        return KeyPair(private, private.get_public_key())

    def sign(self, data: bytes) -> bytes:
        """Return the 64-byte ed25519 signature of ``data``."""
        return self._signing.sign(data).signature

    def __repr__(self) -> str:
        # Never print key material.
        return f"NodeIdentity(peer_id={self.peer_id_text})"


def verify(public_key: bytes, data: bytes, signature: bytes) -> bool:
    """Check an ed25519 signature.

    All three arguments may come from a peer, so a malformed key or signature gives
    ``False`` rather than an exception.

    Args:
        public_key: 32 raw public-key bytes.
        data: The signed bytes.
        signature: The 64-byte signature.

    Returns:
        ``True`` if and only if ``signature`` is ``public_key``'s signature of ``data``.
    """
    if (
        type(public_key) is not bytes
        or type(signature) is not bytes
        or len(public_key) != PUBLIC_KEY_SIZE
        or len(signature) != SIGNATURE_SIZE
    ):
        return False
    try:
        VerifyKey(public_key).verify(data, signature)
    except (BadSignatureError, CryptoError, ValueError, TypeError):
        return False
    return True


def peer_id_from_public_key(public_key: bytes) -> ID:
    """Return the libp2p peer ID of a raw 32-byte ed25519 public key.

    Raises:
        ValueError: ``public_key`` is not a valid ed25519 public key.
    """
    from libp2p.peer.id import ID

    if len(public_key) != PUBLIC_KEY_SIZE or not crypto_core_ed25519_is_valid_point(public_key):
        raise ValueError("not a valid 32-byte ed25519 public key")
    return ID(_PEER_ID_PREFIX + public_key)


def _create_key_file(path: Path, seed: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(f"{_KEY_FILE_MAGIC}\n{seed.hex()}\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            # link() refuses to replace an existing file, unlike rename().
            os.link(tmp, path)
        except FileExistsError:
            pass
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    finally:
        tmp.unlink(missing_ok=True)
