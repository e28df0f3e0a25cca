"""The session ticket the consumer node hands the shim, and how the shim dials it."""

from __future__ import annotations

import functools

import msgpack
import pytest
import trio

from cumulus_p2p._errors import (
    CumulusError,
    PeerUnreachableError,
    RemoteProtocolError,
    SessionClosedError,
)
from cumulus_p2p.channel.transport import SocketFrameChannel
from cumulus_p2p.identity import NodeIdentity
from cumulus_p2p.node import control
from cumulus_p2p.node.control import SessionTicket
from cumulus_p2p.node.dial import open_channel

TICKET = SessionTicket(
    "12D3KooWhost",
    ("127.0.0.1:7001", "127.0.0.2:7001"),
    b"k" * 32,
    b"lease",
    "127.0.0.1:7002",
    100,
)


def test_a_ticket_round_trips_through_its_wire_form() -> None:
    assert SessionTicket.from_wire(TICKET.to_wire()) == TICKET


@pytest.mark.parametrize(
    "field, value",
    [
        ("door", 7),
        ("endpoints", None),
        ("endpoints", [7]),
        ("claimed_perf", "fast"),
        ("provider_key", "not bytes"),
    ],
)
def test_a_ticket_with_a_field_of_the_wrong_type_is_refused(field, value) -> None:
    wire = TICKET.to_wire() | {field: value}
    with pytest.raises(RemoteProtocolError, match="wrong types"):
        SessionTicket.from_wire(wire)


def test_a_ticket_missing_a_field_is_refused_naming_it() -> None:
    wire = TICKET.to_wire()
    del wire["door"]
    with pytest.raises(RemoteProtocolError, match="door"):
        SessionTicket.from_wire(wire)


def test_a_provider_reachable_on_no_path_is_reported_with_each_path_tried() -> None:
    ticket = SessionTicket(
        "12D3KooWhost", ("127.0.0.9:1", "127.0.0.9:3"), b"k" * 32, b"lease", "127.0.0.9:2"
    )
    with pytest.raises(PeerUnreachableError) as caught:
        open_channel(ticket, NodeIdentity.generate(), resume_timeout=1.0)
    assert all(f"127.0.0.9:{port}" in str(caught.value) for port in (1, 2, 3))


# --- the control server: what the shim reports, and what it may not ------------------------


class Node:
    """The node's side of the control channel, recording what the shim reported."""

    def __init__(self) -> None:
        self.counts: list[dict] = []
        self.paths: list[tuple[str, str]] = []

    async def session(self):
        return TICKET

    async def failover(self, reason):
        return TICKET

    async def probe(self, facts):
        if not isinstance(facts, dict):
            raise CumulusError("malformed probe facts")
        return None


async def serve(node: Node, nursery) -> str:
    return await nursery.start(
        functools.partial(
            control.serve_control,
            "t" * 32,
            node.session,
            node.failover,
            usage=node.counts.append,
            probe=node.probe,
            path=lambda *p: node.paths.append(p),
        )
    )


def ask(address: str, request: list) -> object:
    host, _, port = address.rpartition(":")
    channel = SocketFrameChannel.connect(host, int(port))
    try:
        channel.send_frame([msgpack.packb(request)])
        return msgpack.unpackb(channel.recv_frame(), raw=False)
    finally:
        channel.close()


async def test_a_transfer_under_way_reaches_the_node_with_the_counts():
    node = Node()
    transfer = {"what": "checkpoint", "done": 5, "total": 10, "s": 2.5}
    async with trio.open_nursery() as nursery:
        address = await serve(node, nursery)
        report = {"bytes": {"L1": 1}, "ops": 2, "transfer": transfer}
        assert await trio.to_thread.run_sync(ask, address, ["usage", "t" * 32, report]) == [
            "ok",
            None,
        ]
        nursery.cancel_scope.cancel()
    moving = control.Transfer("checkpoint", 5, 10, 2.5)
    assert node.counts == [control.Usage({"L1": 1}, ops=2, transfer=moving, final=True)]


async def test_the_shims_final_counts_reach_the_node_marked_final_and_its_path_too():
    node = Node()
    async with trio.open_nursery() as nursery:
        address = await serve(node, nursery)
        assert await trio.to_thread.run_sync(
            ask, address, ["usage", "t" * 32, {"bytes": {"L1": 4096}, "ops": 12}]
        ) == ["ok", None]
        assert await trio.to_thread.run_sync(
            ask, address, ["path", "t" * 32, "L1", "direct to 10.0.0.1:7000"]
        ) == ["ok", None]
        nursery.cancel_scope.cancel()
    assert node.counts == [control.Usage({"L1": 4096}, ops=12, final=True)]
    assert node.paths == [("L1", "direct to 10.0.0.1:7000")]


def test_a_usage_report_carries_the_bytes_between_hosts_only_when_there_are_some():
    quiet = control.Usage({"L1": 10}, ops=3)
    collective = control.Usage({"L1": 10}, ops=3, peer_bytes_by_lease={"L1": 8_388_608})
    assert "peer" not in quiet.to_wire()
    assert control.Usage.from_wire(collective.to_wire()) == collective


def test_a_usage_report_says_the_collectives_go_through_the_consumer_only_when_they_do():
    through = control.Usage({"L1": 10}, ops=3, through_consumer=True)
    assert "through" not in control.Usage({"L1": 10}, ops=3).to_wire()
    assert control.Usage.from_wire(through.to_wire()) == through


def test_a_usage_report_says_how_the_hosts_link_once_the_group_has_formed():
    linked = control.Usage({"L1": 10}, ops=3, peer_links="plain")
    assert "links" not in control.Usage({"L1": 10}, ops=3).to_wire()
    assert control.Usage.from_wire(linked.to_wire()) == linked


