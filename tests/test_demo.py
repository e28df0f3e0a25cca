"""The demo's verdict: exact against a CPU provider, within a tolerance against a GPU."""

from __future__ import annotations

from cumulus_p2p.demo import LOSS_RTOL, losses_agree


def test_cpu_providers_must_match_the_local_loss_exactly():
    assert losses_agree(1.25, 1.25, exact=True)
    assert not losses_agree(1.25, 1.25 * (1 + 1e-7), exact=True)


def test_gpu_providers_may_differ_within_the_stated_tolerance():
    assert losses_agree(1.25, 1.25 * (1 + LOSS_RTOL / 2), exact=False)
    assert not losses_agree(1.25, 1.25 * (1 + LOSS_RTOL * 2), exact=False)
