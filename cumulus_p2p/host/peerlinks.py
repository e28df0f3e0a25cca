"""Encrypted, authenticated links between a job's hosts: TLS 1.3 tunnels keyed by the
group's secret, under gloo and the group's store.

Theory of operation
-------------------
torch's gloo speaks plain TCP and has no TLS transport in the builds we run on, and a
``TCPStore`` is plain TCP too. So neither listens where other hosts can reach it: each
rank's gloo and rank 0's store listen on the host's loopback, and the only port a host
opens to the others is its ``Tunnel``'s. Every TCP connection gloo or the store makes to
another host goes into a local forwarder instead and crosses between the hosts in TLS 1.3
(Python's ``ssl``: OpenSSL's TLS, nothing of our own).

Both ends prove that they hold the group's secret: the consumer draws it (the group's
prefix, 128 bits at random) and gives it to each rank's executor over that rank's own
encrypted, lease-authenticated channel, so only the job's hosts have it. From it each
derives the same ed25519 key and the same self-signed certificate (``GroupKey``); a TLS
peer must present that certificate and prove its key, on both sides. A host outside the
job fails the handshake and reaches neither the store nor gloo. TLS's ephemeral key
exchange keeps recorded traffic secret even if the group's secret leaks later.

One OpenSSL connection must not be read and written from two threads at once, and a
gloo connection carries bytes both ways at once. So each tunnelled connection is two TLS
connections, one per direction, each pumped by one thread: the initiator opens the one it
writes, the acceptor answers with the connection's id, and the initiator opens the one it
reads under that id.

How gloo finds its peers is its own: each rank ``set``s an address blob in the store and
``get``s the others'. ``LinkedStore`` rewrites those blobs on their way: the address a
rank publishes becomes its tunnel's (the host's address and the tunnel's port), and a
peer's address, when read, becomes a local forwarder to that peer's tunnel. The blob's
layout is gloo's; ``publish`` finds the IPv4 socket address in it by this rank's own
loopback listener and refuses, saying so, a blob it cannot read.

A host that hangs (a stopped process, a frozen machine) keeps its links open, its kernel
acknowledging for it, and gloo would wait out the group's timeout. So each pair of
tunnels pulses a byte each way every second over a link of its own, and a tunnel that
hears no pulse from a peer for its ``silence_s`` breaks every link of the group: gloo
then sees its peer gone, and the job goes back as when a host dies.

Not here: IPv6 hosts (the address must fit gloo's IPv4 slot), and relays: a host that
others cannot reach takes no peer links (``--no-peer-links``) and its job's collectives
go through the consumer.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import secrets
import socket
import ssl
import struct
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar, cast

import torch.distributed as dist
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.x509.oid import NameOID

from ..channel.transport import SILENCE_S

_Socket = TypeVar("_Socket", bound=socket.socket)

LOOPBACK = "127.0.0.1"
#: Where gloo listens, and where the forwarders to peers that gloo must see as ordered
#: below or above it listen (see ``LinkedStore.get``).
GLOO_HOST, BELOW_GLOO, ABOVE_GLOO = "127.0.0.2", "127.0.0.1", "127.0.0.3"
#: What a tunnelled connection reaches on the accepting host.
STORE, GLOO, PROBE, PULSE = b"S", b"G", b"P", b"H"
_OPEN, _ANSWER = b"O", b"A"
_ID = 16
HANDSHAKE_TIMEOUT_S = 10.0
#: A link to a host that vanished without closing it (power lost, network cut) must not
#: wait for gloo's timeout, which the script sees as its own error: keepalive probes
#: (idle, interval, count) and a bound on unacknowledged data end it in about 25 s, and
#: gloo then sees its peer gone, which a job with failover recovers from.
KEEPALIVE_S = (10, 5, 3)
UNACKED_LIMIT_S = 30
#: Connections in their handshake at once: anyone can open one to the tunnel's port, and
#: a thread waits on each; past this many, a new one is closed at once, so a flood of idle
#: connections costs the executor (and its other tenants) threads no more.
MAX_HANDSHAKES = 32
_CHUNK = 1 << 20
#: How often each pair of tunnels pulses a byte each way, so that a hung peer is found
#: (the module's docstring says how).
PULSE_S = 1.0


class _Stream(Protocol):
    """What the pumps use of a socket, or of a ``_TlsStream``."""

    def recv_into(self, buffer: memoryview) -> int: ...
    def recv(self, size: int) -> bytes: ...
    def sendall(self, data: bytes | memoryview) -> None: ...
    def shutdown(self, how: int) -> None: ...
    def close(self) -> None: ...


class PeerLinkError(Exception):
    """A link between two of a job's hosts could not be made, or gloo's address could
    not be read; the message says which and what to do."""


@dataclass(frozen=True)
class GroupKey:
    """The TLS identity every member of one group derives from its secret."""

    cert_pem: bytes
    key_pem: bytes
    cert_der: bytes

    @classmethod
    def from_secret(cls, secret: str) -> GroupKey:
        """The same key and certificate on every host that holds ``secret``."""
        seed = HKDF(hashes.SHA256(), 32, salt=None, info=b"cumulus group link").derive(
            secret.encode()
        )
        key = Ed25519PrivateKey.from_private_bytes(seed)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "cumulus job group")])
        utc = datetime.UTC
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(int.from_bytes(seed[:8], "big") | 1)
            .not_valid_before(datetime.datetime(2020, 1, 1, tzinfo=utc))
            .not_valid_after(datetime.datetime(2100, 1, 1, tzinfo=utc))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, None)  # ed25519 signs deterministically: every host's is the same
        )
        key_pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        return cls(
            cert.public_bytes(serialization.Encoding.PEM),
            key_pem,
            cert.public_bytes(serialization.Encoding.DER),
        )

    def context(self, *, server: bool) -> ssl.SSLContext:
        """A TLS 1.3 context that presents this key and accepts only a peer presenting it."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        context.check_hostname = False
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(cadata=self.cert_pem.decode())
        if server:
            context.num_tickets = 0  # no resumption: a ticket is a second secret to guard
        # ssl loads a key from files alone: a private directory, emptied at once.
        with tempfile.TemporaryDirectory() as private:
            path = Path(private) / "group.pem"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as out:
                out.write(self.key_pem + self.cert_pem)
            context.load_cert_chain(path)
        return context