@pytest.mark.parametrize(
    "request_",
    [
        ["usage", "t" * 32, {"bytes": {"L1": -1}, "ops": 0}],
        ["usage", "t" * 32, {"bytes": {"L1": "lots"}, "ops": 0}],
        ["usage", "t" * 32, {"bytes": {"L1": 1}, "ops": -3}],
        ["usage", "t" * 32, {"bytes": {"L1": 1}, "ops": 1.5}],
        ["usage", "t" * 32, {"L1": 1}],
        ["usage", "t" * 32, 7],
        ["usage", "t" * 32, {"bytes": {}, "ops": 0, "transfer": {"what": "upload"}}],
        [
            "usage",
            "t" * 32,
            {"bytes": {}, "ops": 0, "transfer": {"what": "x", "done": -1, "total": 9, "s": 1}},
        ],
        ["usage", "t" * 32, {"bytes": {}, "ops": 0, "peer": {"L1": -8}}],
        ["usage", "t" * 32, {"bytes": {}, "ops": 0, "peer": [["L1", 8]]}],
        ["usage", "t" * 32, {"bytes": {}, "ops": 0, "through": "yes"}],
        ["usage", "t" * 32, {"bytes": {}, "ops": 0, "links": "carrier pigeon"}],
        ["path", "t" * 32, "L1", 5],
        ["probe", "t" * 32, "fast"],
        ["usage", "x" * 32, {"bytes": {"L1": 1}, "ops": 0}],
    ],
    ids=[
        "negative-bytes",
        "not-int-bytes",
        "negative-ops",
        "fractional-ops",
        "bare-byte-map",
        "not-a-map",
        "transfer-missing-fields",
        "transfer-negative",
        "negative-peer-bytes",
        "peer-bytes-not-a-map",
        "through-not-a-bool",
        "unknown-links",
        "path-not-text",
        "probe-not-facts",
        "bad-token",
    ],
)
async def test_a_malformed_report_is_refused_and_records_nothing(request_):
    node = Node()
    async with trio.open_nursery() as nursery:
        address = await serve(node, nursery)
        answer = await trio.to_thread.run_sync(ask, address, request_)
        nursery.cancel_scope.cancel()
    assert answer[0] == "error"
    assert node.counts == [] and node.paths == []


async def test_a_watch_carrying_anything_but_usage_reports_is_dropped():
    node = Node()
    async with trio.open_nursery() as nursery:
        address = await serve(node, nursery)

        def watch_then_misbehave() -> bool:
            host, _, port = address.rpartition(":")
            channel = SocketFrameChannel.connect(host, int(port))
            channel.send_frame([msgpack.packb(["watch", "t" * 32])])
            channel.send_frame([msgpack.packb(["usage", {"bytes": {"L1": 10}, "ops": 3}])])
            channel.send_frame([msgpack.packb(["session", "t" * 32])])
            try:
                channel.recv_frame()
            except SessionClosedError:
                return True  # the node hung up on it
            return False

        assert await trio.to_thread.run_sync(watch_then_misbehave)
        nursery.cancel_scope.cancel()
    assert node.counts == [control.Usage({"L1": 10}, ops=3)]


async def test_a_standby_asked_for_again_reaches_the_node_with_why_and_the_gib_it_needs():
    asked: list[tuple[str, int]] = []

    async def standby(lost: str, gib: int):
        asked.append((lost, gib))
        return TICKET, ""

    async with trio.open_nursery() as nursery:
        address = await nursery.start(
            functools.partial(
                control.serve_control, "t" * 32, Node().session, Node().failover, standby=standby
            )
        )
        good = ["standby", "t" * 32, "the checkpoint outgrew the standby", 5]
        assert (await trio.to_thread.run_sync(ask, address, good))[0] == "ok"
        for gib in (-1, 1.5, "5", 2**21):
            answer = await trio.to_thread.run_sync(ask, address, [*good[:3], gib])
            assert answer[0] == "error"
        old = await trio.to_thread.run_sync(ask, address, good[:3])  # no GiB: refused
        assert old[0] == "error"
        nursery.cancel_scope.cancel()
    assert asked == [("the checkpoint outgrew the standby", 5)]


def test_each_rank_of_a_job_takes_its_own_control_address() -> None:
    environ = {
        control.ENV_ADDRESS: "127.0.0.1:1000,127.0.0.1:2000",
        control.ENV_TOKEN: "t",
        "LOCAL_RANK": "1",
    }
    assert control.address_for_rank(environ) == "127.0.0.1:2000"
    assert control.address_for_rank({**environ, "LOCAL_RANK": "0"}) == "127.0.0.1:1000"


def test_a_rank_beyond_the_gpus_leased_is_told_to_match_gpus_and_ranks() -> None:
    environ = {control.ENV_ADDRESS: "127.0.0.1:1000", control.ENV_TOKEN: "t", "LOCAL_RANK": "1"}
    with pytest.raises(CumulusError, match="as many GPUs as torchrun --nproc-per-node ranks"):
        control.address_for_rank(environ)


def test_a_process_no_node_started_has_no_control_address() -> None:
    assert control.address_for_rank({}) is None


def test_a_rank_beyond_the_executors_named_is_told_to_name_one_per_rank() -> None:
    from cumulus_p2p import shim

    environ = {shim.ENV_EXECUTOR: "127.0.0.1:1000", "LOCAL_RANK": "1"}
    with pytest.raises(SessionClosedError, match="name one executor per rank"):
        shim._executor_address(environ)
    assert shim._executor_address({**environ, "LOCAL_RANK": "0"}) == "127.0.0.1:1000"
