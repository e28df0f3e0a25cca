"""The local control channel between a consumer node and the shim in its script.

``cumulus-node --consume -- python train.py`` runs the script in a child process (the
shim attaches the ``cumulus`` device there). The child holds the session; the node holds
the mesh, the market and the ledger. They talk over loopback TCP, one msgpack frame per
message, the child proving itself with a random token the node put in its environment
(other local users can reach loopback too).

Requests, from the shim::

    ["session", token]            -> the lease to use now
    ["failover", token, reason, regroups] -> the host is gone: a lease with another
                                     host (``regroups``, optional: the session's group
                                     goes back with it, so a rank of a job may move)
    ["usage", token, usage]       -> the session's last usage, at its end (answered
                                     ``["ok", None]``); ``usage`` is
                                     ``{"bytes": {lease_id: bytes}, "ops": ops}``
    ["path", token, lease_id, path] -> which path the session channel took (direct, or
                                     the node's libp2p door, and why), for its status;
                                     answered ``["ok", None]``
    ["probe", token, facts]       -> ``["ok", None]`` if the leased device fits its
                                     offer, else ``["ok", why]``: the node has then
                                     leased another host, and ``session`` gives it
    ["watch", token]              -> never answered: the connection stays open while
                                     the node lives (the shim stops the script when it
                                     closes; ``wait_until_node_is_gone``). On it the shim
                                     then sends, every half second,
    ["usage", usage]                 the bytes its session channels carried per lease,
                                     which the node checks receipts against, and the
                                     ops its session sent (for the job's status)

Answers: ``["ok", {"endpoints": ["host:port", ...], "provider_key": bytes, "lease": bytes,
"host": peer_id, ...}]`` or ``["error", message]``.
"""

from __future__ import annotations

import hmac
import os
import secrets
import select
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace

import msgpack
import trio

from .._errors import CumulusError, RemoteProtocolError
from ..channel.transport import SocketFrameChannel, TrioFrameChannel
from ..wire.links import PEER_LINKS

ENV_ADDRESS = "CUMULUS_CONTROL"
ENV_TOKEN = "CUMULUS_CONTROL_TOKEN"
#: The node's pid, so the script can tell it outlived its node before it could watch.
ENV_NODE_PID = "CUMULUS_NODE_PID"
#: Where the script's checkpoints go (``blobs.standby.CheckpointPlacement``'s values).
ENV_CHECKPOINT_TO = "CUMULUS_CHECKPOINT_TO"
CHECKPOINT_PLACES = ("standby", "consumer", "both")
#: The most GiB a shim may ask its node to lease a standby of (an offer's storage_gib bound).
MAX_STANDBY_GIB = 2**20
#: Set when the job's uploads are private (``remote.attach(private=True)``).
ENV_PRIVATE = "CUMULUS_PRIVATE"
MAX_FRAME = 128 * 1024
#: Most pieces one fetch names: one ``have`` question's worth (``blobs.names.MAX_HAVE``).
MAX_FETCH = 1024


def address_for_rank(environ) -> str | None:
    """The control address of this process's rank: ``CUMULUS_CONTROL`` holds one per rank
    of a job of several GPUs (``host:port,host:port``), picked by the ``LOCAL_RANK``
    torchrun gave the process; None when no node started it.

    Raises:
        CumulusError: the rank has no address (the launcher ran more ranks than GPUs).
    """
    addresses = environ.get(ENV_ADDRESS)
    if not (addresses and environ.get(ENV_TOKEN)):
        return None
    address = this_ranks(addresses, environ)
    if address is None:
        raise CumulusError(
            f"this is rank {environ.get('LOCAL_RANK')!r} of a job the node leased "
            f"{len(addresses.split(','))} GPU(s) for: give cumulus-node --gpus as many GPUs "
            "as torchrun --nproc-per-node ranks"
        )
    return address


def this_ranks(listed: str, environ) -> str | None:
    """The entry of ``listed`` (``a,b,...``, one per rank in rank order) for this
    process's ``LOCAL_RANK`` (0 without a launcher); None when the list has none for it."""
    entries = listed.split(",")
    rank = environ.get("LOCAL_RANK", "0")
    return entries[int(rank)] if rank.isdigit() and int(rank) < len(entries) else None


