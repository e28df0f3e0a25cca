"""The spam simulation (``simulations/spam.py``): a junk-offer flood against the real
gate, book, matcher and host choice, with time passed in."""

from __future__ import annotations

import json

import pytest

from cumulus_p2p.market.book import BookLimits
from cumulus_p2p.node.consumer import PROPOSE_TIMEOUT_S
from cumulus_p2p.testing.scripts import load_script

# Runs floods of hundreds of identities through the market: scripts/test --fast skips it.
pytestmark = pytest.mark.slow

spam = load_script("simulations/spam.py", "simulations_spam")

#: A short world with enough consumers in it: two minutes, a dozen matches.
SMALL = spam.Size(horizon_s=120.0, arrivals_per_min=20.0)


@pytest.fixture(scope="module")
def flood_200():
    return spam.simulate(1, 200, spam.ON, SMALL)


def test_honest_consumers_all_lease_under_a_200_identity_flood(flood_200):
    assert flood_200["consumers"] >= 8
    assert flood_200["leased_share"] == 1.0
    # At worst one batch waits out an attacker that ignores its proposal.
    assert flood_200["lease_s_max"] <= PROPOSE_TIMEOUT_S + 1.0


def test_a_far_below_market_unknown_offer_never_ranks_ahead_of_hosts_with_a_record(flood_200):
    assert flood_200["junk_low_first_share"] == 0.0


def test_the_book_never_holds_more_than_the_cap_per_author(flood_200):
    cap = BookLimits().max_orders_per_author
    assert flood_200["max_offers_per_author"] == cap
    assert flood_200["peak_junk_offers"] == 200 * cap
    assert flood_200["junk_book_refused"]["OVER_AUTHOR_CAP"] > flood_200["junk_book_added"]


def test_the_attacker_sends_no_faster_than_the_gate_accepts(flood_200):
    assert flood_200["junk_gate_refused"] == 0


def test_honest_newcomers_lease_under_a_200_identity_flood_as_often_as_without_it():
    # Four minutes: the prober takes half a minute to get through 100 near-market Sybils
    # seen at the same time as the newcomers, and consumers keep arriving after that.
    longer = spam.Size(horizon_s=240.0, arrivals_per_min=20.0)
    quiet = spam.simulate(1, 0, spam.ON, longer)
    flooded = spam.simulate(1, 200, spam.ON, longer)
    assert flooded["newcomer_leases"] == quiet["newcomer_leases"] > 0
    assert flooded["leased_share"] == 1.0


def test_no_proposal_goes_to_a_host_that_answered_no_probe(flood_200):
    assert flood_200["attacker_proposal_share"] == 0.0


def test_without_the_liveness_probe_near_market_junk_takes_every_newcomer_lease():
    row = spam.simulate(1, 200, spam.ABLATIONS["on, no liveness probe"], SMALL)
    assert row["newcomer_leases"] == 0 and row["attacker_proposal_share"] > 0


def test_an_identity_that_answers_no_probe_costs_a_bounded_number_of_probes(flood_200):
    # Missed at once, then after backoffs of 10, 20 and 40 s: the next is past 2 minutes.
    assert flood_200["probes_per_attacker"] <= 4


def test_without_the_defences_a_10_identity_flood_keeps_every_consumer_from_a_lease():
    row = spam.simulate(1, 10, spam.OFF, SMALL)
    assert row["consumers"] > 0 and row["leased_share"] == 0.0
    assert row["attacker_proposal_share"] == 1.0 and row["junk_low_first_share"] == 1.0


def test_a_full_book_evicts_junk_and_keeps_the_honest_hosts_leasing():
    bounded = spam.ABLATIONS[f"on, book bound {spam.SMALL_BOOK}"]
    row = spam.simulate(1, 200, bounded, SMALL)
    assert row["evicted"] > 0 and row["peak_book_offers"] <= spam.SMALL_BOOK
    assert row["leased_share"] == 1.0


def test_the_same_seed_gives_the_same_row():
    assert spam.simulate(4, 10, spam.ON, SMALL) == spam.simulate(4, 10, spam.ON, SMALL)


def test_consumers_arrive_alike_whatever_the_flood_and_the_defences():
    quiet = spam.simulate(2, 0, spam.ON, SMALL)
    flooded = spam.simulate(2, 10, spam.OFF, SMALL)
    assert quiet["consumers"] == flooded["consumers"]


def test_the_command_prints_and_writes_its_json(tmp_path, capsys):
    result = spam.main(["--quick", "--identities", "0", "--out", str(tmp_path)])
    written = json.loads((tmp_path / "spam_quick.json").read_text())
    assert written["rows"] == result["rows"] and written["scenario"] == "spam"
    assert json.loads(capsys.readouterr().out)["seed"] == 1
    assert (tmp_path / "spam_quick.md").read_text().startswith("# Spam on the market")
