"""Serve the explorer with Hypercorn on trio, re-reading the node's state every second.

Which ``Host`` headers are answered: ``127.0.0.1``, ``localhost`` and ``[::1]`` always,
the address the explorer binds, and any names passed in ``also_allow``. A wildcard bind
(``0.0.0.0`` or ``::``), which a user picks to open the explorer from another machine,
also accepts this machine's host name and the addresses of its interfaces, so
``http://<its LAN address>:8787/`` works; a DNS name or a forwarded public address must
be named in ``also_allow`` (``--explore-allow-host``). Everything else is refused: a page
on another site that points its own name at this machine (DNS rebinding) sends that name.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import socket
from collections.abc import Iterable, Sequence

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from ..node.datadir import DataDir
from . import DEFAULT_HOST, DEFAULT_PORT
from .app import StateSource, build_app

#: How often ``state.json`` is read again (the node rewrites it once a second).
POLL_S = 1.0
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


async def serve_explorer(
    data: DataDir,
    *,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    also_allow: Sequence[str] = (),
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the explorer of ``data``'s node until cancelled; reports its URL.

    Args:
        data: The node's data directory.
        host: The address to bind.
        port: The port to bind (0: any free one).
        also_allow: More host names (or addresses) that requests may name in ``Host``.
    """
    source = StateSource(data)
    source.refresh()
    config = Config()
    config.bind = [f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    app = build_app(source, served_hosts(host, also_allow))
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(functools.partial(serve, app, config))
        nursery.start_soon(_follow, source)
        task_status.started(binds[0].rstrip("/") + "/")


def served_hosts(bind: str, also_allow: Iterable[str] = ()) -> list[str]:
    """The ``Host`` values (without port) that an explorer bound to ``bind`` answers."""
    names = [*LOOPBACK_HOSTS, bind, *also_allow]
    if bind in WILDCARD_HOSTS:
        names += [socket.gethostname(), *_interface_addresses()]
    return list(dict.fromkeys(_as_host_header(name) for name in names if name))


def _interface_addresses() -> list[str]:
    from multiaddr.utils import get_network_addrs  # what py-libp2p itself enumerates

    return [*get_network_addrs(4), *get_network_addrs(6)]


def _as_host_header(name: str) -> str:
    """``name`` as a ``Host`` header spells it: lower case, IPv6 addresses in brackets."""
    try:
        is_v6 = ipaddress.ip_address(name).version == 6
    except ValueError:
        is_v6 = False
    return f"[{name}]" if is_v6 else name.lower()


async def _follow(source: StateSource) -> None:
    while True:
        await trio.sleep(POLL_S)
        source.refresh()
