"""Offers are checked against the device (issue 16).

Real nodes on loopback: a bootstrap node, ``cumulus_p2p.testing.liar`` (the real
provider node on this CPU, its offer claiming an H100 with 80 GiB, cheapest on the
mesh) and an honest CPU provider. A consumer's job must end up on the honest one with
the loss of a local run, having paid the liar only for the probe, and its node must
rank the liar down.
"""

from __future__ import annotations

import json
import time

import pytest

from cumulus_p2p.market.ledger import Ledger
from cumulus_p2p.testing import loopback, nodes

# Starts real cumulus-node processes: scripts/test --fast skips it.
pytestmark = pytest.mark.slow

SCRIPT = ["-m", "cumulus_p2p.demo_train", "--steps", "10", "--log-every", "5"]


def test_a_host_claiming_a_gpu_it_lacks_is_dropped_after_the_probe_and_reported(tmp_path):
    with loopback.liar_and_honest_provider(tmp_path, "device") as (boot, _, _):
        started = time.monotonic()
        consumer = nodes.start_consumer(
            tmp_path / "consumer",
            boot.addr,
            "--max-price",
            "1.0",
            "--min-vram",
            "1GiB",
            command=SCRIPT,
        )
        consumer.wait_for("misrepresents its device", timeout=120)
        probed_within = time.monotonic() - started
        # The job now moves to the honest host: the local run fits in that wait.
        with nodes.LocalRun(nodes.demo_reference(10)) as local:
            assert consumer.proc.wait(timeout=240) == 0, consumer.output()
            expected = local.final_loss()
    assert "misrepresents its device" in consumer.output()
    assert nodes.final_json(consumer.lines)["final_loss"] == expected
    state = json.loads((tmp_path / "consumer" / "state.json").read_text())
    leases = state["leases"]
    assert [lease["state"] for lease in leases] == ["misrepresented", "held"]
    liar_id = leases[0]["host"]
    # Paid for the probe's seconds only, in both ledgers: at most the time until the
    # consumer dropped the liar (a second or two more, while the lease's end reached the
    # host), not the job's time on the honest host. How long a probe takes is the
    # machine's load; the bound is what was seen.
    with Ledger.open(tmp_path / "liar") as books:
        charged = books.totals(leases[0]["lease_id"])
    assert 0 < charged.share_seconds <= probed_within + 3
    assert charged.receipts == leases[0]["receipts"]
    score = next(row for row in state["scores"] if row["host"] == liar_id)
    assert score["failures"] > 0.9  # measured about a thousandth of the claim
    ranked = [row["host"] for row in state["scores"]]
    assert ranked.index(liar_id) > ranked.index(leases[1]["host"])
