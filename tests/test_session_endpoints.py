"""Which session addresses a provider tells its consumers to dial, and in what order."""

from __future__ import annotations

import pytest

from cumulus_p2p.dht.host import interface_ipv4s, observed_ipv4s
from cumulus_p2p.identity import NodeIdentity
from cumulus_p2p.node.provider import session_endpoints
from cumulus_p2p.testing.hosts import noise_hosts


def test_an_advertised_host_is_the_only_endpoint():
    endpoints = session_endpoints("0.0.0.0", 7000, "gpu.example.net", observed=["203.0.113.9"])
    assert endpoints == ["gpu.example.net:7000"]


def test_observed_addresses_come_before_the_bound_one():
    endpoints = session_endpoints("192.168.1.20", 7000, None, observed=["203.0.113.9"])
    assert endpoints == ["203.0.113.9:7000", "192.168.1.20:7000"]


def test_an_address_both_observed_and_bound_is_listed_once():
    endpoints = session_endpoints("10.0.0.5", 7000, None, observed=["10.0.0.5"])
    assert endpoints == ["10.0.0.5:7000"]


def test_binding_every_interface_lists_each_with_loopback_last():
    endpoints = session_endpoints("0.0.0.0", 7000, None)
    assert endpoints == [f"{ip}:7000" for ip in interface_ipv4s()]
    assert endpoints[-1] == "127.0.0.1:7000"


@pytest.mark.trio
async def test_a_host_no_peer_has_observed_reports_no_observed_address():
    async with noise_hosts([NodeIdentity.generate()]) as (host,):
        assert observed_ipv4s(host) == []
