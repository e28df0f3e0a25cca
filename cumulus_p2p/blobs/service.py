"""Blobs between hosts: serving a session's kept pieces to a grant, and pulling them.

Theory of operation
-------------------
A checkpoint kept on the host side (``kept.py``) reaches another host without touching
the consumer's link: the consumer tells the other host to *pull* it from the hosts that
keep it, naming each piece by digest (a session's ``pull`` message, into the host's
store, for a standby; or ``restore``, straight into the session's storages, for a
failover; both handled by ``executor.py``). The puller dials each source's executor port
and opens a blob connection::

    -> ["blobs", version, {"grant": grant}]
    <- ["ready"]                      or ["refused", why] and the connection ends
    -> ["get", [digest, ...]]         at most GET_PIECES digests
    <- ["blobs", [length, ...]] + the pieces' bytes
                                      or ["refused", why]: some piece is not granted
    -> ["bye"]

A grant names one session (``grant_of`` its token, which only its consumer knows), and a
source serves only the pieces that session keeps: a peer without the grant, or asking for
pieces the grant does not cover, gets nothing.

Between executors run by hand, a source's address is its executor's ``host:port``. Hosts
of the market serve sessions only over the secure channel, so there a source's address is
``<host's public key, hex>@host:port``: the puller opens a secure channel to that port,
authenticates the host by its key, and presents ``reader_token(grant)`` where a consumer
would present its lease. The host admits the connection for blobs only, and only when one
of its sessions keeps pieces under that grant (``node/provider.py``). The puller's own
key is made for the one connection: the grant, not its identity, is what opens the pieces,
and no executor holds its node's key.

The puller trusts no source: every piece is checked against its digest before the store
keeps it (``BlobStore.put``). A source that refuses, fails or sends bytes that are not
what they are named is dropped, and the pieces still missing are asked of the next one.
Both ends overlap their disks with the link: the source reads the next window of pieces
while it sends one, and the puller keeps ``IN_FLIGHT`` requests unanswered and writes
what arrived in a thread while the next window arrives. Memory in flight is bounded by a
few windows of ``GET_PIECES`` on each side, never by the state's size.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import blake3
import trio

from .._errors import BlobMismatchError, CumulusError, RemoteProtocolError, SessionClosedError
from ..channel.secure import connect_secure
from ..channel.transport import AsyncFrameChannel, ThreadedFrameChannel, TrioFrameChannel
from ..identity import NodeIdentity
from ..wire.protocol import PROTOCOL_VERSION, decode_frame, encode_frame, split_blobs
from .names import PIECE, is_digest

log = logging.getLogger(__name__)

#: What a source may do wrong: be unreachable, refuse, stall, or send garbage.
_SOURCE_ERRORS = (OSError, RemoteProtocolError, SessionClosedError, trio.TooSlowError)

#: First word of a blob connection, where a session's would be ``hello`` or ``resume``.
HELLO = "blobs"
#: Pieces asked for in one ``get`` (32 MiB), and ``get``s a puller keeps unanswered: the
#: source reads the next while it sends one, and the link never waits for a request.
GET_PIECES = 2
IN_FLIGHT = 2
#: Most digests one ``pull`` may name: a 16 TiB state.
MAX_PULL = 1024 * 1024
#: Seconds a source may take to answer a ``get`` before the puller moves on.
GET_TIMEOUT = 120.0


def grant_of(token: str) -> str:
    """The grant that opens a session's kept pieces to another host: derived from the
    session's token, so it names the session without letting anyone resume it."""
    return blake3.blake3(b"cumulus-grant\x00" + token.encode()).hexdigest()


_READER = b"cumulus-blobs\x00"
#: Why a connection admitted by a grant may not open or resume a session.
ONLY_BLOBS = "a connection admitted by a grant may only read kept pieces, not run a session"


def reader_token(grant: str) -> bytes:
    """What a puller presents to a host's secure channel in place of a lease."""
    return _READER + grant.encode()