@dataclass(frozen=True, slots=True)
class SessionTicket:
    """Everything the shim needs to open a session with a provider."""

    host: str
    #: The provider's direct session addresses, the likeliest to answer first.
    endpoints: tuple[str, ...]
    provider_key: bytes
    lease: bytes
    #: Where the consumer node carries the session to the provider over libp2p, for
    #: when ``endpoint`` cannot be dialed (``session_proxy``); empty if none.
    door: str = ""
    #: The performance units the host's offer claims (what the probe checks).
    claimed_perf: int = 0
    #: The lease's id (what the shim's byte counts and path reports name).
    lease_id: str = ""

    def to_wire(self) -> dict:
        return {
            "host": self.host,
            "endpoints": list(self.endpoints),
            "provider_key": self.provider_key,
            "lease": self.lease,
            "door": self.door,
            "claimed_perf": self.claimed_perf,
            "lease_id": self.lease_id,
        }

    @classmethod
    def from_wire(cls, value: object) -> SessionTicket:
        if not isinstance(value, dict):
            raise RemoteProtocolError("the node's answer is not a session ticket")
        try:
            endpoints = value["endpoints"]
            ticket = cls(
                value["host"],
                tuple(endpoints) if isinstance(endpoints, list) else endpoints,
                value["provider_key"],
                value["lease"],
                value["door"],
                value["claimed_perf"],
                value["lease_id"],
            )
        except KeyError as exc:
            raise RemoteProtocolError(f"session ticket lacks {exc}") from exc
        if not (
            isinstance(ticket.door, str)
            and isinstance(ticket.endpoints, tuple)
            and all(isinstance(e, str) for e in ticket.endpoints)
            and isinstance(ticket.lease, bytes)
            and isinstance(ticket.provider_key, bytes)
            and isinstance(ticket.host, str)
            and type(ticket.claimed_perf) is int
            and isinstance(ticket.lease_id, str)
        ):
            raise RemoteProtocolError("session ticket fields have the wrong types")
        return ticket


#: What the node does for each request: ``session()`` and ``failover(reason, regroups)``.
SessionSource = Callable[[], Awaitable[SessionTicket]]
FailoverSource = Callable[[str, bool], Awaitable[SessionTicket]]
#: Has the session's host fetch blobs from other hosts: what it fetched.
FetchSource = Callable[[list[str]], Awaitable[dict]]
#: Leases the standby (again, when given why the last one was lost): its ticket, or
#: None and why not.
StandbySource = Callable[[str], Awaitable[tuple[SessionTicket | None, str]]]
#: The node's verdict on probe facts (a wire map): ``None`` if they fit the offer.
ProbeJudge = Callable[[object], Awaitable[str | None]]
#: Where the shim's session paths go: ``(lease_id, path)``.
PathSink = Callable[[str, str], None]


@dataclass(frozen=True)
class Usage:
    """What the script's session has done: bytes its channels carried per lease, and
    bytes its collectives had the hosts carry between themselves per lease (what the
    node checks receipts against); and ops it sent, over every host (for status)."""

    bytes_by_lease: dict[str, int]
    ops: int = 0
    #: The transfer under way, once it has run long enough to report its progress.
    transfer: Transfer | None = None
    #: Leases whose collectives moved bytes between hosts, and how many (on the wire
    #: only when there are some).
    peer_bytes_by_lease: dict[str, int] = field(default_factory=dict)
    #: Whether the job's collectives go through the consumer's machine, not between its
    #: hosts (a host takes no links from other hosts): on the wire only when they do.
    through_consumer: bool = False
    #: How the job's hosts link to each other, once its group has formed: "tls" or
    #: "plain" (on the wire only then).
    peer_links: str = ""
    #: The session's last counts: the shim sent them as its script ended. Said by the
    #: message that carries them, not on the wire.
    final: bool = False

    def to_wire(self) -> dict:
        wire: dict = {"bytes": self.bytes_by_lease, "ops": self.ops}
        if self.transfer is not None:
            wire["transfer"] = self.transfer.to_wire()
        if self.peer_bytes_by_lease:
            wire["peer"] = self.peer_bytes_by_lease
        if self.through_consumer:
            wire["through"] = True
        if self.peer_links:
            wire["links"] = self.peer_links
        return wire

    @classmethod
    def from_wire(cls, value: object) -> Usage:
        """Raises RemoteProtocolError: not a usage report of non-negative counts."""
        fields = {"bytes", "ops"}
        if not (isinstance(value, dict) and fields <= set(value) <= fields | _OPTIONAL):
            raise RemoteProtocolError(
                'a usage report is {"bytes": {lease: n}, "ops": n'
                '[, "transfer": {...}][, "peer": {lease: n}][, "through": true]'
                '[, "links": "tls" or "plain"]}'
            )
        counts, ops, peer = value["bytes"], value["ops"], value.get("peer", {})
        if not (_counts_by_lease(counts) and _counts_by_lease(peer)):
            raise RemoteProtocolError("a usage report maps lease ids to byte counts")
        if not _count(ops):
            raise RemoteProtocolError("a usage report's op count is a non-negative integer")
        if value.get("through", False) not in (True, False):
            raise RemoteProtocolError("a usage report's 'through' is true or false")
        links = value.get("links", "")
        if links not in ("", *PEER_LINKS):
            raise RemoteProtocolError("a usage report's 'links' is 'tls' or 'plain'")
        transfer = value.get("transfer")
        moving = None if transfer is None else Transfer.from_wire(transfer)
        through = value.get("through", False)
        return cls(counts, ops, moving, peer, through_consumer=through, peer_links=links)