# --- gloo's address blobs (sans-IO) --------------------------------------------------

_INET = struct.pack("=H", socket.AF_INET)  # sockaddr_in.sin_family, in the host's order


@dataclass(frozen=True)
class AddressSlot:
    """Where gloo's blob holds its IPv4 socket address, learned from this rank's own."""

    offset: int
    size: int

    def read(self, blob: bytes) -> tuple[str, int]:
        """The (address, port) a peer's blob names."""
        if len(blob) != self.size or blob[self.offset : self.offset + 2] != _INET:
            raise PeerLinkError("a peer's gloo address is not in the form this host's is")
        port = struct.unpack_from(">H", blob, self.offset + 2)[0]
        return socket.inet_ntoa(blob[self.offset + 4 : self.offset + 8]), port

    def write(self, blob: bytes, address: str, port: int) -> bytes:
        """``blob`` naming ``address:port`` instead."""
        packed = _INET + struct.pack(">H", port) + socket.inet_aton(address)
        return blob[: self.offset] + packed + blob[self.offset + 8 :]


def find_slot(blob: bytes) -> tuple[AddressSlot, int]:
    """Find gloo's listener (on ``GLOO_HOST``) in this rank's own gloo blob: its slot and
    port. Raises ``PeerLinkError`` when it is not there exactly once (a gloo whose blob
    this code does not know)."""
    loopback = socket.inet_aton(GLOO_HOST)
    found = [
        at
        for at in range(len(blob) - 7)
        if blob[at : at + 2] == _INET and blob[at + 4 : at + 8] == loopback
    ]
    if len(found) != 1:
        raise PeerLinkError(
            "this torch's gloo publishes its address in a form cumulus cannot read: "
            "run the host with --no-peer-links (collectives go through the consumer)"
        )
    at = found[0]
    return AddressSlot(at, len(blob)), struct.unpack_from(">H", blob, at + 2)[0]


# --- the tunnel ----------------------------------------------------------------------


