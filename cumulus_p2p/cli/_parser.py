"""The command line: the node's flags by role, its commands, and the checks argparse
cannot make (a script after ``--``, ``config.json`` defaults, a GPU this machine has)."""

from __future__ import annotations

import argparse

from .._errors import CumulusError, NodeConfigError
from ..host.options import (
    add_blob_cap_flag,
    add_graph_compiler_flag,
    add_isolation_flags,
    add_peer_links_flag,
    add_ram_tier_flag,
)
from ..node import control, hardware
from ..node.datadir import DataDir
from . import _explore, _views
from ._flags import (
    add_data_dir,
    add_duration,
    add_explore_address,
    data_dir,
    device_choice,
    parse_price,
    parse_storage_price,
    score,
    size,
    storage_gib,
)

DEFAULT_LISTEN = "/ip4/0.0.0.0/tcp/4001"
USAGE = """\
cumulus-node [--provide | --consume] [FLAGS] [-- python SCRIPT [ARGS]]
       cumulus-node status|peers|offers|reputation|ledger [--data-dir DIR] [--json]
       cumulus-node logs [--data-dir DIR] [-n LINES] [--follow]
       cumulus-node explore [--data-dir DIR] [--explore-host HOST] [--explore-port PORT]"""
#: Flags a config.json may not set: they choose what to run and where the config lives.
_NOT_CONFIGURABLE = {"help", "provide", "consume", "data_dir", "command"}


def build_parser() -> argparse.ArgumentParser:
    """``cumulus-node``'s parser: the node's flags, and the commands that read a node."""
    parser = argparse.ArgumentParser(
        prog="cumulus-node",
        usage=USAGE,
        description="A Cumulus peer-to-peer GPU mesh node. Provide this machine's GPU, "
        "consume a remote one for a PyTorch script, or (with neither flag) run a "
        "bootstrap node that routes and relays. The commands below read what the node "
        "on a data directory knows instead.",
        epilog="With --consume, everything after -- is the script: -- python train.py [args]. "
        "cumulus-node COMMAND --help describes a command.",
    )
    _add_role_flags(parser)
    _add_node_flags(parser.add_argument_group("node"))
    _add_provide_flags(parser.add_argument_group("--provide"))
    _add_consume_flags(parser.add_argument_group("--consume"))
    both = parser.add_argument_group("--provide and --consume")
    both.add_argument(
        "--shares",
        type=int,
        default=None,
        help="share units to offer (default 4) or to lease (default 1)",
    )
    commands = parser.add_subparsers(
        title="commands (instead of running a node)",
        dest="command",
        metavar="COMMAND",
        prog="cumulus-node",  # argparse would build it from the usage above
        action=_Commands,
    )
    _views.add_commands(commands)
    _explore.add_command(commands)
    return parser


