"""Run a node in the role its flags give: provide, consume, or route (a bootstrap node).

torch loads only for ``--provide`` (its benchmark and executor): a boot node and a
consumer's node import nothing that imports it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys

import trio
from rich.console import Console
from rich.live import Live

from .._errors import CumulusError, NodeConfigError
from ..dht import MeshConfig
from ..dht.nat import NatConfig
from ..host.options import GraphCompiler
from ..market import BookLimits, PriorityClass
from ..market.hostchoice import BackoffPolicy
from ..node import hardware, logs, views
from ..node.datadir import DataDir
from ._exits import plain_errors
from ._explore import serve_explorer
from ._flags import data_dir


def run_node(args, script: list[str], console: Console) -> int:
    """Start the node the flags describe and run it until it ends (or Ctrl-C)."""
    options = _consumer_options(args, script) if args.consume else None
    # Forked first: while this process runs one thread, and before it configures anything
    # the script would inherit (logging, the data directory's lock).
    with _prestarted(options) as prestarted:
        logging.basicConfig(
            level=logging.INFO if args.verbose else logging.WARNING,
            format="%(levelname)s %(name)s: %(message)s",
        )
        data = data_dir(args)
        data.identity()  # a corrupt key file stops us here, before anything starts
        mesh_config = _mesh_config(args)
        with data.locked(), plain_errors():
            logs.configure(data.path, verbose=args.verbose)
            if args.provide:
                role = functools.partial(_provide, args, data, mesh_config, console)
            elif options is not None:
                role = functools.partial(
                    _consume, args, data, mesh_config, options, prestarted, console
                )
            else:
                role = functools.partial(_route, data, mesh_config, console, _book_limits(args))
            return trio.run(_beside_explorer, args, data, console, role)


def _prestarted(options) -> contextlib.AbstractContextManager:
    """The script's interpreter, forked now to import torch while the node matches
    (``node.prestart``); None for a node that runs no script under the shim here."""
    if options is None:
        return contextlib.nullcontext()
    from ..node.consumer import script_command
    from ..node.prestart import SHIM_IMPORTS, prestarted

    argv = script_command(options.command, cuda_compat=options.cuda_compat, native=options.native)
    if argv[1:3] != ["-m", "cumulus_p2p.shim"]:  # torchrun: its ranks start afresh anyway
        return contextlib.nullcontext()
    device = "cumulus_p2p.native" if options.native else "cumulus_p2p.remote"
    return prestarted(argv, (*SHIM_IMPORTS, device))


async def _beside_explorer(args, data: DataDir, console: Console, role) -> int:
    """Run ``role``; with ``--explore``, serve the explorer beside it until it ends."""
    if not args.explore:
        return await role()
    async with trio.open_nursery() as nursery:
        url = await nursery.start(serve_explorer, data, args)
        console.print(f"explorer on {url}", highlight=False)
        code = await role()
        nursery.cancel_scope.cancel()
    return code


def _mesh_config(args) -> MeshConfig:
    listen_addrs = _listen_addrs(args.listen)
    try:
        nat = NatConfig(circuit_duration=args.circuit_duration, circuit_bytes=args.circuit_bytes)
        return MeshConfig(
            listen_addrs=listen_addrs,
            bootstrap=tuple(args.bootstrap),
            relays=tuple(args.relay),
            enable_mdns=args.mdns,
            nat=nat,
            announce_interval=args.announce_interval,
            offer_ttl=max(30.0, 3 * args.announce_interval),
        )
    except CumulusError as exc:
        raise NodeConfigError(f"bad mesh settings: {exc}") from exc


def _book_limits(args) -> BookLimits:
    """The order book's bounds: ``--max-offers-per-author``, ``--max-book-orders``."""
    try:
        return BookLimits(
            max_orders_per_author=args.max_offers_per_author,
            max_versions_per_author=max(64, 8 * args.max_offers_per_author),
            max_orders=args.max_book_orders,
        )
    except ValueError as exc:
        raise NodeConfigError(f"bad order book bounds: {exc}") from exc


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


def _print_addrs(console: Console, addrs) -> None:
    for addr in addrs:
        console.print(f"listening on {addr}", highlight=False, soft_wrap=True)
    if not addrs:
        console.print("listening on no address: reached through its --relay nodes only")
    sys.stdout.flush()