#: What a usage report may carry besides its byte and op counts.
_OPTIONAL = {"transfer", "peer", "through", "links"}


def _counts_by_lease(value: object) -> bool:
    return isinstance(value, dict) and all(
        isinstance(k, str) and _count(v) for k, v in value.items()
    )


@dataclass(frozen=True, slots=True)
class Transfer:
    """How far the session's current long transfer has come (an upload, a checkpoint...)."""

    what: str
    done: int
    total: int
    seconds: float

    def to_wire(self) -> dict:
        return {"what": self.what, "done": self.done, "total": self.total, "s": self.seconds}

    @classmethod
    def from_wire(cls, value: object) -> Transfer:
        """Raises RemoteProtocolError: not a transfer's progress."""
        ok = isinstance(value, dict) and set(value) == {"what", "done", "total", "s"}
        if not ok or not (isinstance(value["what"], str) and len(value["what"]) <= 32):
            raise RemoteProtocolError(
                'a transfer is {"what": str, "done": n, "total": n, "s": seconds}'
            )
        seconds = value["s"]
        counts = _count(value["done"]) and _count(value["total"])
        if not counts or not isinstance(seconds, int | float) or not seconds >= 0:
            raise RemoteProtocolError("a transfer counts bytes and seconds, none negative")
        return cls(value["what"], value["done"], value["total"], float(seconds))


def _count(value: object) -> bool:
    return type(value) is int and value >= 0


#: Where the shim's usage reports go.
UsageSink = Callable[[Usage], None]
#: How often the shim reports its byte counts.
USAGE_EVERY_S = 0.5


def new_token() -> str:
    """A fresh secret for one child process."""
    return secrets.token_hex(16)


async def serve_control(
    token: str,
    session: SessionSource,
    failover: FailoverSource,
    *,
    usage: UsageSink = lambda counts: None,
    probe: ProbeJudge | None = None,
    path: PathSink = lambda lease_id, path: None,
    standby: StandbySource | None = None,
    fetch: FetchSource | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve control requests on loopback forever; reports ``"127.0.0.1:port"``.
    ``standby`` leases (once) the host that keeps the session's checkpoints: it returns
    the ticket, or None and why not. ``fetch`` has the session's host fetch blobs from
    other hosts (``blobshare``)."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]

    async def handle(stream: trio.SocketStream) -> None:
        channel = TrioFrameChannel(stream, max_frame=MAX_FRAME)
        try:
            while True:
                request = msgpack.unpackb(await channel.receive_frame(), raw=False)
                if request == ["watch", token]:
                    await _take_usage(channel, usage)  # open until this node's process ends
                answer = await _answer(
                    request, token, session, failover, usage, probe, path, standby, fetch
                )
                await channel.send_frame([msgpack.packb(answer)])
        except (CumulusError, trio.BrokenResourceError, ValueError, msgpack.UnpackException):
            pass  # the child went away or spoke nonsense: this connection only ends
        finally:
            await channel.aclose()

    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, handle, listeners)
        task_status.started(f"127.0.0.1:{port}")


