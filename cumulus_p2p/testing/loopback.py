"""Meshes of real ``cumulus-node`` processes on loopback that several specs start alike."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .nodes import LOOPBACK_LISTEN, NodeProcess, start_liar, start_node, start_provider, stop_all

#: Where a provider that nobody can dial claims its sessions are: nothing answers there.
UNDIALABLE_HOST = "127.0.0.9"


def start_boot(root: Path, *args: str) -> NodeProcess:
    """A bootstrap node under ``root/boot`` listening on loopback (``args`` add flags)."""
    return start_node(root / "boot", "--listen", LOOPBACK_LISTEN, *args)


def start_hidden_provider(data_dir: Path, boot: NodeProcess) -> NodeProcess:
    """A provider with no listen address and a session port nobody can dial: reachable
    only through the relay reservation it keeps on ``boot``."""
    return start_provider(
        data_dir,
        boot.addr,
        "--relay",
        boot.addr,
        "--advertise-host",
        UNDIALABLE_HOST,
        listen="none",
    )


@contextmanager
def liar_and_honest_provider(
    root: Path, lie: str
) -> Iterator[tuple[NodeProcess, NodeProcess, NodeProcess]]:
    """A bootstrap node, a liar about ``lie`` under ``root/liar`` (cheapest on the mesh)
    and an honest provider at 0.7 under ``root/honest``, yielded as ``(boot, liar,
    honest)`` once both provide; all three stopped at the end."""
    boot = start_boot(root)
    liar = start_liar(root / "liar", boot.addr, lie)
    honest = start_provider(root / "honest", boot.addr, "--price", "0.7")
    try:
        liar.wait_for("providing")
        honest.wait_for("providing")
        yield boot, liar, honest
    finally:
        stop_all((liar, honest, boot))


@contextmanager
def cheap_and_dear_providers(
    root: Path, *args: str
) -> Iterator[tuple[NodeProcess, list[NodeProcess]]]:
    """A bootstrap node and providers at 0.3 and 0.7 under ``root/p0`` and ``root/p1``
    (``args`` add their flags), yielded as ``(boot, [cheap, dear])`` once both provide:
    a job leases the cheap one and has the dear one to move to. All stopped at the end."""
    boot = start_boot(root)
    providers = [
        start_provider(root / f"p{i}", boot.addr, "--price", price, *args)
        for i, price in enumerate(("0.3", "0.7"))
    ]
    try:
        for node in providers:
            node.wait_for("providing")
        yield boot, providers
    finally:
        stop_all([*providers, boot])