class _Commands(argparse._SubParsersAction):
    """The commands, where a word that names none is an unrecognized argument, as it was
    before there were commands: ``--provide --gpus 2`` names ``--gpus``, and
    ``--consume python x.py`` (without its ``--``) names the script."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.choices = None  # argparse checks choices before __call__ could pass them on

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if values[0] in self._name_parser_map:
            super().__call__(parser, namespace, values, option_string)
        else:  # as the base class passes on what the command's parser left over
            vars(namespace).setdefault(argparse._UNRECOGNIZED_ARGS_ATTR, []).extend(values)

    def parser_of(self, command: str) -> argparse.ArgumentParser:
        return self._name_parser_map[command]


def _add_role_flags(parser: argparse.ArgumentParser) -> None:
    role = parser.add_mutually_exclusive_group()
    role.add_argument("--provide", action="store_true", help="offer this machine's device")
    role.add_argument(
        "--consume", action="store_true", help="rent a device and run the script given after --"
    )


def _add_node_flags(node) -> None:
    node.add_argument(
        "--explore",
        action="store_true",
        help="also serve the read-only web explorer of what this node knows "
        "(--explore-host, --explore-port)",
    )
    add_explore_address(node)
    add_data_dir(node, help="identity, config and ledger (default $CUMULUS_DATA_DIR or ~/.cumulus)")
    node.add_argument(
        "--listen",
        default=DEFAULT_LISTEN,
        help=f"libp2p listen multiaddr (default {DEFAULT_LISTEN}), or 'none' for a node "
        "that cannot be dialed and is reached through its --relay nodes",
    )
    _add_relay_flags(node)
    _add_discovery_flags(node)
    _add_book_flags(node)
    node.add_argument(
        "--no-live", action="store_true", help="plain log lines instead of the live status table"
    )
    node.add_argument("-v", "--verbose", action="store_true", help="log more")


def _add_repeatable(group, flag: str, metavar: str, help: str) -> None:
    """A flag that may be given several times: each use adds its value to a list, which
    is empty when the flag is not given."""
    group.add_argument(flag, action="append", default=[], metavar=metavar, help=help)


def _add_price(group, flag: str, default: str, help: str, *, per_gib_hour: bool = False) -> None:
    """A ``PRICE`` flag in credits per share-hour (per GiB-hour of a standby's storage with
    ``per_gib_hour``), as micro-credits; ``default`` is written as a user would type it."""
    parse = parse_storage_price if per_gib_hour else parse_price
    group.add_argument(flag, type=parse, default=parse(default), metavar="PRICE", help=help)


def _add_book_flags(node) -> None:
    node.add_argument(
        "--max-offers-per-author",
        type=int,
        default=8,
        metavar="N",
        help="live offers (and bids) the order book keeps from one peer; a rig lists one "
        "offer per device (default 8)",
    )
    node.add_argument(
        "--max-book-orders",
        type=int,
        default=20_000,
        metavar="N",
        help="live orders the order book keeps in all; when full, peers with no record "
        "and the most orders lose theirs first (default 20000)",
    )


def _add_relay_flags(node) -> None:
    _add_repeatable(
        node,
        "--relay",
        "ADDR",
        "a node to keep a relay reservation on, so peers reach this one through it "
        "when it cannot be dialed (behind NAT); repeatable",
    )
    add_duration(
        node,
        "--circuit-duration",
        120,
        "as a relay: how long one relayed connection may last (default 120s)",
    )
    node.add_argument(
        "--circuit-bytes",
        type=size,
        default=16 * 2**20,
        metavar="SIZE",
        help="as a relay: how much one relayed connection may carry (default 16MiB)",
    )


def _add_discovery_flags(node) -> None:
    _add_repeatable(
        node, "--bootstrap", "ADDR", "a known node's /ip4/.../tcp/.../p2p/<id> address; repeatable"
    )
    node.add_argument(
        "--mdns",
        action="store_true",
        help="find other nodes on the local network by mDNS (no --bootstrap needed on a LAN)",
    )
    node.add_argument(
        "--announce-interval",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="seconds between re-announcements of offers and bids (default 10)",
    )


def _add_provide_flags(provide) -> None:
    _add_price(provide, "--price", "1.0", "asking price in credits per share-hour (default 1.0)")
    _add_price(
        provide,
        "--contend-price",
        "0",
        "credits per share-hour a contending lease pays: it runs below on-demand "
        "tenants, in their idle gaps (default 0: none sold)",
    )
    provide.add_argument(
        "--contend-shares",
        type=int,
        metavar="N",
        help="contending shares each device sells beyond its --shares, never preempted "
        "(default: as many as --shares, when a --contend-price is set)",
    )
    provide.add_argument(
        "--overcommit",
        type=float,
        default=1.0,
        metavar="X",
        help="sell X times each device's memory in shares, 1.0 to 2.0 (default 1.0): idle "
        "tenants' memory is paged out to RAM or disk to make room, and the offer says so",
    )
    _add_price(
        provide,
        "--storage-price",
        "0",
        "asking price in credits per GiB-hour for keeping a standby's checkpoints, "
        "the disk another host's consumer leases beside its session (default 0)",
        per_gib_hour=True,
    )
    provide.add_argument(
        "--storage-gib",
        type=storage_gib,
        default=0,
        metavar="GIB",
        help="GiB of disk lent to standbys, all together (default 0: keep no standbys)",
    )
    provide.add_argument(
        "--device",
        type=device_choice,
        default="auto",
        help="auto: every GPU NVML sees, an offer each, else the CPU; cpu; cuda (GPU 0); "
        "cuda:N; or a list such as cuda:0,cuda:2 (default auto)",
    )
    _add_session_flags(provide)
    provide.add_argument("--region", default="", help="free-form region hint, e.g. eu-west")
    _add_lease_terms(provide)
    add_isolation_flags(provide, where="the node's process")
    add_graph_compiler_flag(provide)
    add_peer_links_flag(provide)
    add_blob_cap_flag(provide)  # the store itself is <data dir>/blobs
    add_ram_tier_flag(provide)
    provide.add_argument(
        "--bench-seconds",
        type=float,
        default=0.5,
        help="length of the start-up self benchmark (default 0.5)",
    )
    provide.add_argument(
        "--perf-units",
        type=int,
        default=None,
        metavar="N",
        help="offer N performance units (float32 GFLOP/s) per device instead of the "
        "self benchmark's figure: what a machine that also runs other work can keep up. "
        "Consumers' probes hold the host to it (default: the self benchmark)",
    )


def _add_session_flags(provide) -> None:
    provide.add_argument(
        "--session-host",
        default=None,
        help="address the session channel binds (default: the --listen address's, so "
        "0.0.0.0 by default)",
    )
    provide.add_argument(
        "--session-port", type=int, default=0, help="session channel port (default: any free port)"
    )
    provide.add_argument(
        "--advertise-host",
        default=None,
        help="address consumers dial for sessions (default: every address of the "
        "interfaces the session channel binds)",
    )


def _add_lease_terms(provide) -> None:
    add_duration(provide, "--min-lease", 0, "shortest lease accepted (default none)")
    add_duration(provide, "--receipt-interval", 30, "time between usage receipts (default 30s)")
    add_duration(
        provide,
        "--settle-grace",
        None,
        "how long a receipt may go uncountersigned before the lease pauses; it ends "
        "after twice that (default two receipt intervals)",
    )
    provide.add_argument(
        "--min-consumer-score",
        type=score,
        default=0.0,
        metavar="SCORE",
        help="refuse consumers whose payment record scores below this, 0..1 (a newcomer "
        "scores 0.45, one unpaid lease drops it to about 0.2; default 0: lease to anyone)",
    )
    add_duration(
        provide,
        "--leave-timeout",
        30,
        "on SIGTERM or Ctrl-C, how long to wait for consumers to settle before "
        "stopping anyway (default 30s; a second signal stops at once)",
    )


def _add_consume_flags(consume) -> None:
    _add_repeatable(consume, "--gpu", "MODEL", "acceptable device model; repeatable (default any)")
    consume.add_argument(
        "--min-vram",
        type=size,
        default=0,
        metavar="SIZE",
        help="least device memory, e.g. 16GiB (default 0)",
    )
    consume.add_argument(
        "--min-perf", type=int, default=0, help="least performance units (GFLOP/s; default 0)"
    )
    _add_price(consume, "--max-price", "10", "most credits per share-hour (default 10)")
    consume.add_argument(
        "--gpus",
        type=int,
        default=1,
        metavar="N",
        help="lease N GPUs, each from another host: one per rank of a torchrun job "
        "(-- torchrun --nproc-per-node N train.py), or all for one process (-- python "
        "train.py), whose cuda:0 to cuda:N-1 they are (default 1)",
    )
    _add_lease_wishes(consume)


def _add_lease_wishes(consume) -> None:
    consume.add_argument(
        "--priority",
        choices=["on-demand", "contend", "interruptible"],
        default="on-demand",
        help="lease class (default on-demand); contend: share a device below on-demand "
        "tenants and pay the host's contend price, below its ask, if your --max-price "
        "reaches it",
    )
    consume.add_argument(
        "--max-overcommit",
        type=float,
        default=2.0,
        metavar="X",
        help="the most a host may overcommit its memory (--overcommit) for this job: 1.0 "
        "keeps the job's memory on the device; above, an idle job's memory may be paged "
        "out and pays the transfer back at its next op (default 2.0, any host)",
    )
    consume.add_argument(
        "--pay-bid",
        action="store_true",
        help="propose your --max-price rather than the ask: on a shared device your job "
        "then runs ahead of the other tenants of its class (not with --priority contend, "
        "whose tenants all pay the host's contend price)",
    )
    add_duration(consume, "--duration", 3600, "lease length (default 1h)")
    add_duration(consume, "--match-timeout", 60, "how long to wait for a match (default 60s)")
    add_duration(
        consume,
        "--wait-for-host",
        1800,
        "after a host fails, how long the job waits for a usable one before it gives up "
        "(its state is safe in its checkpoints meanwhile; default 30m)",
    )
    add_duration(
        consume,
        "--host-backoff",
        15,
        "how long a host that failed is first set aside; it doubles with each failure "
        "(default 15s)",
    )
    add_duration(
        consume,
        "--checkpoint-interval",
        30,
        "time between session checkpoints for failover (default 30s)",
    )
    consume.add_argument(
        "--checkpoint-to",
        choices=control.CHECKPOINT_PLACES,
        default="standby",
        help="where the session's checkpoints are kept: on a standby host the node leases "
        "beside the session's, off this machine's link (the default; this machine's disk "
        "while no host lends disk for it), on this machine's disk, or both",
    )
    consume.add_argument(
        "--standby-gib",
        type=storage_gib,
        default=4,
        metavar="GIB",
        help="GiB of disk leased on the standby for the checkpoints (default 4)",
    )
    _add_price(
        consume,
        "--max-storage-price",
        "1",
        "most credits per GiB-hour for the standby's disk (default 1)",
        per_gib_hour=True,
    )
    consume.add_argument(
        "--private",
        action="store_true",
        help="the hosts keep none of this job's uploads after its session (nothing of it "
        "is announced to or fetched by other hosts; uploads are not fetched from them)",
    )
    consume.add_argument(
        "--no-cuda-compat",
        action="store_true",
        help="do not map torch.cuda and device='cuda' to the remote device",
    )
    device = consume.add_mutually_exclusive_group()
    device.add_argument(
        "--native",
        action="store_true",
        default=None,
        help="run the script on the native C++ device (the default where it can be built, "
        "with g++, or is built): eager ops cost about what they cost on a CPU tensor, and "
        "compiled graphs go to the host whole; an error where it cannot be built",
    )
    device.add_argument(
        "--python-device",
        dest="native",
        action="store_false",
        help="run the script on the Python wrapper device instead",
    )


def parse_command_line(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The parsed flags (``command`` None for a node), and the script after ``--``.

    Raises:
        SystemExit: A usage error (status 2), or after ``--help``.
        NodeConfigError: ``config.json`` is not JSON, or names a flag that does not exist.
    """
    script: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, script = argv[:split], argv[split + 1 :]
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is not None:
        _check_command_args(parser, args, script)
        return args, script
    _apply_config_defaults(parser, data_dir(args))
    args = parser.parse_args(argv)
    _check_node_args(parser, args, script)
    return args, script


