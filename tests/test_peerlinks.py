"""Links between a job's hosts: TLS tunnels keyed by the group's secret (host/peerlinks.py)."""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch.distributed as dist

from cumulus_p2p.host.peerlinks import (
    ABOVE_GLOO,
    BELOW_GLOO,
    GLOO,
    GLOO_HOST,
    LOOPBACK,
    MAX_HANDSHAKES,
    STORE,
    GroupKey,
    LinkedStore,
    PeerLinkError,
    Tunnel,
    find_slot,
)
from cumulus_p2p.testing.netns import NamespacesUnavailable, two_hosts

SECRET = "0123456789abcdef0123456789abcdef"
PLAIN = b"the gradients of a private model " * 64


@contextmanager
def tunnel(secret: str = SECRET) -> Iterator[Tunnel]:
    end = Tunnel(secret, LOOPBACK)
    try:
        yield end
    finally:
        end.close()


@contextmanager
def serving(handle) -> Iterator[tuple[str, int]]:
    """A loopback listener whose connections ``handle(conn)`` takes, one at a time, on a
    thread of its own; yields its address and closes it on exit."""
    listener = socket.create_server((LOOPBACK, 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # closed
            handle(conn)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()
    finally:
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        thread.join(timeout=5)


@contextmanager
def echo_server() -> Iterator[tuple[tuple[str, int], list[bytes]]]:
    """A local service that echoes each connection's bytes; yields its address and what
    each connection brought it."""
    received: list[bytes] = []

    def echo(conn: socket.socket) -> None:
        with conn:
            data = b""
            while chunk := conn.recv(65536):
                data += chunk
                conn.sendall(chunk)
            received.append(data)

    with serving(echo) as address:
        yield address, received


@contextmanager
def recording_relay(target: tuple[str, int]) -> Iterator[tuple[int, list[bytes]]]:
    """A plain TCP relay to ``target`` that keeps every byte it carries: what an
    eavesdropper on the hosts' link would see."""
    seen: list[bytes] = []

    def copy(source: socket.socket, sink: socket.socket) -> None:
        try:
            while chunk := source.recv(65536):
                seen.append(chunk)
                sink.sendall(chunk)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def relay(conn: socket.socket) -> None:
        upstream = socket.create_connection(target)
        threading.Thread(target=copy, args=(conn, upstream), daemon=True).start()
        threading.Thread(target=copy, args=(upstream, conn), daemon=True).start()

    with serving(relay) as address:
        yield address[1], seen


def round_trip(port: int, data: bytes) -> bytes:
    """Send ``data`` to ``port`` and end; return what came back before the end (a reset,
    or a connection closed before the data was all sent, is an end)."""
    back = b""
    with socket.create_connection((LOOPBACK, port), timeout=10) as conn:
        try:
            conn.sendall(data)
            conn.shutdown(socket.SHUT_WR)
            while chunk := conn.recv(65536):
                back += chunk
        except OSError:
            pass
    return back


def gloo_blob(port: int) -> bytes:
    """A blob laid out as torch's gloo lays its own: its listener's IPv4 socket address
    amid other fields."""
    address = struct.pack("<H", socket.AF_INET) + struct.pack(">H", port)
    return b"\x02" + b"\x00" * 17 + address + socket.inet_aton(GLOO_HOST) + b"\x00" * 40


def test_every_host_holding_the_secret_derives_the_same_key_and_no_other_does():
    assert GroupKey.from_secret(SECRET) == GroupKey.from_secret(SECRET)
    assert GroupKey.from_secret(SECRET).cert_der != GroupKey.from_secret("f" * 32).cert_der


def test_bytes_reach_the_exposed_service_through_two_tunnels():
    with echo_server() as (service, received), tunnel() as here, tunnel() as there:
        there.expose(STORE, service)
        forward = here.forward((LOOPBACK, there.port), STORE)
        assert round_trip(forward, PLAIN) == PLAIN
    assert received == [PLAIN]


def test_an_eavesdropper_on_the_hosts_link_sees_none_of_the_bytes():
    with echo_server() as (service, _), tunnel() as here, tunnel() as there:
        there.expose(STORE, service)
        with recording_relay((LOOPBACK, there.port)) as (relay, seen):
            forward = here.forward((LOOPBACK, relay), STORE)
            assert round_trip(forward, PLAIN) == PLAIN
    wire = b"".join(seen)
    assert len(wire) > len(PLAIN)  # both ways crossed the relay
    assert b"gradients" not in wire


def test_a_host_without_the_groups_secret_fails_the_handshake_and_reaches_nothing():
    with echo_server() as (service, received), tunnel() as member, tunnel("f" * 32) as outsider:
        member.expose(STORE, service)
        with pytest.raises(PeerLinkError, match="not in this job's group"):
            outsider.probe((LOOPBACK, member.port))
        forward = outsider.forward((LOOPBACK, member.port), STORE)
        assert round_trip(forward, PLAIN) == b""  # its local connection is closed
    assert received == []


def test_plain_bytes_sent_to_a_tunnel_reach_nothing():
    with echo_server() as (service, received), tunnel() as member:
        member.expose(STORE, service)
        assert round_trip(member.port, b"S" + PLAIN) == b""
    assert received == []


def test_a_member_asking_for_what_the_tunnel_does_not_expose_is_closed():
    with echo_server() as (service, received), tunnel() as here, tunnel() as there:
        there.expose(STORE, service)
        forward = here.forward((LOOPBACK, there.port), GLOO)
        assert round_trip(forward, PLAIN) == b""
    assert received == []


def test_a_flood_of_idle_connections_costs_a_bounded_number_of_threads_and_then_nothing():
    with tunnel() as member, tunnel() as other:
        flood = 3 * MAX_HANDSHAKES
        idle = [socket.create_connection((LOOPBACK, member.port)) for _ in range(flood)]
        deadline, closed = time.monotonic() + 10, []
        while len(closed) < flood - MAX_HANDSHAKES and time.monotonic() < deadline:
            closed, _, _ = select.select(idle, [], [], 0.2)  # a closed one reads its end
        assert len(closed) == flood - MAX_HANDSHAKES  # the rest wait in their handshakes
        assert sum(thread.is_alive() for thread in member._threads) <= MAX_HANDSHAKES + 1
        for conn in idle:
            conn.close()
        assert gets_in(other, member, within_s=10)  # once the flood's handshakes end


def gets_in(dialer: Tunnel, member: Tunnel, within_s: float) -> bool:
    """Whether ``dialer``'s probe of ``member`` succeeds within ``within_s`` seconds."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            dialer.probe((LOOPBACK, member.port))
            return True
        except PeerLinkError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)


def test_a_tunnel_is_refused_an_address_other_than_ipv4():
    with pytest.raises(PeerLinkError, match="IPv4"):
        Tunnel(SECRET, "::1")


def test_closing_a_tunnel_ends_its_threads_and_its_forwarded_connections():
    with echo_server() as (service, _), tunnel() as there:
        there.expose(STORE, service)
        here = Tunnel(SECRET, LOOPBACK)
        forward = here.forward((LOOPBACK, there.port), STORE)
        conn = socket.create_connection((LOOPBACK, forward), timeout=10)
        conn.sendall(b"x")
        assert conn.recv(1) == b"x"
        here.close()
        assert conn.recv(1) == b""
        assert not any(thread.is_alive() for thread in here._threads)


def test_a_gloo_blob_of_an_unknown_form_is_refused_saying_what_to_do():
    with pytest.raises(PeerLinkError, match="--no-peer-links"):
        find_slot(b"\x00" * 170)


def test_gloo_publishes_its_tunnel_and_reads_each_peer_as_a_forwarder_both_ranks_order_alike():
    shared = dist.HashStore()
    with tunnel() as first, tunnel() as second:
        stores = [LinkedStore(shared, first), LinkedStore(shared, second)]
        stores[0].set("0/0", gloo_blob(40001))
        stores[1].set("0/1", gloo_blob(40002))
        slot, _ = find_slot(gloo_blob(1))
        assert slot.read(bytes(shared.get("0/0"))) == (LOOPBACK, first.port)
        # Each rank sees its own gloo listener, and the other as a forwarder on one side
        # of it: below for one rank exactly when above for the other.
        assert slot.read(stores[0].get("0/0")) == (GLOO_HOST, 40001)
        seen_by_first = slot.read(stores[0].get("0/1"))[0]
        seen_by_second = slot.read(stores[1].get("0/0"))[0]
        assert {seen_by_first, seen_by_second} == {BELOW_GLOO, ABOVE_GLOO}


#: One end of a link between two machines (network namespaces), run inside its own:
#: ``serve`` exposes an echo service through a tunnel and prints the tunnel's port;
#: ``dial`` forwards to it, checks an echo, then waits for the link to end and prints
#: how long that took.
LINK_END = """
import socket, sys, threading, time
import cumulus_p2p.host.peerlinks as links
links.KEEPALIVE_S, links.UNACKED_LIMIT_S = (1, 1, 2), 3
role, address, secret = sys.argv[1:4]
end = links.Tunnel(secret, address)
if role == "serve":
    service = socket.create_server(("127.0.0.1", 0))
    def echo():
        conn, _ = service.accept()
        while data := conn.recv(65536):
            conn.sendall(data)
    threading.Thread(target=echo, daemon=True).start()
    end.expose(links.STORE, service.getsockname())
    print(end.port, flush=True)
    time.sleep(120)
else:
    port = end.forward((sys.argv[4], int(sys.argv[5])), links.STORE)
    conn = socket.create_connection(("127.0.0.1", port), timeout=60)
    conn.sendall(b"ping")
    assert conn.recv(4) == b"ping"
    print("linked", flush=True)
    cut = float(sys.stdin.readline())  # the test cut the link at this time
    try:
        gone = conn.recv(1)
    except OSError:
        gone = b""
    print(gone == b"", round(time.time() - cut, 1), flush=True)
"""


@pytest.mark.slow
def test_a_link_to_a_host_that_vanishes_without_closing_it_ends_within_seconds():
    # Not a killed peer (its kernel resets the connection): a cut cable, where nothing
    # answers. The link must end on its own for gloo to see its peer gone.
    with contextlib.ExitStack() as stack:
        try:
            a, b = stack.enter_context(two_hosts())
        except NamespacesUnavailable as why:
            pytest.skip(f"needs network namespaces to cut a link: {why}")
        serve = start(stack, b.command(sys.executable, "-c", LINK_END, "serve", b.address, SECRET))
        port = serve.stdout.readline().strip()
        dial = start(
            stack,
            a.command(sys.executable, "-c", LINK_END, "dial", a.address, SECRET, b.address, port),
        )
        assert dial.stdout.readline().strip() == "linked"
        subprocess.run(["ip", "-n", b.name, "link", "set", link_of(b), "down"], check=True)
        dial.stdin.write(f"{time.time()}\n")
        dial.stdin.flush()
        ended, seconds = dial.stdout.readline().split()
        assert ended == "True"
        assert float(seconds) < 15  # probes every second, three answered by nothing


def start(stack: contextlib.ExitStack, command: list[str]) -> subprocess.Popen:
    """``command`` started, its pipes text; killed as ``stack`` closes (before the
    namespaces it runs in are deleted)."""
    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    stack.callback(process.wait)
    stack.callback(process.kill)
    return process


def link_of(host) -> str:
    """The veth end inside ``host``'s namespace (``two_hosts`` names them ``<tag>v[ab]``)."""
    shown = subprocess.run(
        ["ip", "-n", host.name, "-o", "link", "show"], capture_output=True, text=True, check=True
    ).stdout
    return next(
        line.split(":")[1].strip().split("@")[0] for line in shown.splitlines() if "lo:" not in line
    )