class Tunnel:
    """One rank's end of its group's links: a TLS listener on the host's address that
    admits the group's members to what this rank exposes (its gloo listener, rank 0's
    store), and local forwarders into the other members' tunnels. ``close`` ends every
    thread it started and every connection."""

    def __init__(self, secret: str, public_host: str, silence_s: float = SILENCE_S) -> None:
        try:
            socket.inet_aton(public_host)
        except OSError:
            raise PeerLinkError(
                f"peer links need the host's IPv4 address, not {public_host!r}"
            ) from None
        key = GroupKey.from_secret(secret)
        self._server_tls = key.context(server=True)
        self._client_tls = key.context(server=False)
        self._cert = key.cert_der
        self.host = public_host
        self.secret = secret
        self._listener = socket.create_server((public_host, 0))
        self.port: int = self._listener.getsockname()[1]
        self._targets: dict[bytes, tuple[str, int]] = {}
        self._forwards: dict[tuple[str, int, bytes], int] = {}
        self._halves: dict[bytes, _Splice] = {}
        self._sockets: set[socket.socket] = {self._listener}
        self._threads: list[threading.Thread] = []
        self._lock = threading.RLock()
        self._closed = False
        self._handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)
        self._silence_s = silence_s
        self._pulsing: set[tuple[str, int]] = set()
        #: Why the links broke, when a peer fell silent (``None`` while they hold).
        self.severed: str | None = None
        self._spawn(self._accept, self._listener, self._admit, self._handshakes)

    def expose(self, kind: bytes, local: tuple[str, int]) -> None:
        """Admit members' ``kind`` connections to ``local``, a loopback address here."""
        self._targets[kind] = local

    def forward(self, remote: tuple[str, int], kind: bytes, on: str = LOOPBACK) -> int:
        """A port on loopback address ``on`` whose connections reach ``kind`` at
        ``remote``'s tunnel."""
        with self._lock:
            port = self._forwards.get((*remote, kind))
            if port is not None:
                return port
            listener = self._track(socket.create_server((on, 0)))
            port = self._forwards[(*remote, kind)] = listener.getsockname()[1]
            pulse = remote not in self._pulsing
            self._pulsing.add(remote)
        self._spawn(self._accept, listener, lambda local: self._initiate(local, remote, kind))
        if pulse:
            self._spawn(self._pulse_to, remote)
        return port

    def probe(self, remote: tuple[str, int]) -> None:
        """Check that ``remote`` is this group's tunnel and admits this host; raises
        ``PeerLinkError`` saying why not."""
        tls = self._open(remote, _OPEN, PROBE)
        try:
            if _read_exact(tls, 1) != b"+":
                raise PeerLinkError(f"the group's tunnel at {remote[0]}:{remote[1]} refused")
        finally:
            tls.close()

    def close(self) -> None:
        """Close every listener and connection; wait for the threads to end."""
        with self._lock:
            self._closed = True
            sockets, self._sockets = list(self._sockets), set()
        for sock in sockets:
            _close(sock)
        for thread in self._threads:
            thread.join(timeout=5)

    # --- the threads ---------------------------------------------------------------

    def _spawn(self, work, *args) -> None:
        thread = threading.Thread(target=work, args=args, daemon=True, name="peer-link")
        with self._lock:
            if self._closed:
                return
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        thread.start()

    def _track(self, sock: _Socket) -> _Socket:
        if sock.type == socket.SOCK_STREAM and sock.family == socket.AF_INET:
            # gloo's messages are small and request-like: Nagle would hold each for an ack.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        with self._lock:
            if self._closed:
                sock.close()
                raise PeerLinkError("the group's links are closed")
            self._sockets.add(sock)
        return sock

    def _accept(self, listener: socket.socket, handle, slots=None) -> None:
        """Hand each connection to ``handle`` on a thread of its own, while ``slots``
        (a semaphore ``handle`` releases) has one for it; close it at once otherwise."""
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # closed
            if slots is not None and not slots.acquire(blocking=False):
                _close(conn)  # a flood: see MAX_HANDSHAKES
                continue
            try:
                self._spawn(handle, self._track(conn))
            except (OSError, PeerLinkError):
                _close(conn)  # closed meanwhile, or the connection already gone

    def _admit(self, raw: socket.socket) -> None:
        """A member's connection: the handshake, then the half it asks for."""
        try:
            verb, kind, ident, tls = self._shake(raw)
        except (OSError, PeerLinkError):
            return  # not TLS, or not the group's, or gone: nothing of it reached a target
        finally:
            self._handshakes.release()
        if verb == _OPEN:
            self._open_here(tls, kind)
        elif verb == _ANSWER:
            self._answer_here(tls, ident)
        else:
            _close(tls)

    def _shake(self, raw: socket.socket) -> tuple[bytes, bytes, bytes, _TlsStream]:
        """The handshake, then what the member asks for; closes ``raw`` on failure."""
        try:
            _keep_alive(raw)
            raw.settimeout(HANDSHAKE_TIMEOUT_S)
            tls = _TlsStream(raw, self._server_tls, server=True)
        except (OSError, PeerLinkError):
            _close(raw)
            raise
        try:
            self._check_peer(tls)
            verb, kind = _read_exact(tls, 1), _read_exact(tls, 1)
            ident = _read_exact(tls, _ID) if verb == _ANSWER else b""
            tls.settimeout(None)
        except (OSError, PeerLinkError):
            _close(tls)
            raise
        return verb, kind, ident, tls

    def _open_here(self, upstream: _TlsStream, kind: bytes) -> None:
        if kind == PULSE:
            self._pulse(upstream)
            return
        if kind == PROBE:
            with contextlib.suppress(OSError):  # the prober gone: nothing to tell
                upstream.sendall(b"+")
            _close(upstream)
            return
        target = self._targets.get(kind)
        try:
            if target is None:
                raise PeerLinkError(f"nothing of kind {kind!r} here")
            local = self._track(socket.create_connection(target))
            ident = secrets.token_bytes(_ID)
            splice = _Splice(local)
            with self._lock:
                self._halves[ident] = splice  # until the member opens the other half
            upstream.sendall(ident)
        except (OSError, PeerLinkError):
            _close(upstream)
            return
        splice.pump(upstream, local)  # the member writes into this half

    def _answer_here(self, downstream: _TlsStream, ident: bytes) -> None:
        with self._lock:
            splice = self._halves.pop(ident, None)
        if splice is None:
            _close(downstream)
            return
        splice.pump(splice.local, downstream)

    def _pulse_to(self, remote: tuple[str, int]) -> None:
        try:
            tls = self._open(remote, _OPEN, PULSE)
        except PeerLinkError:
            return  # the peer is gone already: its links break on their own
        self._pulse(tls)

    def _pulse(self, tls: _TlsStream) -> None:
        """Pulse to the peer and listen for its pulses until the link ends; past
        ``silence_s`` without one, break every link of the group."""
        heard = next_beat = time.monotonic()
        buffer = memoryview(bytearray(64))
        try:
            while True:
                now = time.monotonic()
                if now >= next_beat:
                    tls.sendall(b".")
                    next_beat = now + PULSE_S
                tls.settimeout(max(0.01, next_beat - now))
                try:
                    if not tls.recv_into(buffer):
                        return  # the peer closed its links: it left the group
                    heard = time.monotonic()
                except TimeoutError:
                    if time.monotonic() - heard > self._silence_s:
                        self._sever(f"a peer sent no pulse for {self._silence_s:g} s: it hangs")
                        return
        except OSError:
            return  # this tunnel closed, or the link broke: gloo sees that on its own
        finally:
            _close(tls)

    def _sever(self, why: str) -> None:
        """Break every link of the group (a peer hangs), keeping the listeners: gloo sees
        its connections end, and the group's collectives fail as with a peer gone."""
        with self._lock:
            self.severed = why
            links = [sock for sock in self._sockets if not _is_listening(sock)]
        for sock in links:
            _close(sock)

    def _initiate(self, local: socket.socket, remote: tuple[str, int], kind: bytes) -> None:
        """A local connection into a forwarder: both halves to ``remote``, then pump."""
        try:
            upstream = self._open(remote, _OPEN, kind)
            ident = _read_exact(upstream, _ID)
            downstream = self._open(remote, _ANSWER, kind, ident)
        except (OSError, PeerLinkError):
            _close(local)  # the local side sees the peer as gone
            return
        splice = _Splice(local)
        self._spawn(splice.pump, downstream, local)
        splice.pump(local, upstream)

    def _open(
        self, remote: tuple[str, int], verb: bytes, kind: bytes, ident: bytes = b""
    ) -> _TlsStream:
        try:
            raw = socket.create_connection(remote, timeout=HANDSHAKE_TIMEOUT_S)
        except OSError as exc:
            raise PeerLinkError(f"cannot reach the group's host at {remote}: {exc}") from None
        self._track(raw)
        try:
            _keep_alive(raw)
            tls = _TlsStream(raw, self._client_tls, server=False)
        except ssl.SSLError as exc:
            _close(raw)
            raise PeerLinkError(
                f"the host at {remote[0]}:{remote[1]} is not in this job's group, or "
                f"turned the link away (its TLS handshake failed: {exc.reason})"
            ) from None
        except OSError as exc:
            _close(raw)
            raise PeerLinkError(f"cannot reach the group's host at {remote}: {exc}") from None
        self._check_peer(tls)
        tls.sendall(verb + kind + ident)
        tls.settimeout(None)
        return tls

    def _check_peer(self, tls: _TlsStream) -> None:
        if tls.peer_cert() != self._cert:
            _close(tls)
            raise PeerLinkError("a peer presented another group's certificate")


