"""Specs for the provider's status (``Provider.snapshot``): a read that changes nothing.

The provider here has no mesh: its runtime and executor are stand-ins holding just what
status reads, so the spec is about the rows, not the network.
"""

from __future__ import annotations

from types import SimpleNamespace

from cumulus_p2p.host.session import SessionStats
from cumulus_p2p.identity import NodeIdentity
from cumulus_p2p.market import Meter
from cumulus_p2p.market.lease_state import LeaseEvent
from cumulus_p2p.node.hardware import DeviceFacts
from cumulus_p2p.node.payment import ActiveLease
from cumulus_p2p.node.provider import FINISHED_KEPT, OfferedDevice, Provider, ProviderOptions
from cumulus_p2p.reputation.testing import Minter

NOW = 1_700_000_000.0
HOST, CONSUMER = NodeIdentity.generate(), NodeIdentity.generate()
DEVICE = OfferedDevice(DeviceFacts("cpu", 0, "cpu", 4096, None, ""), perf_units=100)


class StandInExecutor:
    """Reports one session's stats, as ``Executor.session_stats`` does."""

    def __init__(self) -> None:
        self.sessions: dict = {}
        self.health = SimpleNamespace(healthy=True, reason="")
        self.stats = SessionStats(ops=0, bytes_in_use=1024)

    def session_stats(self, owner: bytes) -> SessionStats | None:
        return self.stats if owner == CONSUMER.public_key else None


def provider_with_a_lease() -> tuple[Provider, StandInExecutor, ActiveLease]:
    runtime = SimpleNamespace(
        identity=HOST,
        data=SimpleNamespace(ledger=lambda: None),
        clock=lambda: NOW,
        snapshot=lambda: {"peer_id": HOST.peer_id.to_base58()},
    )
    executor = StandInExecutor()
    options = ProviderOptions(devices=(DEVICE,), shares=4, price=1000)
    provider = Provider(runtime, options, [executor])
    lease = Minter().lease(CONSUMER, HOST, start=NOW, offer_id=DEVICE.offer_id)
    active = ActiveLease(lease, lease.proposal, Meter(HOST, lease.proposal), NOW)
    provider.active[lease.proposal.lease_id] = active
    return provider, executor, active


def test_two_reads_in_a_row_give_the_same_rows():
    provider, executor, _ = provider_with_a_lease()
    executor.stats.ops = 100
    provider.sample_ops(10.0)
    executor.stats.ops = 160
    provider.sample_ops(11.0)
    first, second = provider.snapshot(), provider.snapshot()
    assert first == second
    (row,) = first["leases"]
    assert (row["ops"], row["ops_per_s"], row["state"]) == (160, 60.0, "running")


def test_the_op_rate_follows_the_samples_not_the_readers():
    provider, executor, _ = provider_with_a_lease()
    executor.stats.ops = 100
    provider.sample_ops(10.0)
    assert provider.snapshot()["leases"][0]["ops_per_s"] == 0.0  # one sample: no rate yet
    executor.stats.ops = 130
    provider.sample_ops(12.0)
    executor.stats.ops = 500  # ops since the last sample show in the count, not the rate
    rates = [provider.snapshot()["leases"][0]["ops_per_s"] for _ in range(3)]
    assert rates == [15.0, 15.0, 15.0]
    assert provider.snapshot()["leases"][0]["ops"] == 500


def test_a_transfer_under_way_shows_as_the_sessions_byte_rate():
    provider, _, active = provider_with_a_lease()
    provider.sample_ops(10.0)
    active.count_bytes(24_000_000)  # 2 s of an upload at 12 MB/s
    provider.sample_ops(12.0)
    assert provider.snapshot()["leases"][0]["bytes_per_s"] == 12_000_000


def test_a_lease_row_shows_its_state_by_name():
    provider, _, active = provider_with_a_lease()
    active.lifecycle.process(LeaseEvent.RECEIPT_OVERDUE)
    assert provider.snapshot()["leases"][0]["state"] == "paused"


def test_a_provider_remembers_a_bounded_number_of_ended_leases():
    provider, _, _ = provider_with_a_lease()
    ended = []
    for _ in range(FINISHED_KEPT + 5):
        lease = Minter().lease(CONSUMER, HOST, start=NOW, offer_id=DEVICE.offer_id)
        active = ActiveLease(lease, lease.proposal, Meter(HOST, lease.proposal), NOW)
        provider.active[lease.proposal.lease_id] = active
        provider._on_final(active)
        ended.append(active)
    assert list(provider.finished) == ended[-FINISHED_KEPT:]
    assert len(provider.snapshot()["leases"]) == 10  # status shows the last ten
