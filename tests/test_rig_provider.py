"""A provider with several devices offers each one, and a lease runs on its offer's device.

The rig is ``cumulus_p2p.testing.rig``, or the same ``Provider`` in this process: the
real provider node offering two devices, each this machine's CPU under its own index
with an executor of its own (no GPU here).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import trio

from cumulus_p2p.dht import MeshConfig
from cumulus_p2p.host.executor import Executor, ExecutorConfig
from cumulus_p2p.host.health import DeviceHealth
from cumulus_p2p.node.datadir import DataDir
from cumulus_p2p.node.hardware import cpu_facts
from cumulus_p2p.node.provider import OfferedDevice, Provider, ProviderOptions
from cumulus_p2p.node.runtime import open_runtime
from cumulus_p2p.testing import nodes

# Starts real cumulus-node processes: scripts/test --fast skips it.
pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).parent / "scripts"


def test_a_two_device_provider_serves_one_lease_on_each_device_at_once(tmp_path):
    boot = nodes.start_node(tmp_path / "boot", "--listen", nodes.LOOPBACK_LISTEN)
    rig = nodes.start_rig(tmp_path / "rig", boot.addr, devices=2, shares=1)
    # Both jobs hold after step 5 until both leases are seen running at once.
    gate = tmp_path / "gate"
    script = [str(SCRIPTS / "gated_train.py"), "10", "5", str(gate)]
    consumers = []
    try:
        rig.wait_for("providing")
        # Together: the one that proposes to the device the other has just leased is
        # refused (the offer is full) and leases the other device, and no device is
        # leased twice however the rig's announcements fall.
        for name in ("first", "second"):
            consumers.append(nodes.start_consumer(tmp_path / name, boot.addr, command=script))
        for consumer in consumers:
            consumer.wait_for("holding at step 5", timeout=120)
        both = rig.wait_for_state(lambda s: sum(d["sessions"] for d in s["devices"]) == 2)
        assert [d["sessions"] for d in both["devices"]] == [1, 1]
        assert both["shares_free"] == 0
        running = [row for row in both["leases"] if row["state"] == "running"]
        assert sorted(row["offer_id"] for row in running) == ["device0", "device1"]
        gate.touch()
        with nodes.LocalRun(nodes.demo_reference(10)) as local:
            for consumer in consumers:
                assert consumer.proc.wait(timeout=120) == 0, consumer.output()
            after = rig.wait_for_state(lambda s: s["shares_free"] == s["shares_total"] == 2)
            assert [d["sessions"] for d in after["devices"]] == [0, 0]
            expected = local.final_loss()
    finally:
        nodes.stop_all([*consumers, rig, boot])
    assert [nodes.final_json(c.lines)["final_loss"] for c in consumers] == [expected, expected], [
        c.output() for c in consumers
    ]


async def test_an_unhealthy_device_withdraws_only_its_own_offer(tmp_path):
    devices = tuple(OfferedDevice(dataclasses.replace(cpu_facts(), index=i), 100) for i in (0, 1))
    options = ProviderOptions(devices=devices, shares=2, price=1000)
    executors = [Executor(ExecutorConfig(device="cpu")) for _ in devices]
    data = DataDir(tmp_path)
    config = MeshConfig(listen_addrs=("/ip4/127.0.0.1/tcp/0",))
    async with open_runtime(data.identity(), data, config) as runtime:
        provider = Provider(runtime, options, executors)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(provider.keep_offer_current)
            await wait_for_offers(provider, {"device0": True, "device1": True})
            executors[1].health = DeviceHealth(False, "the device check failed")
            await wait_for_offers(provider, {"device0": True, "device1": False})
            assert provider.snapshot()["device_health"] == "cpu: the device check failed"
            executors[1].health = DeviceHealth()
            await wait_for_offers(provider, {"device0": True, "device1": True})
            nursery.cancel_scope.cancel()


async def wait_for_offers(provider: Provider, announced: dict[str, bool]) -> None:
    with trio.fail_after(10):
        while {k: s.announced for k, s in provider.served.items()} != announced:
            await trio.sleep(0.05)
