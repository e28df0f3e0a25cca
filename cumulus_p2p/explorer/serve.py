"""Serve the explorer with Hypercorn on trio, re-reading the node's state every second."""

from __future__ import annotations

import functools
import logging

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from ..node.datadir import DataDir
from . import DEFAULT_HOST, DEFAULT_PORT
from .app import StateSource, build_app

#: How often ``state.json`` is read again (the node rewrites it once a second).
POLL_S = 1.0


async def serve_explorer(
    data: DataDir,
    *,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the explorer of ``data``'s node until cancelled; reports its URL."""
    source = StateSource(data)
    source.refresh()
    config = Config()
    config.bind = [f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(functools.partial(serve, build_app(source), config))
        nursery.start_soon(_follow, source)
        task_status.started(binds[0].rstrip("/") + "/")


async def _follow(source: StateSource) -> None:
    while True:
        await trio.sleep(POLL_S)
        source.refresh()