def grant_in(token: bytes | None) -> str | None:
    """The grant a secure channel's token asks to read by, or None: it is no reader's."""
    if token is None or not token.startswith(_READER):
        return None
    grant = token[len(_READER) :].decode("ascii", "replace")
    return grant if is_digest(grant) else None


# --- serving ---------------------------------------------------------------------------


async def serve_blobs(
    channel: AsyncFrameChannel, header: list, find: Callable[[str], Callable | None]
) -> None:
    """Serve one blob connection whose first message was ``header``.

    ``find(grant)`` is the ``piece(digest) -> bytes | None`` of the session the grant
    names, or None when no session here has it.
    """
    grant = _hello_grant(header)
    piece = find(grant)
    if piece is None:
        await channel.send_frame(encode_frame(["refused", "no session here has that grant"]))
        return
    await channel.send_frame(encode_frame(["ready"]))
    # The next request's pieces are read from disk while this one's are sent.
    failures: list[RemoteProtocolError] = []
    send, receive = trio.open_memory_channel[tuple](1)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_send_answers, channel, receive, nursery.cancel_scope)
        async with send:
            try:
                await _read_requests(channel, piece, send)
            except RemoteProtocolError as exc:  # raised after the nursery, as it came
                failures.append(exc)
    if failures:
        raise failures[0]


async def _read_requests(
    channel: AsyncFrameChannel, piece: Callable, send: trio.MemorySendChannel
) -> None:
    while True:
        try:
            request, _ = decode_frame(await channel.receive_frame())
        except SessionClosedError:  # a puller that has what it came for may just hang up
            return
        if request == ["bye"]:
            return
        names = _get_names(request)
        await send.send((names, await trio.to_thread.run_sync(_look_up, piece, names)))


async def _send_answers(
    channel: AsyncFrameChannel, receive: trio.MemoryReceiveChannel, scope: trio.CancelScope
) -> None:
    async with receive:
        async for names, found in receive:
            missing = sum(f is None for f in found)
            if missing:
                why = f"{missing} of the {len(names)} pieces asked for are not granted to you"
                answer = encode_frame(["refused", why])
            else:
                answer = encode_frame(["blobs", [len(f) for f in found]], found)
            try:
                await channel.send_frame(answer)
            except SessionClosedError:
                scope.cancel()  # the puller is gone: stop reading for it too
                return


def _look_up(piece: Callable, names: list[str]) -> list[memoryview | None]:
    found = []
    for name in names:
        try:
            found.append(piece(name))
        except BlobMismatchError as exc:  # damaged on disk: dropped, never served
            log.warning("blob service: %s", exc)
            found.append(None)
    return found


def _hello_grant(header: list) -> str:
    ok = len(header) == 3 and header[1] == PROTOCOL_VERSION and isinstance(header[2], dict)
    grant = header[2].get("grant") if ok else None
    if not is_digest(grant):
        raise RemoteProtocolError(
            f'a blob connection opens with ["blobs", {PROTOCOL_VERSION}, {{"grant": hex}}]'
        )
    return grant


def _get_names(request: list) -> list[str]:
    ok = len(request) == 2 and request[0] == "get" and isinstance(request[1], list)
    if not ok or not 0 < len(request[1]) <= GET_PIECES or not all(map(is_digest, request[1])):
        raise RemoteProtocolError(f'expected ["get", [1 to {GET_PIECES} digests]] or ["bye"]')
    return request[1]


# --- pulling ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    """A host that keeps pieces of a session, and the grant that opens them."""

    address: str  # host:port of its executor, or key-hex@host:port of a market host's
    grant: str

    @staticmethod
    def secure_address(public_key: bytes, endpoint: str) -> str:
        """The address of a host that serves over the secure channel at ``endpoint``."""
        return f"{public_key.hex()}@{endpoint}"


