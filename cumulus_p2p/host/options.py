"""The options every executor takes, on ``cumulus-executor`` and ``cumulus-node --provide``.

Kept apart from the executor itself, and free of torch, so that ``cumulus-node`` parses
its command line (and a boot or consumer node runs) without loading torch.
"""

from __future__ import annotations

import os
from enum import StrEnum

#: Host memory that sessions evicted from a GPU may hold together: half of this machine's.
DEFAULT_RAM_BYTES = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


class GraphCompiler(StrEnum):
    """How an executor runs graph programs."""

    LOOP = "loop"  # node by node (``GraphProgram.run``)
    INDUCTOR = "inductor"  # compiled for the device, after a first run node by node


def parse_size(text: str) -> int:
    """Parse ``"512MiB"``, ``"8GiB"``, ``"1000000"`` into bytes."""
    units = {"kib": 1024, "mib": 1024**2, "gib": 1024**3, "kb": 1000, "mb": 1000**2, "gb": 1000**3}
    lowered = text.strip().lower()
    for unit, factor in units.items():
        if lowered.endswith(unit):
            return int(float(lowered[: -len(unit)]) * factor)
    return int(lowered)


def add_isolation_flags(parser, *, where: str) -> None:
    """``--worker-per-session`` / ``--shared-process`` and ``--pool``, on ``parser`` (or
    an argument group); ``where`` names the process shared sessions run in."""
    isolation = parser.add_mutually_exclusive_group()
    isolation.add_argument(
        "--worker-per-session",
        dest="workers",
        action="store_true",
        default=None,
        help="run each session in a worker process of its own (default when CUDA is present)",
    )
    isolation.add_argument(
        "--shared-process",
        dest="workers",
        action="store_false",
        help=f"run every session in {where} (default on a CPU)",
    )
    parser.add_argument(
        "--pool",
        type=int,
        default=1,
        metavar="N",
        help="worker processes kept started for the next session (default 1)",
    )


def add_peer_links_flag(parser) -> None:
    """``--no-peer-links`` on ``parser``: the host takes no connections from other hosts."""
    parser.add_argument(
        "--no-peer-links",
        dest="peer_links",
        action="store_false",
        help="this host cannot take connections from other hosts (a firewall or NAT keeps "
        "them out): a job of several GPUs that leases it runs its collectives through its "
        "consumer instead of between its hosts",
    )


def add_graph_compiler_flag(parser) -> None:
    """``--graph-compiler`` on ``parser``: how an executor runs compiled graphs."""
    parser.add_argument(
        "--graph-compiler",
        choices=[c.value for c in GraphCompiler],
        default=GraphCompiler.LOOP.value,
        help="run compiled graphs node by node (loop, the default) or compile each for "
        "the device with inductor after its first run (inductor)",
    )


def add_blob_flags(parser, *, default_dir: str | None = None) -> None:
    """``--blob-dir`` and ``--blob-cap`` on ``parser``: where the host keeps the blobs
    consumers upload (content-addressed, shared by all its sessions) and how much disk
    they may take; ``default_dir`` None leaves the store off unless a directory is given."""
    parser.add_argument(
        "--blob-dir",
        default=default_dir,
        metavar="DIR",
        help="keep uploaded blobs here, so a second upload of the same bytes sends only "
        "their hashes (default: "
        + ("none: no store" if default_dir is None else default_dir)
        + ")",
    )
    add_blob_cap_flag(parser)


def add_blob_cap_flag(parser) -> None:
    """``--blob-cap`` on ``parser``: how much disk the blob store may take."""
    parser.add_argument(
        "--blob-cap",
        type=parse_size,
        default="20GiB",
        metavar="SIZE",
        help="disk the blob store may take, least recently used blobs dropped first "
        "(default 20GiB)",
    )


def add_ram_tier_flag(parser) -> None:
    """``--ram-tier`` on ``parser``: the host memory sessions evicted from a GPU may hold."""
    parser.add_argument(
        "--ram-tier",
        type=parse_size,
        default=DEFAULT_RAM_BYTES,
        metavar="SIZE",
        help="host memory that sessions evicted from a GPU may hold together; past it "
        "they go to the blob store on disk (default: half of this machine's memory, "
        f"{DEFAULT_RAM_BYTES / 2**30:.1f} GiB)",
    )
