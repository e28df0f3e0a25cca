"""The session ticket the consumer node hands the shim, and how the shim dials it."""

from __future__ import annotations

import pytest

from cumulus_p2p._errors import PeerUnreachableError, RemoteProtocolError
from cumulus_p2p.identity import NodeIdentity
from cumulus_p2p.node.attach import open_channel
from cumulus_p2p.node.control import SessionTicket

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
