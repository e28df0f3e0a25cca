"""The secure session channel: authenticated, encrypted, resumable frame transport.

It implements the two interfaces of ``transport``: the consumer holds a
blocking ``FrameChannel`` (``connect_secure`` over direct TCP, or
``connect_secure_libp2p`` over a libp2p stream when the provider is not directly
reachable); the provider runs ``serve_secure`` (or ``serve_secure_libp2p``), which calls
``handler(channel)`` once per logical session with an ``AsyncFrameChannel``.

Parts (sans-IO cores first, then the shells):

- ``handshake``: the new-session handshake (X25519 + both ed25519 node identities signing
  the transcript) and the MAC-authenticated resumption handshake.
- ``record``: AES-256-GCM records with implicit counter nonces and implicit rekeying;
  tampered, replayed and reordered records fail authentication.
- ``resume``: frames over records, acknowledgements, the retransmit buffer.
- ``settings``: ``SessionSettings``, the provider's tuning (limits, timeouts), in one
  frozen dataclass passed down to every session; ``ClientSettings``, the consumer's.
- ``client``: the blocking consumer shell; resumes dropped connections by itself.
- ``server``: the trio provider shell: handshakes, resumes, and the sessions' nursery.
- ``session``: one logical session on the provider (``ServerSession``) and the channel its
  handler holds; a grace period for resumption, then ``SessionClosedError`` for the
  handler. ``_sync`` holds the cheap trio primitives its tasks share.
- ``libp2p_path``: the same channel over a Noise-secured libp2p stream.
"""

from __future__ import annotations

from .client import SecureClientChannel as SecureClientChannel
from .client import connect_secure as connect_secure
from .server import SecureServer as SecureServer
from .server import SecureServerChannel as SecureServerChannel
from .server import ServerStatistics as ServerStatistics
from .server import open_secure_server as open_secure_server
from .server import serve_secure as serve_secure
from .settings import ClientSettings as ClientSettings
from .settings import SessionSettings as SessionSettings

__all__ = [
    "ClientSettings",
    "SecureClientChannel",
    "SecureServer",
    "SecureServerChannel",
    "ServerStatistics",
    "SessionSettings",
    "connect_secure",
    "open_secure_server",
    "serve_secure",
]
