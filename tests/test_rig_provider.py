"""A provider with several devices offers each one, and a lease runs on its offer's device.

The rig is ``cumulus_p2p.testing.rig``: the real provider node offering two devices, each
this machine's CPU under its own index with an executor of its own (no GPU here).
"""

from __future__ import annotations

from pathlib import Path

from cumulus_p2p.testing.nodes import (
    LOOPBACK_LISTEN,
    final_json,
    local_final_loss,
    start_consumer,
    start_node,
    start_rig,
)

SCRIPTS = Path(__file__).parent / "scripts"


def test_a_two_device_provider_serves_one_lease_on_each_device_at_once(tmp_path):
    boot = start_node(tmp_path / "boot", "--listen", LOOPBACK_LISTEN)
    rig = start_rig(tmp_path / "rig", boot.addr, devices=2, shares=1)
    # Both jobs hold after step 5 until both leases are seen running at once.
    gate = tmp_path / "gate"
    script = [str(SCRIPTS / "gated_train.py"), "20", "5", str(gate)]
    consumers = []
    try:
        rig.wait_for("providing")
        for name in ("first", "second"):
            consumer = start_consumer(tmp_path / name, boot.addr, command=script)
            consumers.append(consumer)
            consumer.wait_for("holding at step 5", timeout=120)
        both = rig.wait_for_state(lambda s: sum(d["sessions"] for d in s["devices"]) == 2)
        assert [d["sessions"] for d in both["devices"]] == [1, 1]
        assert both["shares_free"] == 0
        running = [row for row in both["leases"] if row["state"] == "running"]
        assert sorted(row["offer_id"] for row in running) == ["device0", "device1"]
        gate.touch()
        for consumer in consumers:
            assert consumer.proc.wait(timeout=120) == 0, consumer.output()
        after = rig.wait_for_state(lambda s: s["shares_free"] == s["shares_total"] == 2)
        assert [d["sessions"] for d in after["devices"]] == [0, 0]
    finally:
        for node in [*consumers, rig, boot]:
            node.stop()
    expected = local_final_loss(["-m", "cumulus_p2p.demo_train", "--steps", "20"])
    assert [final_json(c.lines)["final_loss"] for c in consumers] == [expected, expected], [
        c.output() for c in consumers
    ]
