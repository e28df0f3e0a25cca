"""A worker process owns its consumer's connection: the supervisor hands it over.

The supervisor runs in this process with real CPU worker processes; consumers are real
clients (plain TCP or the secure channel) in threads of this test.
"""

from __future__ import annotations

import os
import socket
from contextlib import asynccontextmanager

import pytest
import torch
import trio

import cumulus_p2p.remote as remote
from cumulus_p2p._errors import SessionClosedError
from cumulus_p2p.channel.secure import connect_secure
from cumulus_p2p.channel.secure.server import open_secure_server
from cumulus_p2p.channel.transport import CountingChannel, SocketFrameChannel
from cumulus_p2p.host.executor import ExecutorConfig
from cumulus_p2p.host.supervisor import MAX_FIRST_FRAME, SupervisorConfig, WorkerSupervisor
from cumulus_p2p.identity import NodeIdentity
from cumulus_p2p.wire.protocol import PROTOCOL_VERSION, decode_frame, encode_frame

# Starts supervisors and their worker processes: scripts/test --fast skips it.
pytestmark = pytest.mark.slow

PROVIDER = NodeIdentity.generate()
CONSUMER = NodeIdentity.generate()


@asynccontextmanager
async def plain_supervisor():
    sup = WorkerSupervisor(SupervisorConfig(ExecutorConfig(device="cpu"), pool=1))
    async with trio.open_nursery() as nursery:
        port = await nursery.start(sup.serve_tcp, "127.0.0.1", 0)
        yield sup, port
        nursery.cancel_scope.cancel()


class NoSocket(trio.abc.Stream):
    """A TCP stream that hides its socket, as a libp2p stream has none to hand over."""

    def __init__(self, inner: trio.SocketStream) -> None:
        self._inner = inner

    async def send_all(self, data) -> None:
        await self._inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self._inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes=None) -> bytes:
        return await self._inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self._inner.aclose()