async def _route(
    data: DataDir, mesh_config: MeshConfig, console: Console, book_limits: BookLimits
) -> int:
    from ..node.runtime import open_runtime

    identity = data.identity()
    async with open_runtime(identity, data, mesh_config, book_limits=book_limits) as runtime:
        _print_addrs(console, runtime.mesh.addrs)
        while True:
            data.write_state(runtime.snapshot() | {"role": "bootstrap", "leases": []})
            await trio.sleep(1.0)


async def _provide(args, data: DataDir, mesh_config: MeshConfig, console: Console) -> int:
    from ..node.provider import run_provider

    found = hardware.detect()
    if found.notice:
        console.print(f"[yellow]notice:[/yellow] {found.notice}", highlight=False)
    devices = await _benchmarked(hardware.offered_devices(args.device, found), args, console)
    options = _provider_options(args, devices)
    screen = _ProviderScreen(console, options, live=_live(console, args.no_live))
    try:
        await run_provider(
            data,
            mesh_config,
            options,
            on_ready=screen.ready,
            on_tick=screen.tick,
            on_leaving=screen.leaving,
            handle_signals=True,
            book_limits=_book_limits(args),
        )
    finally:
        if screen.live is not None:
            screen.live.stop()
    return 0


def _provider_options(args, devices):
    from ..node.provider import ProviderOptions

    return ProviderOptions(
        devices=devices,
        shares=args.shares or 4,
        min_lease_s=args.min_lease,
        graph_compiler=GraphCompiler(args.graph_compiler),
        contend_shares=_contend_shares(args),
        **_as_given(args, _PROVIDER_AS_GIVEN),
    )


#: ``ProviderOptions`` fields that take their flag's value as it was given.
_PROVIDER_AS_GIVEN = (
    "price",
    "region",
    "session_host",
    "session_port",
    "advertise_host",
    "receipt_interval",
    "settle_grace",
    "min_consumer_score",
    "leave_timeout",
    "workers",
    "pool",
    "blob_cap",
    "ram_tier",
    "storage_price",
    "storage_gib",
    "contend_price",
    "overcommit",
    "peer_links",
)


def _as_given(args, names: tuple[str, ...]) -> dict:
    """The flags whose destinations are ``names``, by name, as they were given."""
    return {name: getattr(args, name) for name in names}


def _contend_shares(args) -> int:
    """``--contend-shares``, or as many as the on-demand shares when a contend price is set."""
    if args.contend_shares is not None:
        return args.contend_shares
    return (args.shares or 4) if args.contend_price else 0


class _ProviderScreen:
    """What a provider shows: its addresses and offer once ready, then a live table."""

    def __init__(self, console: Console, options, live: Live | None) -> None:
        self.console, self.options, self.live = console, options, live

    def ready(self, provider) -> None:
        _print_addrs(self.console, provider.runtime.mesh.addrs)
        devices = self.options.devices
        offered = ", ".join(f"{d.facts.model} ({d.perf_units} perf units)" for d in devices)
        each = " each" if len(devices) > 1 else ""
        self.console.print(
            f"providing {offered}: {self.options.sold_shares} shares{each}"
            f"{self._overcommitted()} at "
            f"{views.credits(self.options.price)}/share-hour{self._contending()}"
            f"{self._standbys()}; sessions "
            f"on {', '.join(provider.current_endpoints())}",
            highlight=False,
        )
        sys.stdout.flush()
        if self.live is not None:
            self.live.start()

    def _standbys(self) -> str:
        gib = self.options.storage_gib
        if not gib:
            return ""
        price = views.credits(self.options.storage_price)
        return f"; keeping standbys' checkpoints: {gib} GiB at {price}/GiB-hour"

    def _overcommitted(self) -> str:
        factor = self.options.overcommit
        return f" ({factor:g}x the memory, paged out when idle)" if factor > 1 else ""

    def _contending(self) -> str:
        price, shares = self.options.contend_price, self.options.contend_shares
        if not price or not shares:
            return ""
        return f" (contending: {shares} more shares at {views.credits(price)})"

    def tick(self, provider) -> None:
        if self.live is not None:
            self.live.update(views.status_table(provider.snapshot()))

    def leaving(self, text: str) -> None:
        self.console.print(text, highlight=False)
        sys.stdout.flush()