def _check_command_args(parser: argparse.ArgumentParser, args, script: list[str]) -> None:
    """A command takes no script, and none of the node's flags but those it has too."""
    if script:
        parser.error(f"a command after -- is only run with --consume, not with {args.command}")
    commands = next(a for a in parser._actions if isinstance(a, _Commands))
    own = {a.dest for a in commands.parser_of(args.command)._actions} | {"command"}
    defaults = parser.parse_args([])
    for action in parser._actions:
        if action.dest in own or not action.option_strings:
            continue
        if getattr(args, action.dest, None) != getattr(defaults, action.dest, None):
            parser.error(f"{action.option_strings[-1]} does not apply to {args.command}")


def _check_node_args(parser: argparse.ArgumentParser, args, script: list[str]) -> None:
    if args.consume and not script:
        parser.error("--consume needs the script after --, e.g. -- python train.py")
    if script and not args.consume:
        parser.error("a command after -- is only run with --consume")
    if script:
        from ..node.consumer import script_command

        try:
            script_command(tuple(script), cuda_compat=True)
        except CumulusError as exc:
            parser.error(str(exc))
    if args.gpus != 1 and not args.consume:
        parser.error("--gpus is how many GPUs --consume leases for a job")
    if args.gpus != 1 and args.native:
        parser.error(
            "--native has no collectives yet: a job of several GPUs runs on the Python "
            "device (leave out --native)"
        )
    if not 1 <= args.gpus <= 64:
        parser.error(f"--gpus must be between 1 and 64, not {args.gpus}")
    if args.shares is not None and not 1 <= args.shares <= 2**16:
        parser.error("--shares must be between 1 and 65536")
    if args.pool < 0:
        parser.error("--pool must not be negative (0 starts each worker when its lease comes)")
    if args.provide and args.perf_units is not None and args.perf_units < 1:
        parser.error("--perf-units must be at least 1 (float32 GFLOP/s the device keeps up)")
    if args.provide and args.contend_price > args.price:
        parser.error(
            "--contend-price must not be above --price: it is what a contending lease "
            "pays below the ask"
        )
    if args.provide and args.contend_shares is not None:
        if not 0 <= args.contend_shares <= 2**16:
            parser.error("--contend-shares must be between 0 and 65536")
        if args.contend_shares and not args.contend_price:
            parser.error("--contend-shares needs a --contend-price: what those leases pay")
    if args.provide and not 1.0 <= args.overcommit <= 2.0:
        parser.error(
            f"--overcommit must be between 1.0 and 2.0, not {args.overcommit:g} (1.0: "
            "sell only the memory the device has)"
        )
    if args.consume and not 1.0 <= args.max_overcommit <= 2.0:
        parser.error(
            f"--max-overcommit must be between 1.0 and 2.0, not {args.max_overcommit:g} "
            "(1.0: only hosts that keep the job's memory on the device)"
        )
    if args.consume and args.pay_bid and args.priority == "contend":
        parser.error(
            "--pay-bid does not apply to --priority contend: every contending tenant pays "
            "the host's contend price and none ranks ahead; bid on demand to buy rank"
        )
    if args.provide and args.device.startswith("cuda"):
        try:
            hardware.offered_devices(args.device, hardware.detect())
        except ValueError as exc:
            parser.error(str(exc))


def _apply_config_defaults(parser: argparse.ArgumentParser, data: DataDir) -> None:
    """Take flag defaults from the data directory's ``config.json``.

    Raises:
        NodeConfigError: The file is not JSON, or names a flag that does not exist.
    """
    config = data.config()
    known = {a.dest for a in parser._actions} - _NOT_CONFIGURABLE
    unknown = sorted(set(config) - known)
    if unknown:
        raise NodeConfigError(
            f"config.json in {data.path} sets unknown flags {unknown}; valid keys "
            f"are the long flag names with underscores: {sorted(known)}"
        )
    # argparse runs its type conversion on string defaults only: numbers become strings,
    # so "price": 0.5 means what --price 0.5 means.
    parser.set_defaults(
        **{
            key: value if isinstance(value, list | bool) else str(value)
            for key, value in config.items()
        }
    )