def _keep_alive(sock: socket.socket) -> None:
    """Probe a link between hosts when idle, and end it when probes or data go
    unanswered (``KEEPALIVE_S``, ``UNACKED_LIMIT_S``)."""
    idle, interval, count = KEEPALIVE_S
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (
        ("TCP_KEEPIDLE", idle),
        ("TCP_KEEPINTVL", interval),
        ("TCP_KEEPCNT", count),
        ("TCP_USER_TIMEOUT", UNACKED_LIMIT_S * 1000),
    ):
        if hasattr(socket, name):  # Linux has them all; others keep what they have
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def _is_listening(sock: socket.socket) -> bool:
    try:
        return bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
    except OSError:
        return False


def _order(address: tuple[str, int]) -> tuple[bytes, int]:
    return socket.inet_aton(address[0]), address[1]


def _read_exact(sock: _Stream, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise PeerLinkError("the peer closed the link during its set-up")
        data += chunk
    return data


class _TlsStream:
    """A TLS connection over ``raw`` through OpenSSL's memory buffers, handshaken.

    On its own socket OpenSSL reads one record (16 KiB) per call, in two system calls,
    and writes one per call: a third of the tunnel's speed went there. Here one system
    call moves up to ``_CHUNK`` bytes of records, and OpenSSL works on memory. Like
    ``ssl``'s sockets, a peer that closes without TLS's close message reads as an end:
    gloo frames its own messages and sees a cut one."""

    def __init__(self, raw: socket.socket, context: ssl.SSLContext, *, server: bool) -> None:
        self.raw = raw
        self._incoming, self._outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._tls = context.wrap_bio(self._incoming, self._outgoing, server_side=server)
        self._spare = memoryview(bytearray(_CHUNK))
        self._handshake()

    def recv_into(self, buffer: memoryview) -> int:
        """Fill ``buffer`` with what has arrived, waiting only while nothing has; 0 at
        the peer's end."""
        size = 0
        while size < len(buffer):
            try:
                got = cast(int, self._tls.read(len(buffer) - size, buffer[size:]))
            except ssl.SSLWantReadError:
                if size or not self._fill():
                    return size
                continue
            except ssl.SSLZeroReturnError:
                return size
            size += got
        return size

    def recv(self, size: int) -> bytes:
        buffer = bytearray(size)
        return bytes(buffer[: self.recv_into(memoryview(buffer))])

    def sendall(self, data: bytes | memoryview) -> None:
        self._tls.write(data)
        self._flush()

    def peer_cert(self) -> bytes | None:
        """The certificate the peer presented, DER-encoded."""
        return self._tls.getpeercert(binary_form=True)

    def settimeout(self, timeout: float | None) -> None:
        self.raw.settimeout(timeout)

    def shutdown(self, how: int) -> None:
        self.raw.shutdown(how)

    def close(self) -> None:
        self.raw.close()

    def _handshake(self) -> None:
        while True:
            try:
                self._tls.do_handshake()
            except ssl.SSLWantReadError:
                self._flush()
                if not self._fill():
                    raise ConnectionAbortedError("the peer left during the TLS handshake") from None
                continue
            except ssl.SSLError:
                with contextlib.suppress(OSError):
                    self._flush()  # the alert that tells the peer why
                raise
            self._flush()  # our Finished
            return

    def _fill(self) -> bool:
        size = self.raw.recv_into(self._spare)
        self._incoming.write(self._spare[:size])
        return size > 0

    def _flush(self) -> None:
        if self._outgoing.pending:
            self.raw.sendall(self._outgoing.read())


class _Splice:
    """One tunnelled connection at one end: its local socket, and the two one-way TLS
    halves that ``pump`` copies it to and from."""

    def __init__(self, local: socket.socket) -> None:
        self.local = local
        self._halves: list[_Stream] = []
        self._running = 2
        self._lock = threading.Lock()

    def pump(self, source: _Stream, sink: _Stream) -> None:
        """Copy ``source`` into ``sink`` to its end. An end passes on as an end (a local
        sink is half-closed); a failure breaks the whole connection, so that gloo sees
        its peer gone. The local socket closes when both directions have ended."""
        half = sink if source is self.local else source
        with self._lock:
            self._halves.append(half)
        buffer = memoryview(bytearray(_CHUNK))
        try:
            while size := source.recv_into(buffer):
                sink.sendall(buffer[:size])
            if sink is self.local:
                sink.shutdown(socket.SHUT_WR)
        except OSError:
            with self._lock:
                broken = [self.local, *self._halves]
            for sock in broken:
                _close(sock)
        finally:
            _close(half)
            with self._lock:
                self._running -= 1
                done = self._running == 0
            if done:
                _close(self.local)


def _close(sock: _Stream) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


# --- the store gloo meets through ----------------------------------------------------


class LinkedStore(dist.Store):
    """A group's store as gloo sees it: the addresses gloo publishes and reads in it
    rewritten to go through ``tunnel`` (see the module's docstring)."""

    def __init__(self, inner: dist.Store, tunnel: Tunnel) -> None:
        super().__init__()
        self._inner = inner
        self._tunnel = tunnel
        self._slot: AddressSlot | None = None
        self._gloo_port = 0

    def set(self, key: str, value: bytes | str) -> None:
        blob = value.encode() if isinstance(value, str) else bytes(value)
        slot, port = find_slot(blob)
        self._slot, self._gloo_port = slot, port
        self._tunnel.expose(GLOO, (GLOO_HOST, port))
        published = slot.write(blob, self._tunnel.host, self._tunnel.port)
        self._inner.set(key, published)  # type: ignore[arg-type]  # c10d takes bytes too

    def get(self, key: str) -> bytes:
        """A peer's blob, naming a local forwarder to its tunnel.

        Of each pair, gloo has the rank whose address orders above the other's connect,
        and the other listen. Each rank here compares its own real address with the
        forwarder's, so the forwarder listens below or above gloo's address as the two
        ranks' published addresses order: both then agree on who connects.
        """
        blob = bytes(self._inner.get(key))
        if self._slot is None:
            raise PeerLinkError("gloo read a peer's address before publishing its own")
        peer = self._slot.read(blob)
        mine = (self._tunnel.host, self._tunnel.port)
        if peer == mine:  # its own: gloo connects to itself too
            return self._slot.write(blob, GLOO_HOST, self._gloo_port)
        on = BELOW_GLOO if _order(peer) < _order(mine) else ABOVE_GLOO
        forward = self._tunnel.forward(peer, GLOO, on)
        return self._slot.write(blob, on, forward)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        if timeout is None:
            self._inner.wait(keys)
        else:
            self._inner.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return self._inner.check(keys)

    def add(self, key: str, value: int) -> int:
        return self._inner.add(key, value)
