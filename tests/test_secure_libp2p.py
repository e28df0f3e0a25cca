"""The fallback path: the secure channel over a Noise+yamux libp2p stream (loopback)."""

from __future__ import annotations

import os
from contextlib import asynccontextmanager

import pytest
import trio

from cumulus_p2p._errors import SessionClosedError, SessionRefusedError
from cumulus_p2p.channel.secure.libp2p_path import connect_secure_libp2p, serve_secure_libp2p
from cumulus_p2p.identity import NodeIdentity

PROVIDER = NodeIdentity.generate()
CONSUMER = NodeIdentity.generate()


async def echo(channel) -> None:
    try:
        while True:
            await channel.send_frame([await channel.receive_frame()])
    except SessionClosedError:
        pass


@asynccontextmanager
async def libp2p_provider(authorize=lambda key, lease: None):
    async with trio.open_nursery() as nursery:
        addr = await nursery.start(
            lambda task_status: serve_secure_libp2p(
                PROVIDER, authorize=authorize, handler=echo, task_status=task_status
            )
        )
        yield addr
        nursery.cancel_scope.cancel()


def connect(addr, **kw):
    return connect_secure_libp2p(
        addr, identity=CONSUMER, expected_peer_public_key=PROVIDER.public_key, **kw
    )


async def test_frames_cross_a_libp2p_stream_and_survive_a_stream_reset():
    async with libp2p_provider() as addr:

        def consumer():
            with connect(addr) as ch:
                blob = os.urandom(1_200_000)
                ch.send_frame([b"head", blob])
                assert ch.recv_frame() == b"head" + blob
                ch._link.shutdown()  # the stream dies under the channel
                ch.send_frame([b"after the reset"])
                assert ch.recv_frame() == b"after the reset"
                return ch.resumes

        with trio.fail_after(30):
            assert await trio.to_thread.run_sync(consumer) == 1


async def test_libp2p_consumer_without_lease_is_refused_with_the_reason():
    async with libp2p_provider(authorize=lambda key, lease: "lease required") as addr:
        with trio.fail_after(30), pytest.raises(SessionRefusedError, match="lease required"):
            await trio.to_thread.run_sync(connect, addr)
