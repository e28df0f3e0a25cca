"""A host that overcharges is refused, and the job moves on (issue 16).

Real nodes on loopback: a bootstrap node, ``cumulus_p2p.testing.liar`` (the real provider
node, cheapest on the mesh, whose receipts each claim 64 MiB more than the session moved,
or twice the share-seconds their interval holds) and an honest CPU provider. The
consumer refuses the liar's first receipt, both ledgers keep the dispute, the liar
pauses the unpaid session, and the job finishes on the honest provider with the loss of
a local run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cumulus_p2p.market.ledger import Ledger
from cumulus_p2p.testing import loopback, nodes

# Starts real cumulus-node processes: scripts/test --fast skips it.
pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).parent / "scripts"
STEPS = "20"


def disputes(data_dir) -> list:
    with Ledger.open(data_dir) as books:
        return list(books.disputes())


@pytest.mark.parametrize(
    "lie, why",
    [("bytes", "bytes receipted under this lease"), ("share-seconds", "share-seconds, at most")],
)
def test_an_overcharging_hosts_receipts_are_refused_and_disputed_on_both_sides(tmp_path, lie, why):
    # The job holds after step 10 until the liar has paused the unpaid session, so it
    # cannot finish on the liar however fast the machine.
    gate = tmp_path / "gate"
    script = [str(SCRIPTS / "gated_train.py"), STEPS, "10", str(gate)]
    with loopback.liar_and_honest_provider(tmp_path, lie) as (boot, liar, _):
        consumer = nodes.start_consumer(
            tmp_path / "consumer",
            boot.addr,
            "--max-price",
            "1.0",
            "--checkpoint-interval",
            "1s",
            command=script,
        )
        consumer.wait_for("holding at step 10", timeout=120)
        consumer.wait_for("refused a receipt", timeout=60)
        liar.wait_for_state(
            lambda s: bool(s.get("leases")) and s["leases"][0]["state"] in ("paused", "unpaid")
        )
        gate.touch()
        with nodes.LocalRun(nodes.demo_reference(int(STEPS))) as local:
            assert consumer.proc.wait(timeout=240) == 0, consumer.output()
            expected = local.final_loss()
    assert nodes.final_json(consumer.lines)["final_loss"] == expected
    state = json.loads((tmp_path / "consumer" / "state.json").read_text())
    leases = state["leases"]
    assert [lease["state"] for lease in leases][-1] == "held"
    liar_id = leases[0]["host"]
    assert leases[-1]["host"] != liar_id
    (theirs,) = disputes(tmp_path / "liar")
    ours = disputes(tmp_path / "consumer")
    assert [d.receipt_id for d in ours] == [theirs.receipt_id]
    assert why in theirs.reason
    assert ours[0].receipt == theirs.receipt  # the same host-signed claim on both sides
