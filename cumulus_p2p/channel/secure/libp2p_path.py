"""The fallback path: the same secure channel over a libp2p stream.

When a provider cannot be reached by direct TCP (NAT, firewall), the consumer opens a
stream on protocol ``SESSION_PROTOCOL`` over a Noise + yamux libp2p connection, possibly
relayed. The secure channel runs unchanged on top: same handshake, same ``authorize``,
same records and resumption (a resume opens a new stream). Noise already protects the
hop; our layer keeps end-to-end authentication bound to the session and the lease, and
keeps the executor and client code identical on both paths.

Provider side: ``serve_secure_libp2p`` starts its own host; ``handle_libp2p_sessions``
attaches a ``SecureServer`` to a host the node already runs.

Consumer side: the user's thread is synchronous, so ``connect_secure_libp2p`` runs a trio
loop with a dial-only libp2p host in one helper thread (the thread owns the nursery) and
bridges each read and write with ``trio.from_thread``. Closing the channel stops the
loop and joins the thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

import multiaddr
import trio
from libp2p.abc import IHost, INetStream
from libp2p.custom_types import TProtocol
from libp2p.exceptions import BaseLibp2pError
from libp2p.network.stream.exceptions import StreamEOF
from libp2p.stream_muxer.exceptions import MuxedStreamEOF

from ...dht.host import connect, listen_addrs_with_id, new_mesh_host, parse_peer_addr
from ..transport import Buffer
from .client import Link, SecureClientChannel, open_channel
from .server import Authorize, Handler, SecureServer, open_secure_server
from .settings import DEFAULT_CLIENT_SETTINGS, DEFAULT_SETTINGS, ClientSettings, SessionSettings

SESSION_PROTOCOL = TProtocol("/cumulus/session/1.0.0")
_LOOPBACK = "/ip4/127.0.0.1/tcp/0"


class Libp2pByteStream(trio.abc.Stream):
    """A ``trio.abc.Stream`` over a libp2p ``INetStream`` (for ``SecureServer``)."""

    def __init__(self, stream: INetStream) -> None:
        self._stream = stream
        self.closed = trio.Event()

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        try:
            await self._stream.write(bytes(data))
        except BaseLibp2pError as exc:
            raise trio.BrokenResourceError(f"libp2p stream broke: {exc}") from exc

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        try:
            return await self._stream.read(max_bytes or 65536)
        except (StreamEOF, MuxedStreamEOF):
            return b""
        except BaseLibp2pError as exc:
            raise trio.BrokenResourceError(f"libp2p stream broke: {exc}") from exc

    async def aclose(self) -> None:
        if self.closed.is_set():
            await trio.lowlevel.checkpoint()
            return
        self.closed.set()
        # A FIN, not a reset: a reset makes the peer drop frames it has not read yet,
        # such as the refusal we have just sent. Reset only if the FIN cannot go out.
        with trio.CancelScope(shield=True), trio.move_on_after(2):
            try:
                await self._stream.close()
            except BaseLibp2pError:
                with contextlib.suppress(BaseLibp2pError):
                    await self._stream.reset()


def handle_libp2p_sessions(
    host: IHost, server: SecureServer, protocol: TProtocol = SESSION_PROTOCOL
) -> None:
    """Serve secure sessions arriving as libp2p streams on ``host``."""

    async def on_stream(stream: INetStream) -> None:
        adapted = Libp2pByteStream(stream)
        # Stream errors never escape a libp2p handler (see LIBP2P-NOTES): the server
        # handles peer misbehaviour itself, and we keep the handler alive until the
        # session lets go of the stream.
        await server.handle_stream(adapted)
        await adapted.closed.wait()

    host.set_stream_handler(protocol, on_stream)


async def serve_secure_libp2p(
    identity,
    *,
    authorize: Authorize,
    handler: Handler,
    listen_addr: str = _LOOPBACK,
    settings: SessionSettings = DEFAULT_SETTINGS,
    # trio-stubs (from trio-typing, which libp2p and multiaddr require) shadow trio's own
    # annotations for mypy and predate trio.TaskStatus.
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,  # type: ignore[name-defined]
) -> None:
    """Serve the secure channel over libp2p (own Noise+yamux host) until cancelled.

    Arguments are those of ``serve_secure``; ``listen_addr`` is a multiaddr.
    ``task_status.started`` receives the host's first address with ``/p2p/<peer id>``,
    which ``connect_secure_libp2p`` accepts.
    """
    host = new_mesh_host(identity.key_pair)
    async with open_secure_server(
        identity, authorize=authorize, handler=handler, settings=settings
    ) as server:
        async with host.run(listen_addrs=[multiaddr.Multiaddr(listen_addr)]):
            handle_libp2p_sessions(host, server)
            task_status.started(str(listen_addrs_with_id(host)[0]))
            await trio.sleep_forever()


class _Bridge:
    """A trio loop with a dial-only libp2p host, in a thread that owns it."""

    def __init__(self, identity, peer_addr: str, timeout: float) -> None:
        self._identity = identity
        self._info = parse_peer_addr(peer_addr)
        self._timeout = timeout
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._host: IHost | None = None
        self._thread = threading.Thread(target=self._run, name="cumulus-libp2p", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # noqa: BLE001 - reported to the opening thread
            self._error = exc
        finally:
            self._ready.set()

    async def _main(self) -> None:
        host = new_mesh_host(self._identity.key_pair)
        async with host.run(listen_addrs=[multiaddr.Multiaddr(_LOOPBACK)]):
            self._host = host
            self._stop = trio.Event()
            self._token = trio.lowlevel.current_trio_token()
            self._ready.set()
            await self._stop.wait()

    def call(self, afn, *args):
        """Run ``afn(*args)`` in the bridge's loop; libp2p and loop failures -> OSError."""
        if self._token is None:
            raise OSError("libp2p bridge is not running")
        try:
            return trio.from_thread.run(afn, *args, trio_token=self._token)
        except (trio.RunFinishedError, trio.Cancelled) as exc:
            raise OSError("libp2p bridge stopped") from exc
        except BaseLibp2pError as exc:
            raise OSError(f"libp2p stream failed: {exc}") from exc

    def dial(self) -> Link:
        return _BridgedLink(self, self.call(self._open))

    async def _open(self) -> INetStream:
        host = self._host
        if host is None:  # pragma: no cover - set before _ready
            raise OSError("libp2p bridge is not running")
        with trio.fail_after(self._timeout):
            await connect(host, self._info, timeout=self._timeout)
            return await host.new_stream(self._info.peer_id, [SESSION_PROTOCOL])

    def close(self) -> None:
        if self._token is not None and self._stop is not None:
            try:
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
            except trio.RunFinishedError:
                pass
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)


