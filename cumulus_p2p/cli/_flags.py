"""Argument types, and the flags that the node and its commands share."""

from __future__ import annotations

import argparse
from pathlib import Path

from .. import explorer
from ..host.options import parse_size
from ..node import hardware
from ..node.datadir import DataDir, default_data_dir

DEFAULT_EXPLORE_HOST, DEFAULT_EXPLORE_PORT = explorer.DEFAULT_HOST, explorer.DEFAULT_PORT


def parse_duration(text: str) -> int:
    """``"90"``, ``"90s"``, ``"30m"``, ``"2h"`` -> seconds."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    text = text.strip().lower()
    factor = units.get(text[-1:], 0)
    number = text[:-1] if factor else text
    try:
        seconds = float(number) * (factor or 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (try 90s, 30m, 2h)") from None
    if seconds <= 0:
        raise argparse.ArgumentTypeError("a duration must be positive")
    return int(seconds)


def parse_price(text: str, per: str = "share-hour") -> int:
    """Credits per share-hour (or per ``per``), e.g. ``"0.5"``, as micro-credits."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a price: {text!r} (credits per {per})") from None
    if not 0 <= value < 2**48 / 1e6:
        raise argparse.ArgumentTypeError("a price must be a non-negative number")
    return round(value * 1e6)


def parse_storage_price(text: str) -> int:
    """Credits per GiB-hour of a standby's storage, e.g. ``"0.01"``, as micro-credits."""
    return parse_price(text, "GiB-hour")


def size(text: str) -> int:
    """A size such as ``"8GiB"``, in bytes."""
    try:
        return parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 8GiB or 512MiB)") from None


def number_in(kind, low, high, what: str):
    """An argparse type: a ``kind`` (int, float) between ``low`` and ``high``."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value

    return parse


score = number_in(float, 0.0, 1.0, "a score between 0 and 1")
port = number_in(int, 0, 65535, "a port number (0-65535)")
storage_gib = number_in(int, 0, 2**20, "a whole number of GiB from 0 to 1048576")


def device_choice(text: str) -> str:
    """``--device``: auto, cpu, cuda, cuda:N, or a comma-separated list of GPUs."""
    parts = text.split(",")
    if text in ("auto", "cpu") or all(hardware.gpu_index(part) is not None for part in parts):
        return text
    raise argparse.ArgumentTypeError(
        f"{text!r}: use auto, cpu, cuda, cuda:N or a list such as cuda:0,cuda:1"
    )


def add_duration(group, flag: str, default: int | None, help: str) -> None:
    """A ``DURATION`` flag (``90s``, ``30m``, ``2h``), in seconds."""
    group.add_argument(flag, type=parse_duration, default=default, metavar="DURATION", help=help)


def add_data_dir(group, *, default=None, help: str) -> None:
    """``--data-dir``. A command gives ``default=argparse.SUPPRESS``, so that the
    directory may come before the command's name too (``--data-dir DIR status``)."""
    group.add_argument("--data-dir", type=Path, default=default, help=help)


def add_explore_address(group, *, default=None) -> None:
    """``--explore-host``, ``--explore-port`` and ``--explore-allow-host``.

    ``default`` as in :func:`add_data_dir`; None gives each flag its own default.
    """
    group.add_argument(
        "--explore-host",
        default=DEFAULT_EXPLORE_HOST if default is None else default,
        help=f"address the explorer binds (default {DEFAULT_EXPLORE_HOST}: this machine "
        "only; 0.0.0.0 opens it to the network, at this machine's addresses and name)",
    )
    group.add_argument(
        "--explore-port",
        type=port,
        default=DEFAULT_EXPLORE_PORT if default is None else default,
        help=f"the explorer's port (default {DEFAULT_EXPLORE_PORT}; 0 picks a free one)",
    )
    group.add_argument(
        "--explore-allow-host",
        action="append",
        default=[] if default is None else default,
        metavar="NAME",
        help="another host name the explorer answers to, e.g. a DNS name for this machine; "
        "repeatable (it refuses names it does not serve, against DNS rebinding)",
    )


def data_dir(args) -> DataDir:
    """The data directory ``--data-dir`` names, or the default one."""
    return DataDir(args.data_dir or default_data_dir())
