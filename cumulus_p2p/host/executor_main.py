"""``cumulus-executor``: run an executor directly, without the market.

Plain TCP suits loopback and a trusted LAN (tests, benchmarks). ``--secure`` serves the
authenticated, encrypted, resumable session channel instead, to the consumers whose node
keys are on the allow list (a private pool). Prints one line when it listens:
``cumulus executor listening on HOST:PORT device=... quota=...`` (plus ``key=HEX`` when
secure: the provider key consumers must expect). With ``--worker-per-session`` (the default
when CUDA is present) each session runs in a worker process of its own (``supervisor.py``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from functools import partial
from pathlib import Path

import torch
import trio

from ..blobs import service as blobservice
from ..channel.secure import serve_secure
from ..identity import NodeIdentity
from .executor import Executor, ExecutorConfig
from .options import (
    GraphCompiler,
    add_blob_flags,
    add_graph_compiler_flag,
    add_isolation_flags,
    add_peer_links_flag,
    add_ram_tier_flag,
    parse_size,
)
from .supervisor import SupervisorConfig, WorkerSupervisor


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cumulus-executor",
        description="Serve cumulus op streams on this machine's GPU (or CPU) over plain TCP. "
        "Plain TCP is unauthenticated: bind to loopback or a trusted LAN only.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="TCP port (default: any free port)")
    parser.add_argument(
        "--device",
        default="auto",
        help="where ops run: auto (CUDA when present, else CPU), cpu, cuda or cuda:N",
    )
    add_isolation_flags(parser, where="this process")
    parser.add_argument(
        "--quota",
        type=parse_size,
        default="8GiB",
        help="memory quota per session, e.g. 512MiB or 8GiB (default 8GiB)",
    )
    parser.add_argument(
        "--cache-grace",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="keep a session whose consumer vanished this long for it to resume "
        "(default 60; 0 turns the host-side cache off)",
    )
    parser.add_argument(
        "--cache-bytes",
        type=parse_size,
        default="4GiB",
        metavar="SIZE",
        help="host memory all kept sessions may hold together, oldest dropped first (default 4GiB)",
    )
    parser.add_argument(
        "--device-memory",
        type=parse_size,
        default=None,
        metavar="SIZE",
        help="what all sessions' tensors may hold on the device together; past it, idle "
        "and lower-priority sessions are evicted (to host memory on a GPU, to the blob "
        "store on a CPU) and come back at their next op; a batch's growth is made room "
        "for before it runs (default: no bound)",
    )
    add_ram_tier_flag(parser)
    add_graph_compiler_flag(parser)
    add_peer_links_flag(parser)
    add_blob_flags(parser)
    parser.add_argument(
        "--secure",
        action="store_true",
        help="serve the encrypted, authenticated session channel instead of plain TCP",
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=Path.home() / ".cumulus",
        help="where the node key lives (created on first use; default ~/.cumulus)",
    )
    parser.add_argument(
        "--allow-key",
        action="append",
        default=[],
        metavar="HEX",
        help="with --secure: a consumer public key (hex) allowed to connect; repeatable",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log sessions")
    return parser


def build_executor(config: ExecutorConfig, *, workers: bool, pool: int = 1, hidden=()):
    """The in-process ``Executor``, or a ``WorkerSupervisor`` running a process per session.

    Raises:
        ValueError: the device cannot be had here.
    """
    if not workers:
        return Executor(config)
    return WorkerSupervisor(SupervisorConfig(config, pool=pool, hidden=tuple(hidden)))


async def _serve(executor: Executor, host: str, port: int) -> None:
    async with trio.open_nursery() as nursery:
        bound = await nursery.start(executor.serve_tcp, host, port)
        print(f"cumulus executor listening on {host}:{bound} {_describe(executor)}", flush=True)


async def _serve_secure(
    executor: Executor, host: str, port: int, identity: NodeIdentity, allowed: set[bytes]
) -> None:
    # Another executor pulling a session's kept pieces comes with a grant, not a listed
    # key (``blobservice``): admitted only to read, and only by a grant held here.
    readers: set[bytes] = set()

    def authorize(key: bytes, lease: bytes | None) -> str | None:
        grant = blobservice.grant_in(lease)
        if grant is not None:
            if not executor.holds_grant(grant):
                return "no session here keeps pieces under that grant"
            readers.add(key)
            return None
        if key in allowed:
            return None
        return "this executor serves only consumers on its allow list (--allow-key)"

    async def handle(channel) -> None:
        reader = channel.peer_public_key in readers
        readers.discard(channel.peer_public_key)
        await executor.run_session(channel, only_blobs=reader)

    serve = partial(
        serve_secure,
        identity,
        authorize=authorize,
        handler=handle,
        host=host,
        port=port,
    )
    async with trio.open_nursery() as nursery:
        if isinstance(executor, WorkerSupervisor):
            await nursery.start(executor.run)
        else:
            await nursery.start(executor.expire_parked_forever)
        server = await nursery.start(serve)
        print(
            f"cumulus executor listening on {host}:{server.port} {_describe(executor)} "
            f"secure key={identity.public_key.hex()}",
            flush=True,
        )


def _describe(executor: Executor | WorkerSupervisor) -> str:
    if isinstance(executor, WorkerSupervisor):
        config, device = executor.config.executor, executor.device
        mode = f" workers=per-session pool={executor.config.pool}"
    else:
        config, device, mode = executor.config, executor.ctx.device, ""
    quota_gib = config.quota_bytes / 1024**3
    cache = f"cache={config.cache_bytes / 1024**3:.2f}GiB/{config.cache_grace:g}s"
    blobs = "" if config.blob_dir is None else f" blobs={config.blob_cap / 1024**3:.2f}GiB"
    return f"device={device} quota={quota_gib:.2f}GiB {cache}{blobs}{mode}"


#: ``ExecutorConfig`` fields that take their flag's value as it was given (the others are
#: named differently or converted).
_CONFIG_AS_GIVEN = ("device", "cache_grace", "cache_bytes", "blob_dir", "blob_cap", "peer_links")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    bad = [k for k in args.allow_key if not _is_key_hex(k)]
    if bad:
        parser.error(f"--allow-key expects a 64-hex-digit ed25519 public key, got {bad[0]!r}")
    if args.allow_key and not args.secure:
        parser.error("--allow-key only makes sense with --secure")
    if args.cache_grace < 0:
        parser.error("--cache-grace must not be negative")
    if args.pool < 0:
        parser.error("--pool must not be negative")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    config = ExecutorConfig(
        quota_bytes=args.quota,
        graph_compiler=GraphCompiler(args.graph_compiler),
        device_bytes=args.device_memory,
        ram_bytes=args.ram_tier,
        **{name: getattr(args, name) for name in _CONFIG_AS_GIVEN},
    )
    workers = torch.cuda.is_available() if args.workers is None else args.workers
    hidden = [args.data_dir] if args.secure else []
    try:
        executor = build_executor(config, workers=workers, pool=args.pool, hidden=hidden)
    except ValueError as exc:
        print(f"cumulus-executor: {exc}", file=sys.stderr)
        return 2
    try:
        if args.secure:
            identity = NodeIdentity.load_or_create(args.data_dir)
            allowed = {bytes.fromhex(k) for k in args.allow_key}
            trio.run(_serve_secure, executor, args.host, args.port, identity, allowed)
        else:
            trio.run(_serve, executor, args.host, args.port)
    except KeyboardInterrupt:
        return 0
    return 0


def _is_key_hex(text: str) -> bool:
    try:
        return len(bytes.fromhex(text)) == 32
    except ValueError:
        return False


if __name__ == "__main__":
    sys.exit(main())
