"""``cumulus-node``: run a node (provide, consume, or just route), or read what one knows.

    cumulus-node --provide [--price 0.5] [--shares 4] [--bootstrap ADDR] ...
    cumulus-node --consume [--min-vram 8GiB] [--max-price 1.0] ... -- python train.py
    cumulus-node [--listen ADDR]                 a bootstrap node: routes and relays only
    cumulus-node status | peers | offers | reputation | ledger [--data-dir DIR] [--json]

Every node prints ``listening on <multiaddr>`` once it has joined; other nodes pass that
address to ``--bootstrap``. Flag defaults can also come from ``config.json`` in the data
directory (keys are the flags' long names with dashes as underscores).

Exit status: the script's own with ``--consume``; 2 for a bad command line; 3 when the
node cannot start as configured; 4 when no offer matched in time.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import trio
from rich.console import Console
from rich.live import Live

from . import explorer
from ._errors import CumulusError, NodeConfigError, NoMatchError
from .dht import MeshConfig
from .dht.nat import NatConfig
from .executor_options import (
    GraphCompiler,
    add_graph_compiler_flag,
    add_isolation_flags,
    parse_size,
)
from .explorer import model
from .market import PriorityClass
from .node import hardware, logs, views
from .node.datadir import DataDir, default_data_dir

EXIT_USAGE, EXIT_CONFIG, EXIT_NO_MATCH = 2, 3, 4
VIEWS = ("status", "peers", "offers", "reputation", "ledger", "logs")
DEFAULT_EXPLORE_HOST, DEFAULT_EXPLORE_PORT = explorer.DEFAULT_HOST, explorer.DEFAULT_PORT
DEFAULT_LISTEN = "/ip4/0.0.0.0/tcp/4001"


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


def parse_price(text: str) -> int:
    """Credits per share-hour, e.g. ``"0.5"``, as micro-credits."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a price: {text!r} (credits per share-hour)"
        ) from None
    if not 0 <= value < 2**48 / 1e6:
        raise argparse.ArgumentTypeError("a price must be a non-negative number")
    return round(value * 1e6)


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 8GiB or 512MiB)") from None


def _number_in(kind, low, high, what: str):
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


