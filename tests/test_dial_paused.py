"""Dialling a leased host whose lease is paused for an overdue receipt: the dial waits
for the receipt to be paid and the lease to run again, and only a pause that outlasts
its patience is an error. Any other refusal stands at once.

A real secure-channel server on loopback stands for the host; its ``authorize`` says
what the provider says of a paused lease (``Provider.authorize``).
"""

from __future__ import annotations

from contextlib import asynccontextmanager

import pytest
import trio

from cumulus_p2p._errors import SessionRefusedError
from cumulus_p2p.channel.secure import serve_secure
from cumulus_p2p.identity import NodeIdentity
from cumulus_p2p.market.lease_state import LeaseState
from cumulus_p2p.node import dial
from cumulus_p2p.node.control import SessionTicket

HOST, CONSUMER = NodeIdentity.generate(), NodeIdentity.generate()
PAUSED = "the lease is paused: 1 receipt(s) unsettled, the oldest for 3 s"


class Host:
    """Refuses with ``why`` until ``paid`` is set; then echoes one frame per session."""

    def __init__(self, why: str) -> None:
        self.why, self.paid, self.refused = why, False, 0

    def authorize(self, key: bytes, lease: bytes | None) -> str | None:
        if self.paid:
            return None
        self.refused += 1
        return self.why

    async def echo(self, channel) -> None:
        await channel.send_frame([await channel.receive_frame()])


class Node:
    """The consumer node's side of the dial: it only hears which path was taken."""

    def report_path(self, ticket: SessionTicket, path: str) -> None:
        self.path = path


@asynccontextmanager
async def serving(host: Host):
    async with trio.open_nursery() as nursery:
        server = await nursery.start(
            lambda task_status: serve_secure(
                HOST, authorize=host.authorize, handler=host.echo, task_status=task_status
            )
        )
        yield SessionTicket(
            HOST.peer_id_text, (f"127.0.0.1:{server.port}",), HOST.public_key, b"lease"
        )
        nursery.cancel_scope.cancel()


def dial_and_echo(ticket: SessionTicket) -> bytes:
    channel = dial.dial_leased(Node(), ticket, CONSUMER, resume_timeout=1.0)
    try:
        channel.send_frame([b"resumed"])
        return channel.recv_frame()
    finally:
        channel.close()


async def test_a_dial_refused_while_the_lease_is_paused_goes_through_once_it_is_paid():
    host = Host(PAUSED)
    async with serving(host) as ticket:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pay_after, host, 1.2)
            with trio.fail_after(20):
                echoed = await trio.to_thread.run_sync(dial_and_echo, ticket)
    assert echoed == b"resumed"
    assert host.refused >= 2


async def test_a_pause_longer_than_the_patience_is_refused(monkeypatch):
    monkeypatch.setattr(dial, "PAUSED_PATIENCE_S", 1.0)
    host = Host(PAUSED)
    async with serving(host) as ticket:
        with pytest.raises(SessionRefusedError, match="the lease is paused"):
            with trio.fail_after(20):
                await trio.to_thread.run_sync(dial_and_echo, ticket)
    assert host.refused >= 2


async def test_any_other_refusal_stands_at_once():
    host = Host("the lease has ended or was never granted by this host")
    async with serving(host) as ticket:
        with pytest.raises(SessionRefusedError, match="the lease has ended"):
            with trio.fail_after(20):
                await trio.to_thread.run_sync(dial_and_echo, ticket)
    assert host.refused == 1


def test_the_refusal_awaited_is_the_one_a_host_gives_a_paused_lease():
    assert dial.PAUSED_REFUSAL == f"the lease is {LeaseState.PAUSED.value}"


async def pay_after(host: Host, seconds: float) -> None:
    await trio.sleep(seconds)
    host.paid = True