#: Bytes ``_BridgedLink.wait_readable`` reads ahead when some arrive.
_EARLY_READ = 1 << 16


class _BridgedLink:
    """A blocking ``Link`` over one libp2p stream living in the bridge's loop."""

    def __init__(self, bridge: _Bridge, stream: INetStream) -> None:
        self._bridge = bridge
        self._stream = stream
        self._dead = False
        self._early: bytes | None = None  # read by ``wait_readable``, not yet taken

    def sendmsg_all(self, chunks: Sequence[Buffer]) -> None:
        if self._dead:
            raise OSError("libp2p stream closed")
        self._bridge.call(self._stream.write, b"".join(bytes(c) for c in chunks))

    def recv_into(self, view: memoryview) -> int:
        if self._dead:
            raise OSError("libp2p stream closed")
        data, self._early = self._early, None
        if data is None:
            data = self._bridge.call(self._read, len(view))
        elif len(data) > len(view):
            data, self._early = data[: len(view)], data[len(view) :]
        view[: len(data)] = data
        return len(data)

    def wait_readable(self, timeout_s: float) -> bool:
        """Whether bytes (or the stream's end) arrived within ``timeout_s``."""
        if self._early is None and not self._dead:
            self._early = self._bridge.call(self._read_within, timeout_s)
        return self._early is not None or self._dead

    async def _read_within(self, timeout_s: float) -> bytes | None:
        with trio.move_on_after(timeout_s):
            return await self._read(_EARLY_READ)
        return None

    async def _read(self, n: int) -> bytes:
        try:
            return await self._stream.read(n)
        except (StreamEOF, MuxedStreamEOF):
            return b""

    def shutdown(self) -> None:
        if self._dead:
            return
        self._dead = True
        try:
            self._bridge.call(self._stream.reset)
        except OSError:
            pass

    def close(self) -> None:
        self.shutdown()


def connect_secure_libp2p(
    peer_addr: str,
    *,
    identity,
    expected_peer_public_key: bytes,
    lease: bytes | None = None,
    settings: ClientSettings = DEFAULT_CLIENT_SETTINGS,
    **tuning: Any,
) -> SecureClientChannel:
    """Open a secure session to a provider over a libp2p stream (blocking).

    Args:
        peer_addr: The provider's multiaddr ending in ``/p2p/<peer id>`` (may be a relay
            circuit address).
        identity: This consumer's ``NodeIdentity``.
        expected_peer_public_key: The provider's ed25519 public key.
        lease: Opaque lease token for the provider's ``authorize``, or ``None``.
        settings, tuning: As for ``connect_secure``; ``timeout`` bounds dialing a stream
            and each handshake, ``resume_timeout`` how long a broken stream is retried.

    Returns:
        A ``FrameChannel``; ``close()`` also stops the helper thread.

    Raises:
        SessionRefusedError, PeerAuthenticationError, HandshakeError, TypeError: as for
            ``connect_secure``.
        OSError: the provider could not be reached.
        MeshError: ``peer_addr`` is not a valid peer multiaddr.
    """
    settings = dataclasses.replace(settings, **tuning)
    bridge = _Bridge(identity, peer_addr, settings.timeout)
    try:
        return open_channel(
            bridge.dial,
            bridge.dial(),
            identity=identity,
            expected_peer_public_key=expected_peer_public_key,
            lease=lease,
            settings=settings,
            guard=lambda shake: _with_timeout(bridge, settings.timeout, shake),
            on_close=bridge.close,
        )
    except BaseException:
        bridge.close()
        raise


def _with_timeout(bridge: _Bridge, timeout: float, fn):
    """Run a blocking handshake, resetting the stream if it takes longer than ``timeout``.

    A libp2p stream has no socket timeout; a timer in the bridge's loop would need the
    stream, so a watchdog thread shuts the link down instead (the handshake then fails
    with a clear ``HandshakeError``).
    """
    done = threading.Event()
    result: list = []

    def watchdog() -> None:
        if not done.wait(timeout):
            bridge.close()

    guard = threading.Thread(target=watchdog, daemon=True)
    guard.start()
    try:
        result.append(fn())
    finally:
        done.set()
        guard.join()
    return result[0]
