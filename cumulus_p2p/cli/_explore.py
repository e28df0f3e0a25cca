"""``cumulus-node explore``, and the explorer a node serves beside its role with ``--explore``.

The web stack (Starlette, Hypercorn) loads only when the explorer starts.
"""

from __future__ import annotations

import argparse
import logging

import trio
from rich.console import Console

from .._errors import NodeConfigError
from ..node.datadir import DataDir
from ._exits import plain_errors
from ._flags import add_data_dir, add_explore_address, data_dir

ABOUT = (
    "Serve a read-only web explorer of what the node on a data directory knows: hosts and "
    "their scores, evidence, the order book, leases, the mesh. It follows a running node "
    "live, or shows the last state of a stopped one."
)


def add_command(commands) -> None:
    """``explore`` as a command of ``cumulus-node``."""
    explore = commands.add_parser("explore", help="serve the web explorer", description=ABOUT)
    add_data_dir(
        explore,
        default=argparse.SUPPRESS,
        help="the node's data directory (default $CUMULUS_DATA_DIR or ~/.cumulus)",
    )
    add_explore_address(explore, default=argparse.SUPPRESS)
    explore.set_defaults(run=explore_only)


def explore_only(args, console: Console) -> int:
    """``cumulus-node explore``: serve the explorer alone, against a data directory."""
    data = data_dir(args)
    if data.read_state() is None:
        console.print(
            f"[yellow]no node has run on {data.path} yet; the explorer shows what "
            "one writes there once it starts[/yellow]",
            highlight=False,
        )
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            url = await nursery.start(serve_explorer, data, args)
            console.print(f"explorer on {url} (Ctrl-C stops it)", highlight=False)

    with plain_errors():
        trio.run(run)
    return 0


async def serve_explorer(data: DataDir, args, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``data``'s explorer where the ``--explore-*`` flags say; reports its URL.

    Raises:
        NodeConfigError: It cannot listen there (the port is taken, say).
    """
    from ..explorer.serve import serve_explorer

    host, port = args.explore_host, args.explore_port
    try:
        await serve_explorer(
            data,
            host=host,
            port=port,
            also_allow=args.explore_allow_host,
            task_status=task_status,
        )
    except* OSError as group:  # hypercorn raises from inside its nursery
        raise NodeConfigError(
            f"the explorer cannot listen on {host}:{port} ({group.exceptions[0]}); "
            "pick another --explore-port (0 takes any free one)"
        ) from None