@asynccontextmanager
async def secure_supervisor(*, wrap=None, hide_sockets: bool = False):
    """A supervisor behind the secure channel; ``wrap(channel)`` sees each session's
    channel first and returns the one to serve (as the provider meters it)."""
    sup = WorkerSupervisor(SupervisorConfig(ExecutorConfig(device="cpu"), pool=1))

    async def handler(channel) -> None:
        await sup.run_session(wrap(channel) if wrap else channel)

    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        async with open_secure_server(PROVIDER, authorize=lambda *_: None, handler=handler) as srv:
            (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
            nursery.start_soon(accept, listener, srv, hide_sockets)
            yield sup, listener.socket.getsockname()[1]
        nursery.cancel_scope.cancel()


async def accept(listener: trio.SocketListener, server, hide_sockets: bool) -> None:
    # The server keeps each stream it takes (trio.serve_listeners would close it).
    async with trio.open_nursery() as nursery:
        while True:
            stream = await listener.accept()
            nursery.start_soon(server.handle_stream, NoSocket(stream) if hide_sockets else stream)


def connect(port: int):
    return connect_secure(
        "127.0.0.1", port, identity=CONSUMER, expected_peer_public_key=PROVIDER.public_key
    )


async def in_thread(fn, *args):
    with trio.fail_after(60):
        return await trio.to_thread.run_sync(fn, *args)


def established_on(port: int) -> set[str]:
    """Inodes of the ESTABLISHED TCP sockets whose local port is ``port``."""
    with open("/proc/net/tcp") as table:
        rows = [line.split() for line in table.readlines()[1:]]
    return {r[9] for r in rows if int(r[1].split(":")[1], 16) == port and r[3] == "01"}


def socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue  # closed while listing
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def drop_connection(channel) -> None:
    channel._link.sock.shutdown(socket.SHUT_RDWR)


# --- the connection is the worker's -----------------------------------------------------------


async def test_the_worker_holds_the_consumers_connection_and_the_supervisor_does_not():
    async with plain_supervisor() as (sup, port):

        def consumer() -> tuple[set[str], set[str], set[str]]:
            with remote.attach(f"127.0.0.1:{port}") as session:
                assert torch.ones(3, device="cumulus").sum().item() == 3
                worker = session.info["worker_pid"]
                return established_on(port), socket_inodes(worker), socket_inodes(os.getpid())

        (accepted,), in_worker, here = await in_thread(consumer)
        assert accepted in in_worker
        assert accepted not in here


async def test_a_secure_session_runs_in_its_worker_and_resumes_there_after_a_drop():
    async with secure_supervisor() as (sup, port):

        def consumer() -> tuple[int, int, int]:
            channel = connect(port)
            with remote.attach(channel=channel) as session:
                x = torch.arange(4.0, device="cumulus")
                assert x.sum().item() == 6
                drop_connection(channel)
                assert (x * 2).sum().item() == 12  # the tensor lived on in the worker
                (worker,) = {v.worker_pid for v in sup.sessions.values()}
                return channel.resumes, session.info["worker_pid"], worker

        resumes, pid, worker = await in_thread(consumer)
        assert resumes == 1
        assert pid == worker != os.getpid()


async def test_a_session_over_a_stream_without_a_socket_is_bridged_to_its_worker():
    async with secure_supervisor(hide_sockets=True) as (sup, port):

        def consumer() -> int:
            channel = connect(port)
            with remote.attach(channel=channel):
                x = torch.arange(4.0, device="cumulus")
                assert x.sum().item() == 6
                drop_connection(channel)
                assert (x * 2).sum().item() == 12
                return channel.resumes

        assert await in_thread(consumer) == 1


async def test_closing_a_handed_over_session_reaches_its_consumer_with_the_reason():
    channels = []

    def remember(channel):
        channels.append(channel)
        return channel

    async with secure_supervisor(wrap=remember) as (sup, port):
        closed = trio.Event()

        def consumer(token: trio.lowlevel.TrioToken) -> None:
            with remote.attach(channel=connect(port)):
                x = torch.ones(2, device="cumulus")
                assert x.sum().item() == 2
                trio.from_thread.run_sync(closed.set, trio_token=token)
                trio.from_thread.run(trio.sleep, 0.5, trio_token=token)
                with pytest.raises(SessionClosedError, match="the lease was paused"):
                    (x * 2).sum().item()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(in_thread, consumer, trio.lowlevel.current_trio_token())
            await closed.wait()
            await channels[0].aclose("the lease was paused")


async def test_the_bytes_a_worker_carries_are_metered_where_the_session_came_in():
    counted = []
    async with secure_supervisor(wrap=lambda ch: CountingChannel(ch, counted.append)) as (
        sup,
        port,
    ):

        def consumer() -> None:
            with remote.attach(channel=connect(port)):
                x = torch.rand(256, 1024).to("cumulus")  # 1 MiB up
                assert x.cpu().shape == (256, 1024)  # and 1 MiB back

        await in_thread(consumer)
        with trio.fail_after(10):
            while sup.sessions:  # the worker reports its last bytes as the session ends
                await trio.sleep(0.05)
    assert sum(counted) > 2 * 2**20


# --- bad input ----------------------------------------------------------------------------------


def raw_session(port: int) -> SocketFrameChannel:
    return SocketFrameChannel.connect("127.0.0.1", port)


async def test_a_first_message_too_large_for_a_hello_is_refused_with_a_clear_error():
    async with plain_supervisor() as (sup, port):

        def consumer() -> list:
            channel = raw_session(port)
            padding = "x" * (MAX_FIRST_FRAME + 1)
            channel.send_frame(encode_frame(["hello", PROTOCOL_VERSION, {"pad": padding}]))
            header, _ = decode_frame(channel.recv_frame())
            channel.close()
            return header

        header = await in_thread(consumer)
        assert header[0] == "fatal"
        assert f"at most {MAX_FIRST_FRAME} bytes" in header[1]
