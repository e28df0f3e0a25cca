"""A pool of CPU providers on loopback whose lease holder is killed and restarted.

What ``tests/test_consumer_churn.py`` and ``benchmarks/chaos_bench.py`` share: a
bootstrap node, one provider per name (each on its own data directory, at its own
price), a consumer leasing through them, and churn: the provider holding the consumer's
lease is SIGKILLed and started again on the same data directory (the same key, the same
ledger), as a rebooted rig would be.

    with open_provider_pool(tmp_path, {"a": "0.4", "b": "0.5"}) as pool:
        consumer = pool.start_consumer("--checkpoint-interval", "1s", command=script)
        state = consumer.wait_for_state(lambda s: running_on_lease(s, 1))
        name = pool.holder(state)
        pool.kill(name)
        pool.restart(name).wait_for("providing", timeout=STARTUP_S)
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from .nodes import (
    ANNOUNCE_INTERVAL,
    LOOPBACK_LISTEN,
    NodeProcess,
    provider_command,
    start_consumer,
    start_node,
    start_process,
    stop_all,
)

#: Seconds a provider may take to start: on a loaded 2-core machine a node took over 30 s
#: to import torch, benchmark its device and join.
STARTUP_S = 180.0


@dataclass
class ProviderPool:
    """The nodes ``open_provider_pool`` started, by name.

    Attributes:
        root: The directory holding each node's data directory (``root / name``).
        prices: Each provider's ``--price``, by name.
        boot: The bootstrap node.
        providers: The provider running under each name (replaced on ``restart``).
        name_of: Each provider's name, by peer id (a restart keeps the peer id).
        consumer: The consumer ``start_consumer`` started, if any.
        announce_interval: Each node's ``--announce-interval``.
    """

    root: Path
    prices: Mapping[str, str]
    boot: NodeProcess
    providers: dict[str, NodeProcess] = field(default_factory=dict)
    name_of: dict[str, str] = field(default_factory=dict)
    consumer: NodeProcess | None = None
    announce_interval: str = ANNOUNCE_INTERVAL

    def start_provider(self, name: str) -> NodeProcess:
        """Start provider ``name`` on its data directory without waiting for it; wait for
        its ``providing`` line (up to ``STARTUP_S``) before counting on it."""
        command = provider_command(
            self.root / name,
            self.boot.addr,
            "--price",
            self.prices[name],
            announce_interval=self.announce_interval,
        )
        self.providers[name] = start_process(command, self.root / name, listens=False)
        return self.providers[name]

    def start_consumer(
        self, *args: str, command: list[str], env: dict | None = None
    ) -> NodeProcess:
        """A consumer on ``root / "consumer"`` running ``python *command`` (``args`` add
        flags; see ``nodes.start_consumer``); stopped with the pool."""
        self.consumer = start_consumer(
            self.root / "consumer",
            self.boot.addr,
            *args,
            command=command,
            env=env,
            announce_interval=self.announce_interval,
        )
        return self.consumer

    def holder(self, state: Mapping) -> str:
        """The name of the provider holding the last lease in a consumer's ``state``."""
        return self.name_of[state["leases"][-1]["host"]]

    def kill(self, name: str) -> None:
        """SIGKILL provider ``name`` and reap it: no goodbye, no settling."""
        self.providers[name].proc.kill()
        self.providers[name].proc.wait()

    def restart(self, name: str) -> NodeProcess:
        """Start provider ``name`` again on the same data directory (``start_provider``)."""
        return self.start_provider(name)

    def stop(self) -> None:
        """Stop every node, the consumer first (its leases settle while hosts are up), then
        the others together."""
        if self.consumer:
            self.consumer.stop()
        stop_all([*self.providers.values(), self.boot])


@contextmanager
def open_provider_pool(
    root: Path,
    prices: Mapping[str, str],
    *,
    startup_s: float = STARTUP_S,
    announce_interval: str = ANNOUNCE_INTERVAL,
) -> Iterator[ProviderPool]:
    """A bootstrap node and one CPU provider per name in ``prices``, each providing and
    known by peer id when this yields; every node is stopped on exit. The providers and
    the consumer re-announce every ``announce_interval`` seconds.

    Raises:
        TimeoutError: a provider did not start within ``startup_s``.
        RuntimeError: a provider exited while starting.
    """
    boot = start_node(root / "boot", "--listen", LOOPBACK_LISTEN)
    pool = ProviderPool(root, prices, boot, announce_interval=announce_interval)
    try:
        for name in prices:
            pool.start_provider(name)
        for name, node in pool.providers.items():
            node.wait_for("providing", timeout=startup_s)
            pool.name_of[node.wait_for_state(lambda s: "peer_id" in s)["peer_id"]] = name
        yield pool
    finally:
        pool.stop()


def running_on_lease(state: Mapping, leases: int) -> bool:
    """A consumer's ``state`` shows its session running on lease number ``leases`` (or a
    later one): the lease is held and the shim reported its path to the host."""
    rows = state.get("leases", [])
    return len(rows) >= leases and rows[-1]["state"] == "held" and bool(rows[-1]["path"])
