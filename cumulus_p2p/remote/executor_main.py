"""``cumulus-executor``: run an executor directly, without the market.

Useful on a trusted LAN, for tests and for benchmarks. Prints one line when it listens:
``cumulus executor listening on HOST:PORT device=... quota=...``.
"""

from __future__ import annotations

import argparse
import logging
import sys

import trio

from .executor import Executor, ExecutorConfig


def parse_size(text: str) -> int:
    """Parse ``"512MiB"``, ``"8GiB"``, ``"1000000"`` into bytes."""
    units = {"kib": 1024, "mib": 1024**2, "gib": 1024**3, "kb": 1000, "mb": 1000**2, "gb": 1000**3}
    lowered = text.strip().lower()
    for unit, factor in units.items():
        if lowered.endswith(unit):
            return int(float(lowered[: -len(unit)]) * factor)
    return int(lowered)


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
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="where ops run: auto = CUDA when present, else CPU",
    )
    parser.add_argument(
        "--quota",
        type=parse_size,
        default="8GiB",
        help="memory quota per session, e.g. 512MiB or 8GiB (default 8GiB)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log sessions")
    return parser


async def _serve(executor: Executor, host: str, port: int) -> None:
    async with trio.open_nursery() as nursery:
        bound = await nursery.start(executor.serve_tcp, host, port)
        quota_gib = executor.config.quota_bytes / 1024**3
        print(
            f"cumulus executor listening on {host}:{bound} device={executor.ctx.device} "
            f"quota={quota_gib:.2f}GiB",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    try:
        executor = Executor(ExecutorConfig(device=args.device, quota_bytes=args.quota))
    except ValueError as exc:
        print(f"cumulus-executor: {exc}", file=sys.stderr)
        return 2
    try:
        trio.run(_serve, executor, args.host, args.port)
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
