"""On a real network the session takes the direct path with no flags but --bootstrap
(issue 17).

Two network namespaces joined by a veth pair stand for two machines on a LAN: a
bootstrap node and a provider in one (10.201.0.1), a consumer in the other
(10.201.0.2). Neither node is told any address but the bootstrap's: the provider's
session channel listens where its libp2p listener does (every interface, by default)
and advertises its interfaces' addresses, and the consumer's session dials one
directly. Where namespaces cannot be created (not root), the same runs on two
loopback addresses, with explicit --listen flags, and says so.
"""

from __future__ import annotations

import json
import warnings
from contextlib import contextmanager

import pytest

from cumulus_p2p.testing.netns import Host, NamespacesUnavailable, two_hosts
from cumulus_p2p.testing.nodes import (
    assert_local_final_loss,
    demo_reference,
    node_command,
    start_process,
)

# Starts real cumulus-node processes: scripts/test --fast skips it.
pytestmark = pytest.mark.slow

SCRIPT = ["-m", "cumulus_p2p.demo_train", "--steps", "20", "--log-every", "10"]
FAST = ["--announce-interval", "1", "--no-live"]


class Loopback(Host):
    """A 'machine' that is only another loopback address (the fallback)."""

    def command(self, *args: str) -> list[str]:
        return list(args)


@contextmanager
def two_machines():
    """``(a, b, flags_a, flags_b)``: the machines, and the flags their nodes need."""
    try:
        with two_hosts() as (a, b):
            yield a, b, [], []
        return
    except NamespacesUnavailable as why:
        warnings.warn(
            f"no network namespaces here ({why}); using 127.0.0.2 and 127.0.0.3", stacklevel=1
        )
    a, b = Loopback("", "127.0.0.2"), Loopback("", "127.0.0.3")
    yield a, b, ["--listen", f"/ip4/{a.address}/tcp/0"], ["--listen", f"/ip4/{b.address}/tcp/0"]


def test_a_consumer_on_another_machine_reaches_the_provider_directly(tmp_path):
    with two_machines() as (a, b, provider_listen, consumer_listen):
        boot = start_process(
            a.command(
                *node_command(
                    "--data-dir", str(tmp_path / "boot"), "--listen", f"/ip4/{a.address}/tcp/4002"
                )
            ),
            tmp_path / "boot",
            listens=True,
        )
        provider = start_process(
            a.command(
                *node_command(
                    "--data-dir",
                    str(tmp_path / "provider"),
                    "--provide",
                    "--bootstrap",
                    boot.addr,
                    "--receipt-interval",
                    "1s",
                    "--bench-seconds",
                    "0.1",
                    *FAST,
                    *provider_listen,
                )
            ),
            tmp_path / "provider",
            listens=True,
        )
        try:
            provider.wait_for("providing")
            consumer = start_process(
                b.command(
                    *node_command(
                        "--data-dir",
                        str(tmp_path / "consumer"),
                        "--consume",
                        "--bootstrap",
                        boot.addr,
                        *FAST,
                        *consumer_listen,
                        "--",
                        "python",
                        *SCRIPT,
                    )
                ),
                tmp_path / "consumer",
                listens=False,
            )
            assert consumer.proc.wait(timeout=240) == 0, consumer.output()
        finally:
            for node in (provider, boot):
                node.stop()
    state = json.loads((tmp_path / "consumer" / "state.json").read_text())
    (lease,) = state["leases"]
    assert lease["path"].startswith(f"direct to {a.address}:"), lease
    assert state["ops"] > 0  # what the job's session sent, for its status
    assert "going through libp2p" not in consumer.output()
    assert_local_final_loss(consumer, demo_reference(20))