async def _benchmarked(found, args, console: Console):
    """Each device to offer with its self-benchmark, one device at a time."""
    from ..node.provider import OfferedDevice

    if args.perf_units is not None:  # the host's own figure: no benchmark to run
        return tuple(OfferedDevice(facts, args.perf_units) for facts in found)
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


async def _consume(args, data, mesh_config, options, prestarted, console: Console) -> int:
    from ..node.job import run_consumer

    screen = _ConsumerScreen(console, list(options.command))
    try:
        consumer = await run_consumer(
            data,
            mesh_config,
            options,
            on_tick=screen.tick,
            book_limits=_book_limits(args),
            prestarted=prestarted,
        )
    finally:
        screen.status.stop()
    console.print(views.leases_table(list(consumer.snapshot()["leases"]), "consumer"))
    console.print(
        f"total cost: {views.credits(consumer.cost())} credits "
        f"({len(list(consumer.desk.ledger.entries()))} receipts in the ledger)",
        highlight=False,
    )
    return consumer.exit_code if consumer.exit_code is not None else 1


def _native_device(wanted: bool | None) -> bool:
    """Whether the script runs on the native device: by default where it is built or can
    be (else the Python device, said on stderr); with ``--native``, or an error.

    Raises:
        NodeConfigError: ``--native`` where the device can neither be loaded nor built.
    """
    if wanted is False:
        return False
    from .. import native

    reason = None if native.is_fresh() else native.missing_toolchain()
    if reason is None:
        return True
    if wanted:
        raise NodeConfigError(f"--native: the native device cannot be built here: {reason}")
    print(
        f"cumulus-node: the native device cannot be built here ({reason}); "
        "the script runs on the Python device",
        file=sys.stderr,
    )
    return False


def _consumer_options(args, script: list[str]):
    from ..node.consumer import ConsumerOptions

    return ConsumerOptions(
        command=tuple(script),
        gpu_models=tuple(args.gpu),
        min_vram_mib=args.min_vram // 2**20,
        priority=PriorityClass[args.priority.upper().replace("-", "_")],
        max_overcommit_pct=round(100 * args.max_overcommit),
        shares=args.shares or 1,
        duration_s=args.duration,
        cuda_compat=not args.no_cuda_compat,
        # The native device has no collectives: a job of several GPUs runs on the other.
        native=args.gpus == 1 and _native_device(args.native),
        backoff=BackoffPolicy(base_s=args.host_backoff),
        **_as_given(args, _CONSUMER_AS_GIVEN),
    )


#: ``ConsumerOptions`` fields that take their flag's value as it was given.
_CONSUMER_AS_GIVEN = (
    "min_perf",
    "max_price",
    "pay_bid",
    "match_timeout",
    "wait_for_host",
    "checkpoint_interval",
    "checkpoint_to",
    "standby_gib",
    "private",
    "max_storage_price",
    "gpus",
)


class _ConsumerScreen:
    """What a consumer shows: a spinner while it matches, then the lease it holds."""

    def __init__(self, console: Console, script: list[str]) -> None:
        self.console, self.script = console, script
        self.announced = False
        self.status = console.status("joining the mesh...")
        self.status.start()

    def tick(self, consumer) -> None:
        if self.announced:
            return
        if consumer.status == "running" and consumer.held:
            self.announced = True
            self.status.stop()
            for held in consumer.held:  # one lease per rank of a job of several GPUs
                self._announce(held)
        elif consumer.status == "matching":
            offers = sum(1 for _ in consumer.runtime.book.offers())
            self.status.update(f"waiting for a match: {offers} offer(s) on the book")
        else:  # held for want of a usable host, with the reason and the deadline
            self.status.update(consumer.status)

    def _announce(self, held) -> None:
        self.console.print(
            f"cumulus: leased {held.proposal.shares} share(s) from "
            f"{views.short(held.proposal.host)} at {views.credits(held.proposal.price)}"
            "/share-hour; session on "
            f"{', '.join(held.endpoints)}; running {' '.join(self.script)}",
            highlight=False,
            soft_wrap=True,
        )
        sys.stdout.flush()
