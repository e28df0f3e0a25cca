"""Two network namespaces joined by a veth pair: two machines on one LAN, for tests.

Needs root (or CAP_SYS_ADMIN) and ``ip`` from iproute2. ``two_hosts()`` yields a
``Host`` per namespace: its address on the pair, and the command prefix that runs a
process inside it. Everything is deleted on exit; processes must be stopped first.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

SUBNET = "10.201.0"


class NamespacesUnavailable(RuntimeError):
    """Network namespaces cannot be created here (not root, no iproute2, a container)."""


@dataclass(frozen=True, slots=True)
class Host:
    """One namespace: its address on the veth pair, and how to run a command in it."""

    name: str
    address: str

    def command(self, *args: str) -> list[str]:
        return ["ip", "netns", "exec", self.name, *args]


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    if done.returncode != 0:
        raise NamespacesUnavailable(f"ip {' '.join(args)}: {done.stderr.strip()}")


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
