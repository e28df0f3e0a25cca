"""Network namespaces standing for machines on a LAN, for tests and benchmarks.

Needs root (or CAP_SYS_ADMIN) and ``ip`` from iproute2 (``tc`` too for shaped links).

- ``two_hosts()``: two namespaces joined by one veth pair.
- ``shaped_mesh()``: a consumer and N hosts, each on its own port of a bridge that lives in
  a namespace of its own (the switch), with every port rate-limited both ways by ``tc tbf``:
  the consumer's link slow (a home uplink), the hosts' fast (a datacenter LAN). Nothing is
  created in the caller's own namespace.
- ``interface_bytes()``: an interface's kernel counters, read from inside its namespace.

Each yields a ``Host`` per namespace: its address, its interface and the command prefix that
runs a process inside it. Everything is deleted on exit; processes must be stopped first.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

SUBNET = "10.201.0"
#: ``shaped_mesh``'s addresses: ``.1`` the consumer, ``.2`` onwards the hosts.
MESH_SUBNET = "10.202.0"
#: The interface each ``shaped_mesh`` namespace reaches the switch through.
MESH_INTERFACE = "eth0"


class NamespacesUnavailable(RuntimeError):
    """Network namespaces cannot be created here (not root, no iproute2, a container)."""


@dataclass(frozen=True, slots=True)
class Host:
    """One namespace: its address on the veth pair, and how to run a command in it."""

    name: str
    address: str
    #: Its link's interface inside the namespace ("" where the caller never asked).
    interface: str = ""

    def command(self, *args: str) -> list[str]:
        return ["ip", "netns", "exec", self.name, *args]


def _ip(*args: str) -> None:
    _run("ip", *args)


def _run(*cmd: str) -> None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
    except FileNotFoundError as exc:
        raise NamespacesUnavailable(f"{cmd[0]} is not installed: {exc}") from exc
    if done.returncode != 0:
        raise NamespacesUnavailable(f"{' '.join(cmd)}: {done.stderr.strip()}")


@contextmanager
def two_hosts() -> Iterator[tuple[Host, Host]]:
    """Two namespaces, ``SUBNET.1`` and ``SUBNET.2``, with loopback up in each.

    Raises:
        NamespacesUnavailable: they cannot be created; nothing is left behind.
    """
    tag = f"cum{os.getpid() % 100000}"
    hosts = (Host(f"{tag}a", f"{SUBNET}.1"), Host(f"{tag}b", f"{SUBNET}.2"))
    try:
        try:
            _join(hosts, tag)
        except FileNotFoundError as exc:
            raise NamespacesUnavailable(f"iproute2 is not installed: {exc}") from exc
        yield hosts
    finally:
        for host in hosts:  # deleting a namespace deletes its end of the pair, so both
            subprocess.run(["ip", "netns", "del", host.name], capture_output=True, timeout=10)


def _join(hosts: tuple[Host, Host], tag: str) -> None:
    for host in hosts:
        _ip("netns", "add", host.name)
    _ip("link", "add", f"{tag}va", "type", "veth", "peer", "name", f"{tag}vb")
    for host, link in zip(hosts, (f"{tag}va", f"{tag}vb"), strict=True):
        _ip("link", "set", link, "netns", host.name)
        _ip("-n", host.name, "addr", "add", f"{host.address}/24", "dev", link)
        _ip("-n", host.name, "link", "set", link, "up")
        _ip("-n", host.name, "link", "set", "lo", "up")


@dataclass(frozen=True, slots=True)
class Mesh:
    """``shaped_mesh``'s machines and the rates their links were shaped to."""

    consumer: Host
    hosts: tuple[Host, ...]
    consumer_mbit: float
    host_mbit: float


@contextmanager
def shaped_mesh(
    *, hosts: int = 2, consumer_mbit: float = 100, host_mbit: float = 1000
) -> Iterator[Mesh]:
    """A consumer and ``hosts`` hosts on one switch, their links shaped both ways.

    Consumer-to-host traffic crosses the consumer's link and the host's, so it runs at the
    slower of the two; host-to-host traffic never touches the consumer's link.

    Raises:
        NamespacesUnavailable: they cannot be created; nothing is left behind.
    """
    tag = f"rs{os.getpid() % 100000}"
    switch = f"{tag}sw"
    consumer = Host(f"{tag}c", f"{MESH_SUBNET}.1", MESH_INTERFACE)
    machines = [Host(f"{tag}h{i}", f"{MESH_SUBNET}.{i + 2}", MESH_INTERFACE) for i in range(hosts)]
    created: list[str] = []
    try:
        _add_namespace(switch, created)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for port, (host, mbit) in enumerate(
            [(consumer, consumer_mbit), *((h, host_mbit) for h in machines)]
        ):
            _add_namespace(host.name, created)
            _plug(switch, f"p{port}", host, mbit)
        yield Mesh(consumer, tuple(machines), consumer_mbit, host_mbit)
    finally:
        for name in reversed(created):  # a namespace takes its ends of the pairs with it
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)


def _add_namespace(name: str, created: list[str]) -> None:
    _ip("netns", "add", name)
    created.append(name)
    _ip("-n", name, "link", "set", "lo", "up")


def _plug(switch: str, port: str, host: Host, mbit: float) -> None:
    """Join ``host`` to the switch's bridge through ``port``, shaped to ``mbit`` each way:
    egress of the host's end limits what it sends, egress of the port what it receives."""
    peer = f"name {host.interface} netns {host.name}"
    _ip(*f"-n {switch} link add {port} type veth peer {peer}".split())
    _ip("-n", switch, "link", "set", port, "master", "br0")
    _ip("-n", switch, "link", "set", port, "up")
    _ip("-n", host.name, "addr", "add", f"{host.address}/24", "dev", host.interface)
    _ip("-n", host.name, "link", "set", host.interface, "up")
    _shape(switch, port, mbit)
    _shape(host.name, host.interface, mbit)


def _shape(namespace: str, interface: str, mbit: float) -> None:
    # A bucket of 10 ms at the rate: at least a few full-size (GSO) packets, so TCP is never
    # starved, yet small enough that no burst runs visibly above the rate. The 50 ms queue
    # is about what a home router buffers.
    burst = max(64 * 1024, int(mbit * 1e6 / 8 / 100))
    shape = f"root tbf rate {mbit:g}mbit burst {burst} latency 50ms"
    _run(*f"tc -n {namespace} qdisc replace dev {interface} {shape}".split())


def interface_bytes(interface: str = MESH_INTERFACE) -> tuple[int, int]:
    """``(received, sent)`` bytes the kernel counted on ``interface`` of the namespace this
    process runs in (``ip netns exec`` mounts that namespace's ``/sys``): every byte of
    every frame on the link, headers and retransmissions included."""
    stats = Path("/sys/class/net") / interface / "statistics"
    return int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text())