async def _take_usage(channel: TrioFrameChannel, usage: UsageSink) -> None:
    while True:
        report = msgpack.unpackb(await channel.receive_frame(), raw=False)
        if not (isinstance(report, list) and len(report) == 2 and report[0] == "usage"):
            raise RemoteProtocolError("a watch carries only usage reports")
        usage(Usage.from_wire(report[1]))


def _failover_arguments(request: list) -> bool:
    """``["failover", token, reason]``, or with ``regroups`` (a bool) after it."""
    if len(request) == 4 and not isinstance(request[3], bool):
        return False
    return len(request) in (3, 4) and isinstance(request[2], str)


async def _answer(
    request: object,
    token: str,
    session: SessionSource,
    failover: FailoverSource,
    usage: UsageSink,
    probe: ProbeJudge | None,
    path: PathSink,
    standby: StandbySource | None,
    fetch: FetchSource | None,
) -> list:
    if not (isinstance(request, list) and len(request) >= 2 and isinstance(request[1], str)):
        return ["error", "malformed control request"]
    if not hmac.compare_digest(request[1], token):
        return ["error", "wrong control token"]
    try:
        if request[0] == "session" and len(request) == 2:
            return ["ok", (await session()).to_wire()]
        if request[0] == "failover" and _failover_arguments(request):
            regroups = len(request) == 4 and request[3] is True
            return ["ok", (await failover(request[2], regroups)).to_wire()]
        if request[0] == "usage" and len(request) == 3:
            usage(replace(Usage.from_wire(request[2]), final=True))
            return ["ok", None]
        if (
            request[0] == "path"
            and len(request) == 4
            and all(isinstance(x, str) for x in request[2:])
        ):
            path(request[2], request[3][:500])
            return ["ok", None]
        if request[0] == "probe" and len(request) == 3 and probe is not None:
            return ["ok", await probe(request[2])]
        if request[0] == "fetch" and len(request) == 3 and _digests(request[2]):
            if fetch is None:
                return ["error", "this node fetches no blobs"]
            return ["ok", await fetch(request[2])]
        if request[0] == "standby" and _standby_request(request):
            if standby is None:
                return ["none", "this node keeps no standbys"]
            ticket, why = await standby(request[2][:500], request[3])
            return ["none", why] if ticket is None else ["ok", ticket.to_wire()]
    except CumulusError as exc:
        return ["error", str(exc)]
    return ["error", f"unknown control request {request[0]!r}"]


def _standby_request(request: list) -> bool:
    """``["standby", token, lost, gib]``: why the last is gone, and the GiB the next must
    lend (0: as many as the node's ``--standby-gib``)."""
    return (
        len(request) == 4
        and isinstance(request[2], str)
        and type(request[3]) is int
        and 0 <= request[3] <= MAX_STANDBY_GIB
    )


def _digests(value: object) -> bool:
    # Checked as digests by the host that fetches them.
    return (
        isinstance(value, list)
        and len(value) <= MAX_FETCH
        and all(isinstance(v, str) and len(v) == 64 for v in value)
    )


def wait_until_node_is_gone(
    address: str, token: str, usage: Callable[[], Usage] = lambda: Usage({})
) -> str:
    """Block until the node serving ``address`` is gone; return how that showed. Meanwhile
    report ``usage()`` to it every ``USAGE_EVERY_S``.

    Meant for a daemon thread in the script's process: the node holds this connection
    open for as long as it runs, and the kernel closes it when the node dies, however.
    """
    host, _, port = address.rpartition(":")
    try:
        channel = SocketFrameChannel.connect(host, int(port), max_frame=MAX_FRAME)
        channel.send_frame([msgpack.packb(["watch", token])])
        while not select.select([channel], [], [], USAGE_EVERY_S)[0]:
            channel.send_frame([msgpack.packb(["usage", usage().to_wire()])])
        channel.recv_frame()
    except (OSError, CumulusError) as exc:
        return f"its control channel closed ({exc})"
    return "it answered a watch, which it never does"


def report_usage(address: str, token: str, usage: Usage) -> None:
    """Give the node serving ``address`` this process's final usage.

    Raises:
        OSError, CumulusError: the node is gone or refused them.
    """
    host, _, port = address.rpartition(":")
    channel = SocketFrameChannel.connect(host, int(port), max_frame=MAX_FRAME)
    try:
        channel.send_frame([msgpack.packb(["usage", token, usage.to_wire()])])
        answer = msgpack.unpackb(channel.recv_frame(), raw=False)
    finally:
        channel.close()
    if answer != ["ok", None]:
        raise CumulusError(f"the cumulus node refused the usage report: {answer!r}")