@dataclass
class Pulled:
    """What a pull did: bytes fetched and kept, and why sources were dropped."""

    fetched_bytes: int = 0
    fetched: int = 0
    dropped: list[str] = field(default_factory=list)


class PullError(Exception):
    """Some pieces could be had from no source; ``pulled`` says what was done."""

    def __init__(self, message: str, pulled: Pulled) -> None:
        super().__init__(message)
        self.pulled = pulled


def parse_pull(options: object) -> tuple[list[Source], list[str]]:
    """Validate a ``pull`` message's ``{"sources": [[address, grant], ...], "digests":
    [...]}``.

    Raises:
        RemoteProtocolError: it is not that shape.
    """
    names = options.get("digests") if isinstance(options, dict) else None
    if not isinstance(names, list) or len(names) > MAX_PULL:
        raise RemoteProtocolError(
            f'pull takes {{"sources": [[host:port, grant], ...], "digests": [...]}} with at '
            f"most {MAX_PULL} digests"
        )
    if not all(is_digest(n) for n in names):
        raise RemoteProtocolError("pull names pieces by digest: 64 lower-case hex digits each")
    return parse_sources(options), list(dict.fromkeys(names))


def parse_sources(options: object) -> list[Source]:
    """Validate the ``"sources": [[address, grant], ...]`` of a ``pull`` or a ``restore``.

    Raises:
        RemoteProtocolError: they are not that shape.
    """
    if not (isinstance(options, dict) and isinstance(options.get("sources"), list)):
        raise RemoteProtocolError('a pull needs "sources": [[host:port, grant], ...]')
    sources = []
    for entry in options["sources"]:
        good = isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)
        if not good or not is_digest(entry[1]) or not _is_address(entry[0]):
            raise RemoteProtocolError(
                f"a pull source is [host:port or key-hex@host:port, grant], not {entry!r}"
            )
        sources.append(Source(entry[0], entry[1]))
    return sources


def _is_address(text: str) -> bool:
    key, at, endpoint = text.rpartition("@")
    host, _, port = endpoint.rpartition(":")
    if not (host and port.isdigit()):
        return False
    return not at or is_digest(key)  # a public key in hex: 64 lower-case digits too


class Sink(Protocol):
    """Where pulled pieces go: a host's ``BlobStore``, or the storages of a failover's
    restore (``restoring.PieceTargets``)."""

    def __contains__(self, name: object) -> bool: ...

    def put(self, name: str, data: memoryview) -> bool:
        """Check ``data`` against ``name`` and keep it; False when there is no room.

        Raises:
            BlobMismatchError: ``data`` is not what ``name`` says.
        """
        ...


async def pull(
    store: Sink, sources: Sequence[Source], names: Sequence[str], *, max_frame: int
) -> Pulled:
    """Fetch into ``store`` every piece of ``names`` it lacks, from ``sources`` in order.

    Raises:
        PullError: some pieces are in no source (its ``pulled`` says what was kept).
    """
    pulled = Pulled()
    missing = [n for n in names if n not in store]
    for source in sources:
        if not missing:
            break
        try:
            missing = await _pull_from(store, source, missing, pulled, max_frame)
        except _SOURCE_ERRORS as exc:
            why = f"{source.address}: {exc}"
            log.warning("blob pull: dropped source %s", why)
            pulled.dropped.append(why)
    if missing:
        why = "; ".join(pulled.dropped) or "no source"
        raise PullError(f"{len(missing)} pieces could be had from no source ({why})", pulled)
    return pulled