_score = _number_in(float, 0.0, 1.0, "a score between 0 and 1")
_port = _number_in(int, 0, 65535, "a port number (0-65535)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cumulus-node",
        description="A Cumulus peer-to-peer GPU mesh node. Provide this machine's GPU, "
        "consume a remote one for a PyTorch script, or (with neither flag) run a "
        "bootstrap node that routes and relays.",
        epilog="Also: cumulus-node status|peers|offers|reputation|ledger [--data-dir DIR] "
        "[--json]; cumulus-node explore [--data-dir DIR] serves the web explorer. "
        "With --consume, everything after -- is the script: -- python train.py [args].",
    )
    role = parser.add_mutually_exclusive_group()
    role.add_argument("--provide", action="store_true", help="offer this machine's device")
    role.add_argument(
        "--consume", action="store_true", help="rent a device and run the script given after --"
    )
    node = parser.add_argument_group("node")
    node.add_argument(
        "--explore",
        action="store_true",
        help="also serve the read-only web explorer of what this node knows "
        "(--explore-host, --explore-port)",
    )
    _add_explore_address(node)
    node.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="identity, config and ledger (default $CUMULUS_DATA_DIR or ~/.cumulus)",
    )
    node.add_argument(
        "--listen",
        default=DEFAULT_LISTEN,
        help=f"libp2p listen multiaddr (default {DEFAULT_LISTEN}), or 'none' for a node "
        "that cannot be dialed and is reached through its --relay nodes",
    )
    node.add_argument(
        "--relay",
        action="append",
        default=[],
        metavar="ADDR",
        help="a node to keep a relay reservation on, so peers reach this one through it "
        "when it cannot be dialed (behind NAT); repeatable",
    )
    node.add_argument(
        "--circuit-duration",
        type=parse_duration,
        default=120,
        metavar="DURATION",
        help="as a relay: how long one relayed connection may last (default 120s)",
    )
    node.add_argument(
        "--circuit-bytes",
        type=_size,
        default=16 * 2**20,
        metavar="SIZE",
        help="as a relay: how much one relayed connection may carry (default 16MiB)",
    )
    node.add_argument(
        "--bootstrap",
        action="append",
        default=[],
        metavar="ADDR",
        help="a known node's /ip4/.../tcp/.../p2p/<id> address; repeatable",
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
    node.add_argument(
        "--no-live", action="store_true", help="plain log lines instead of the live status table"
    )
    node.add_argument("-v", "--verbose", action="store_true", help="log more")
    provide = parser.add_argument_group("--provide")
    provide.add_argument(
        "--price",
        type=parse_price,
        default=parse_price("1.0"),
        help="asking price in credits per share-hour (default 1.0)",
    )
    provide.add_argument(
        "--device",
        type=_device_choice,
        default="auto",
        help="auto: every GPU NVML sees, an offer each, else the CPU; cpu; cuda (GPU 0); "
        "cuda:N; or a list such as cuda:0,cuda:2 (default auto)",
    )
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
    provide.add_argument("--region", default="", help="free-form region hint, e.g. eu-west")
    provide.add_argument(
        "--min-lease",
        type=parse_duration,
        default=0,
        metavar="DURATION",
        help="shortest lease accepted (default none)",
    )
    provide.add_argument(
        "--receipt-interval",
        type=parse_duration,
        default=30,
        metavar="DURATION",
        help="time between usage receipts (default 30s)",
    )
    provide.add_argument(
        "--settle-grace",
        type=parse_duration,
        default=None,
        metavar="DURATION",
        help="how long a receipt may go uncountersigned before the lease pauses; it ends "
        "after twice that (default two receipt intervals)",
    )
    provide.add_argument(
        "--min-consumer-score",
        type=_score,
        default=0.0,
        metavar="SCORE",
        help="refuse consumers whose payment record scores below this, 0..1 (a newcomer "
        "scores 0.45, one unpaid lease drops it to about 0.2; default 0: lease to anyone)",
    )
    provide.add_argument(
        "--leave-timeout",
        type=parse_duration,
        default=30,
        metavar="DURATION",
        help="on SIGTERM or Ctrl-C, how long to wait for consumers to settle before "
        "stopping anyway (default 30s; a second signal stops at once)",
    )
    add_isolation_flags(provide, where="the node's process")
    add_graph_compiler_flag(provide)
    provide.add_argument(
        "--bench-seconds",
        type=float,
        default=0.5,
        help="length of the start-up self benchmark (default 0.5)",
    )
    consume = parser.add_argument_group("--consume")
    consume.add_argument(
        "--gpu",
        action="append",
        default=[],
        metavar="MODEL",
        help="acceptable device model; repeatable (default any)",
    )
    consume.add_argument(
        "--min-vram",
        type=_size,
        default=0,
        metavar="SIZE",
        help="least device memory, e.g. 16GiB (default 0)",
    )
    consume.add_argument(
        "--min-perf", type=int, default=0, help="least performance units (GFLOP/s; default 0)"
    )
    consume.add_argument(
        "--max-price",
        type=parse_price,
        default=parse_price("10"),
        help="most credits per share-hour (default 10)",
    )
    consume.add_argument(
        "--priority",
        choices=["on-demand", "interruptible"],
        default="on-demand",
        help="lease class (default on-demand)",
    )
    consume.add_argument(
        "--duration",
        type=parse_duration,
        default=3600,
        metavar="DURATION",
        help="lease length (default 1h)",
    )
    consume.add_argument(
        "--match-timeout",
        type=parse_duration,
        default=60,
        metavar="DURATION",
        help="how long to wait for a match (default 60s)",
    )
    consume.add_argument(
        "--checkpoint-interval",
        type=parse_duration,
        default=30,
        metavar="DURATION",
        help="time between session checkpoints for failover (default 30s)",
    )
    consume.add_argument(
        "--no-cuda-compat",
        action="store_true",
        help="do not map torch.cuda and device='cuda' to the remote device",
    )
    both = parser.add_argument_group("--provide and --consume")
    both.add_argument(
        "--shares",
        type=int,
        default=None,
        help="share units to offer (default 4) or to lease (default 1)",
    )
    return parser


def _add_explore_address(group) -> None:
    group.add_argument(
        "--explore-host",
        default=DEFAULT_EXPLORE_HOST,
        help=f"address the explorer binds (default {DEFAULT_EXPLORE_HOST}: this machine only)",
    )
    group.add_argument(
        "--explore-port",
        type=_port,
        default=DEFAULT_EXPLORE_PORT,
        help=f"the explorer's port (default {DEFAULT_EXPLORE_PORT}; 0 picks a free one)",
    )


def _add_data_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="the node's data directory (default $CUMULUS_DATA_DIR or ~/.cumulus)",
    )


