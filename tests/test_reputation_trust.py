"""Specs for cumulus_p2p.reputation.trust: EigenTrust over paid transactions."""

import pytest

from cumulus_p2p.reputation import credibility, global_trust


def test_trust_is_a_distribution():
    edges = {"me": {"a": 1.0}, "a": {"b": 2.0, "me": 1.0}, "b": {}}
    assert sum(global_trust(edges, ["me"]).values()) == pytest.approx(1.0)


def test_a_component_unreachable_from_the_pre_trusted_peers_gets_no_trust():
    edges = {"me": {"h": 1.0}, "h": {"me": 1.0}}
    edges.update({f"s{i}": {"fresh": 1e9} for i in range(20)})
    edges["fresh"] = {f"s{i}": 1e9 for i in range(20)}
    cred = credibility(global_trust(edges, ["me"]), ["me"])
    assert all(cred.get(f"s{i}", 0.0) == 0.0 for i in range(20))
    assert cred.get("fresh", 0.0) == 0.0 and cred["h"] > 0.0


def test_trust_bought_through_one_attack_edge_is_bounded_by_its_share():
    # The attacker paid the honest host a tenth of what its other customer paid.
    edges = {"me": {"h": 1.0}, "h": {"me": 10.0, "attacker": 1.0}, "attacker": {"h": 1.0}}
    cred = credibility(global_trust(edges, ["me"]), ["me"])
    assert 0.0 < cred["attacker"] < 0.5 * cred["h"]


def test_pre_trusted_peers_have_full_credibility():
    assert credibility(global_trust({}, ["me", "c"]), ["me", "c"]) == {"me": 1.0, "c": 1.0}