class ControlClient:
    """The shim's end (blocking): ask the node for a session, or for a new host."""

    def __init__(self, address: str, token: str) -> None:
        host, _, port = address.rpartition(":")
        self._channel = SocketFrameChannel.connect(host, int(port), max_frame=MAX_FRAME)
        self._token = token

    @classmethod
    def from_environment(cls) -> ControlClient | None:
        """The client for the node that started this process, if one did."""
        address = address_for_rank(os.environ)
        return None if address is None else cls(address, os.environ[ENV_TOKEN])

    def session(self) -> SessionTicket:
        """The lease to use now."""
        return self._ask(["session", self._token])

    def failover(self, reason: str, *, regroups: bool = False) -> SessionTicket:
        """Report the host gone and get a lease with another one (may take a while).
        ``regroups``: the session's collective group goes back with it, so a rank of a
        job of several GPUs may move."""
        return self._ask(["failover", self._token, reason[:500], regroups])

    def standby(self, lost: str = "", gib: int = 0) -> tuple[SessionTicket | None, str]:
        """The lease of the host that keeps the session's checkpoints; or None, and why
        the node has none (the consumer's disk keeps them). ``lost``: why the last one is
        gone; the node leases another, of ``gib`` GiB when the checkpoint outgrew the
        last (it ends that lease without blame)."""
        self._channel.send_frame([msgpack.packb(["standby", self._token, lost, gib])])
        answer = msgpack.unpackb(self._channel.recv_frame(), raw=False)
        if isinstance(answer, list) and len(answer) == 2 and answer[0] == "none":
            return None, str(answer[1])
        return self._ticket_in(answer), ""

    def fetch(self, names: list[str]) -> dict:
        """Have the session's host fetch these blobs from other hosts that announce them
        (``blobshare``); what it fetched (``{"pieces", "bytes", "dropped"}``).

        Raises:
            CumulusError: the node or the host could not.
        """
        self._channel.send_frame([msgpack.packb(["fetch", self._token, names])])
        answer = msgpack.unpackb(self._channel.recv_frame(), raw=False)
        if isinstance(answer, list) and len(answer) == 2 and answer[0] == "ok":
            return answer[1]
        raise CumulusError(f"the cumulus node could not fetch: {answer!r}"[:300])

    def report_path(self, ticket: SessionTicket, path: str) -> None:
        """Tell the node which path the session channel for ``ticket``'s lease took."""
        report = ["path", self._token, ticket.lease_id, path[:500]]
        self._channel.send_frame([msgpack.packb(report)])
        answer = msgpack.unpackb(self._channel.recv_frame(), raw=False)
        if answer != ["ok", None]:
            raise CumulusError(f"the cumulus node refused the session path: {answer!r}")

    def probe(self, facts: dict) -> str | None:
        """Give the node what the probe measured; return why the host misrepresents its
        device (the node has then leased another one), or ``None`` if it fits."""
        self._channel.send_frame([msgpack.packb(["probe", self._token, facts])])
        answer = msgpack.unpackb(self._channel.recv_frame(), raw=False)
        if isinstance(answer, list) and len(answer) == 2 and answer[0] == "ok":
            if answer[1] is None or isinstance(answer[1], str):
                return answer[1]
        if isinstance(answer, list) and len(answer) == 2 and answer[0] == "error":
            raise CumulusError(f"the cumulus node could not judge the probe: {answer[1]}")
        raise RemoteProtocolError("malformed answer from the cumulus node")

    def _ask(self, request: list) -> SessionTicket:
        self._channel.send_frame([msgpack.packb(request)])
        return self._ticket_in(msgpack.unpackb(self._channel.recv_frame(), raw=False))

    @staticmethod
    def _ticket_in(answer: object) -> SessionTicket:
        if isinstance(answer, list) and len(answer) == 2 and answer[0] == "ok":
            return SessionTicket.from_wire(answer[1])
        if isinstance(answer, list) and len(answer) == 2 and answer[0] == "error":
            raise CumulusError(f"the cumulus node could not provide a session: {answer[1]}")
        raise RemoteProtocolError("malformed answer from the cumulus node")

    def close(self) -> None:
        self._channel.close()