def build_explore_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cumulus-node explore",
        description="Serve a read-only web explorer of what the node on a data directory "
        "knows: hosts and their scores, evidence, the order book, leases, the mesh. It "
        "follows a running node live, or shows the last state of a stopped one.",
    )
    _add_data_dir(parser)
    _add_explore_address(parser)
    return parser


def build_view_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cumulus-node VIEW",
        description="Show what the node on a data directory knows: status (summary and "
        "leases), peers, offers (live, with host scores), reputation (every host's "
        "reliability score and the evidence behind it), ledger (receipts and disputes) or "
        "logs (the node's log file).",
    )
    parser.add_argument("view", choices=VIEWS)
    _add_data_dir(parser)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "-f", "--follow", action="store_true", help="logs: keep printing new lines (Ctrl-C ends)"
    )
    parser.add_argument(
        "-n", "--lines", type=int, default=50, help="logs: how many last lines to show (50)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    console = Console()
    try:
        if argv and argv[0] in VIEWS:
            return show_view(build_view_parser().parse_args(argv), console)
        if argv and argv[0] == "explore":
            return explore(build_explore_parser().parse_args(argv[1:]), console)
        command: list[str] = []
        if "--" in argv:
            split = argv.index("--")
            argv, command = argv[:split], argv[split + 1 :]
        parser = build_parser()
        _apply_config_defaults(parser, argv)
        args = parser.parse_args(argv)
        _check_args(parser, args, command)
        logging.basicConfig(
            level=logging.INFO if args.verbose else logging.WARNING,
            format="%(levelname)s %(name)s: %(message)s",
        )
        return run_node(args, command, console)
    except NodeConfigError as exc:
        console.print(f"[red]cumulus-node:[/red] {exc}", highlight=False)
        return EXIT_CONFIG
    except NoMatchError as exc:
        console.print(f"[red]cumulus-node: no match:[/red] {exc}", highlight=False)
        return EXIT_NO_MATCH
    except CumulusError as exc:
        console.print(f"[red]cumulus-node:[/red] {exc}", highlight=False)
        return 1
    except KeyboardInterrupt:
        return 130


def _check_args(parser: argparse.ArgumentParser, args, command: list[str]) -> None:
    if args.consume and not command:
        parser.error("--consume needs the script after --, e.g. -- python train.py")
    if command and not args.consume:
        parser.error("a command after -- is only run with --consume")
    if command:
        from .node.consumer import script_command

        try:
            script_command(tuple(command), cuda_compat=True)
        except CumulusError as exc:
            parser.error(str(exc))
    if args.shares is not None and not 1 <= args.shares <= 2**16:
        parser.error("--shares must be between 1 and 65536")
    if args.pool < 0:
        parser.error("--pool must not be negative (0 starts each worker when its lease comes)")
    if args.provide and args.device.startswith("cuda"):
        try:
            hardware.offered_devices(args.device, hardware.detect())
        except ValueError as exc:
            parser.error(str(exc))


def _device_choice(text: str) -> str:
    parts = text.split(",")
    if text in ("auto", "cpu") or all(hardware.gpu_index(part) is not None for part in parts):
        return text
    raise argparse.ArgumentTypeError(
        f"{text!r}: use auto, cpu, cuda, cuda:N or a list such as cuda:0,cuda:1"
    )


def _data_dir(args) -> DataDir:
    return DataDir(args.data_dir or default_data_dir())


#: Flags a config.json may not set: they choose what to run and where the config lives.
_NOT_CONFIGURABLE = {"help", "provide", "consume", "data_dir"}


def _apply_config_defaults(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """Take flag defaults from the data directory's ``config.json``.

    Raises:
        NodeConfigError: The file is not JSON, or names a flag that does not exist.
    """
    early, _ = parser.parse_known_args(argv)
    data = _data_dir(early)
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


def _mesh_config(args, data: DataDir) -> MeshConfig:
    bootstrap = tuple(args.bootstrap)
    listen_addrs = _listen_addrs(args.listen)
    try:
        return MeshConfig(
            listen_addrs=listen_addrs,
            bootstrap=bootstrap, relays=tuple(args.relay), enable_mdns=args.mdns,
            nat=NatConfig(
                circuit_duration=args.circuit_duration, circuit_bytes=args.circuit_bytes
            ),
            announce_interval=args.announce_interval,
            offer_ttl=max(30.0, 3 * args.announce_interval),
        )  # fmt: skip
    except CumulusError as exc:
        raise NodeConfigError(f"bad mesh settings: {exc}") from exc


def run_node(args, command: list[str], console: Console) -> int:
    """Start the node the flags describe and run it until it ends (or Ctrl-C)."""
    data = _data_dir(args)
    data.identity()  # a corrupt key file stops us here, before anything starts
    mesh_config = _mesh_config(args, data)
    with data.locked(), _plain_errors():
        logs.configure(data.path, verbose=args.verbose)
        if args.provide:
            role = functools.partial(_provide, args, data, mesh_config, console)
        elif args.consume:
            role = functools.partial(_consume, args, data, mesh_config, command, console)
        else:
            role = functools.partial(_route, data, mesh_config, console)
        return trio.run(_beside_explorer, args, data, console, role)


async def _beside_explorer(args, data: DataDir, console: Console, role) -> int:
    """Run ``role``; with ``--explore``, serve the explorer beside it until it ends."""
    if not args.explore:
        return await role()
    async with trio.open_nursery() as nursery:
        url = await nursery.start(_explorer, data, args)
        console.print(f"explorer on {url}", highlight=False)
        code = await role()
        nursery.cancel_scope.cancel()
    return code


async def _explorer(data: DataDir, args, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    from .explorer.serve import serve_explorer  # the web stack loads only when asked for

    try:
        await serve_explorer(data, host=args.explore_host, port=args.explore_port,
                             task_status=task_status)  # fmt: skip
    except* OSError as group:  # hypercorn raises from inside its nursery
        raise NodeConfigError(
            f"the explorer cannot listen on {args.explore_host}:{args.explore_port} "
            f"({group.exceptions[0]}); pick another --explore-port (0 takes any free one)"
        ) from None


def explore(args, console: Console) -> int:
    """``cumulus-node explore``: serve the explorer alone, against a data directory."""
    data = _data_dir(args)
    if data.read_state() is None:
        console.print(f"[yellow]no node has run on {data.path} yet; the explorer shows what "
                      "one writes there once it starts[/yellow]", highlight=False)  # fmt: skip
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            url = await nursery.start(_explorer, data, args)
            console.print(f"explorer on {url} (Ctrl-C stops it)", highlight=False)

    with _plain_errors():
        trio.run(run)
    return 0


@contextlib.contextmanager
def _plain_errors() -> Iterator[None]:
    """Raise a lone ``CumulusError`` out of the exception groups trio's nurseries make."""
    try:
        yield
    except BaseExceptionGroup as group:
        leaves = _leaves(group)
        # Our own error first: what else failed did so while the node was shutting
        # down because of it (py-libp2p services can raise as they are torn down).
        ours = [e for e in leaves if isinstance(e, CumulusError | KeyboardInterrupt)]
        if not ours:
            raise
        for other in leaves:
            if other is not ours[0]:
                logging.getLogger("cumulus_p2p.cli").debug(
                    "also raised while stopping: %r", other, exc_info=other
                )
        raise ours[0] from None


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    found: list[BaseException] = []
    for exc in group.exceptions:
        found.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return found


def _listen_addrs(listen: str) -> tuple[str, ...]:
    """``--listen`` as the node's listen addresses: none, or one valid multiaddr."""
    import multiaddr

    if listen == "none":
        return ()
    try:
        multiaddr.Multiaddr(listen)
    except Exception as exc:  # noqa: BLE001 - multiaddr raises several unrelated types
        raise NodeConfigError(
            f"--listen {listen!r} is not a multiaddr (e.g. /ip4/0.0.0.0/tcp/4001)"
        ) from exc
    return (listen,)


async def _route(data: DataDir, mesh_config: MeshConfig, console: Console) -> int:
    from .node.runtime import open_runtime

    async with open_runtime(data.identity(), data, mesh_config) as runtime:
        _print_addrs(console, runtime.mesh.addrs)
        while True:
            data.write_state(runtime.snapshot() | {"role": "bootstrap", "leases": []})
            await trio.sleep(1.0)


def _print_addrs(console: Console, addrs) -> None:
    for addr in addrs:
        console.print(f"listening on {addr}", highlight=False, soft_wrap=True)
    if not addrs:
        console.print("listening on no address: reached through its --relay nodes only")
    sys.stdout.flush()


async def _provide(args, data: DataDir, mesh_config: MeshConfig, console: Console) -> int:
    from .node.provider import ProviderOptions, run_provider

    found = hardware.detect()
    if found.notice:
        console.print(f"[yellow]notice:[/yellow] {found.notice}", highlight=False)
    devices = await _benchmarked(hardware.offered_devices(args.device, found), args, console)
    options = ProviderOptions(
        devices=devices, shares=args.shares or 4, price=args.price,
        min_lease_s=args.min_lease, region=args.region, session_host=args.session_host,
        session_port=args.session_port, advertise_host=args.advertise_host,
        receipt_interval=args.receipt_interval, settle_grace=args.settle_grace,
        min_consumer_score=args.min_consumer_score, leave_timeout=args.leave_timeout,
        workers=args.workers, pool=args.pool,
        graph_compiler=GraphCompiler(args.graph_compiler),
    )  # fmt: skip
    live = _live(console, args.no_live)

    def ready(provider) -> None:
        _print_addrs(console, provider.runtime.mesh.addrs)
        offered = ", ".join(f"{d.facts.model} ({d.perf_units} perf units)" for d in devices)
        each = " each" if len(devices) > 1 else ""
        console.print(
            f"providing {offered}: {options.shares} shares{each} at "
            f"{views.credits(options.price)}/share-hour; sessions on "
            f"{', '.join(provider.current_endpoints())}",
            highlight=False,
        )
        sys.stdout.flush()
        if live is not None:
            live.start()

    def tick(provider) -> None:
        if live is not None:
            live.update(views.status_table(provider.snapshot()))

    def leaving(text: str) -> None:
        console.print(text, highlight=False)
        sys.stdout.flush()

    try:
        await run_provider(
            data, mesh_config, options, on_ready=ready, on_tick=tick, on_leaving=leaving,
            handle_signals=True,
        )  # fmt: skip
    finally:
        if live is not None:
            live.stop()
    return 0


async def _benchmarked(found, args, console: Console):
    """Each device to offer with its self-benchmark, one device at a time."""
    from .node.provider import OfferedDevice

    devices = []
    with console.status("self benchmark...") as status:
        for facts in found:
            status.update(f"self benchmark of {facts.target} ({facts.model})...")
            bench = functools.partial(
                hardware.self_benchmark, facts.target, seconds=args.bench_seconds
            )
            perf = await trio.to_thread.run_sync(bench)
            devices.append(OfferedDevice(facts, perf))
    return tuple(devices)


def _live(console: Console, disabled: bool) -> Live | None:
    if disabled or not console.is_terminal:
        return None
    return Live(console=console, refresh_per_second=2, transient=False)


async def _consume(args, data, mesh_config, command: list[str], console: Console) -> int:
    from .node.consumer import ConsumerOptions, run_consumer

    options = ConsumerOptions(
        command=tuple(command), gpu_models=tuple(args.gpu), min_vram_mib=args.min_vram // 2**20,
        min_perf=args.min_perf, max_price=args.max_price,
        priority=PriorityClass.INTERRUPTIBLE if args.priority == "interruptible"
        else PriorityClass.ON_DEMAND,
        shares=args.shares or 1, duration_s=args.duration, match_timeout=args.match_timeout,
        cuda_compat=not args.no_cuda_compat, checkpoint_interval=args.checkpoint_interval,
    )  # fmt: skip
    announced = [False]
    status = console.status("joining the mesh...")
    status.start()

    def tick(consumer) -> None:
        if consumer.status == "matching":
            offers = sum(1 for _ in consumer.runtime.book.offers())
            status.update(f"waiting for a match: {offers} offer(s) on the book")
        elif consumer.held and not announced[0]:
            announced[0] = True
            status.stop()
            held = consumer.held[-1]
            console.print(
                f"cumulus: leased {held.proposal.shares} share(s) from "
                f"{views.short(held.proposal.host)} at {views.credits(held.proposal.price)}"
                "/share-hour; session on "
                f"{', '.join(held.endpoints)}; running {' '.join(command)}",
                highlight=False, soft_wrap=True,
            )
            sys.stdout.flush()

    try:
        consumer = await run_consumer(data, mesh_config, options, on_tick=tick)
    finally:
        status.stop()
    console.print(views.leases_table([r for r in consumer.snapshot()["leases"]], "consumer"))
    console.print(
        f"total cost: {views.credits(consumer.cost())} credits "
        f"({len(list(consumer.desk.ledger.entries()))} receipts in the ledger)",
        highlight=False,
    )
    return consumer.exit_code if consumer.exit_code is not None else 1


def show_view(args, console: Console) -> int:
    """``cumulus-node status|peers|offers|reputation|ledger``."""
    data = _data_dir(args)
    if args.view == "logs":
        return _show_logs(args, data)
    if args.view == "ledger":
        ledger = data.ledger()
        entries = list(ledger.entries())
        if args.json:
            print(json.dumps([model.entry_json(e) for e in entries], indent=1))
        else:
            console.print(views.ledger_table(entries))
            disputes = list(ledger.disputes())
            if disputes:
                console.print(views.disputes_table(disputes))
        return 0
    state = data.read_state()
    if state is None:
        raise NodeConfigError(
            f"no node has run on {data.path} yet: start one with cumulus-node --provide, "
            "--consume or plain cumulus-node"
        )
    if not data.is_locked():  # on stderr with --json: stdout stays one JSON document
        (Console(stderr=True) if args.json else console).print(
            f"[yellow]the node on {data.path} is not running; this is what it "
            "knew when it stopped[/yellow]",
            highlight=False,
        )
    shown = {
        "status": lambda s: s,
        "peers": model.peers,
        "offers": lambda s: model.book(s)["offers"],
        "reputation": lambda s: s.get("scores", []),
    }[args.view](state)
    if args.json:  # the explorer's API serves the same (explorer/model.py)
        print(json.dumps(shown, indent=1))
        return 0
    render = {
        "status": views.status_table,
        "peers": views.peers_table,
        "offers": views.offers_table,
        "reputation": views.scores_table,
    }[args.view]
    console.print(render(shown))
    return 0


def _show_logs(args, data: DataDir) -> int:
    if args.json:
        raise NodeConfigError("logs prints the log file as it is: --json does not apply")
    path = data.path / logs.LOG_FILE
    if not path.exists() and not args.follow:
        raise NodeConfigError(f"no log at {path} yet: a node started on {data.path} writes one")
    lines, end = logs.tail(path, max(0, args.lines))
    sys.stdout.writelines(lines)
    sys.stdout.flush()
    if args.follow:
        try:
            for line in logs.follow(path, start=end if path.exists() else None):
                sys.stdout.write(line)
                sys.stdout.flush()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