async def _pull_from(
    store: Sink, source: Source, names: list[str], pulled: Pulled, max_frame: int
) -> list[str]:
    """Fetch ``names`` from one source; returns those still missing."""
    channel = await _dial(source, max_frame)
    kept: set[str] = set()
    try:
        await channel.send_frame(encode_frame([HELLO, PROTOCOL_VERSION, {"grant": source.grant}]))
        answer, _ = decode_frame(await channel.receive_frame())
        if answer != ["ready"]:
            raise RemoteProtocolError(f"refused the grant: {answer[1:]}")
        # Errors are collected, not raised, inside the nursery: a source's failure is an
        # answer to act on (the next source), not a crash to unwind.
        errors: list[Exception] = []
        send, receive = trio.open_memory_channel[list](1)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_keep_pieces, store, receive, kept, pulled, errors)
            async with send:
                try:
                    await _get_all(channel, names, send, errors)
                except _SOURCE_ERRORS as exc:
                    errors.append(exc)
        if errors:
            raise errors[0]
        await channel.send_frame(encode_frame(["bye"]))
    finally:
        await channel.aclose()
    return [n for n in names if n not in kept]


async def _dial(source: Source, max_frame: int) -> AsyncFrameChannel:
    """A frame channel to ``source``: plain TCP to an executor, or the secure channel to
    a market host (its key before the ``@``)."""
    key, _, endpoint = source.address.rpartition("@")
    host, _, port = endpoint.rpartition(":")
    if not key:
        stream = await trio.open_tcp_stream(host.strip("[]"), int(port))
        return TrioFrameChannel(stream, max_frame=max_frame)
    try:
        secure = await trio.to_thread.run_sync(
            lambda: connect_secure(
                host.strip("[]"),
                int(port),
                identity=NodeIdentity.generate(),
                expected_peer_public_key=bytes.fromhex(key),
                lease=reader_token(source.grant),
                max_frame=max_frame,
            )
        )
    except (ValueError, CumulusError) as exc:
        raise RemoteProtocolError(f"no secure channel: {exc}") from exc
    return ThreadedFrameChannel(secure)


async def _get_all(
    channel: AsyncFrameChannel,
    names: list[str],
    send: trio.MemorySendChannel,
    errors: list[Exception],
) -> None:
    """Ask for ``names`` a window at a time, ``IN_FLIGHT`` windows ahead, and pass each
    answer on to be kept, until done or an error is recorded."""
    windows = [names[i : i + GET_PIECES] for i in range(0, len(names), GET_PIECES)]
    for window in windows[:IN_FLIGHT]:
        await channel.send_frame(encode_frame(["get", window]))
    for index, window in enumerate(windows):
        blobs = await _answer(channel, window)
        if index + IN_FLIGHT < len(windows):
            await channel.send_frame(encode_frame(["get", windows[index + IN_FLIGHT]]))
        if errors:
            return
        await send.send(list(zip(window, blobs, strict=True)))


async def _answer(channel: AsyncFrameChannel, names: list[str]) -> list[memoryview]:
    with trio.fail_after(GET_TIMEOUT):
        header, area = decode_frame(await channel.receive_frame())
    if header[0] != "blobs" or len(header) != 2:
        raise RemoteProtocolError(f"refused a get: {header[1:]}")
    blobs = split_blobs(area, header[1])
    if len(blobs) != len(names) or any(len(b) > PIECE for b in blobs):
        raise RemoteProtocolError("answered a get with the wrong number or size of pieces")
    return blobs


async def _keep_pieces(
    store: Sink,
    receive: trio.MemoryReceiveChannel,
    kept: set[str],
    pulled: Pulled,
    errors: list[Exception],
) -> None:
    """Check and store the pieces that arrive, in a thread, while the next ones do; after
    an error, only drain what arrives."""
    async with receive:
        async for window in receive:
            for name, data in window:
                if errors:
                    break
                try:
                    if not await trio.to_thread.run_sync(store.put, name, data):
                        raise OSError(f"this host has no room for piece {name[:16]}")
                except BlobMismatchError as exc:
                    errors.append(RemoteProtocolError(f"sent bytes that are not their name: {exc}"))
                except OSError as exc:
                    errors.append(exc)
                else:
                    kept.add(name)
                    pulled.fetched += 1
                    pulled.fetched_bytes += len(data)
