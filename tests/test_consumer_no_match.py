"""What a consumer that leased nothing is told about overcommitted hosts
(``node.consumer._overcommitted``, a part of its no-match message)."""

from __future__ import annotations

from types import SimpleNamespace

from cumulus_p2p.node.consumer import ConsumerOptions, _overcommitted


def offers(*pcts: int) -> list:
    return [SimpleNamespace(overcommit_pct=p) for p in pcts]


def test_a_job_that_keeps_its_memory_resident_is_told_every_host_overcommits():
    resident = ConsumerOptions(command=("train.py",), max_overcommit_pct=100)
    said = _overcommitted(offers(200, 150), resident)
    assert said == "; every host overcommits its memory (least: 1.5x) past your --max-overcommit 1"


def test_nothing_is_said_when_some_host_is_within_the_jobs_limit():
    resident = ConsumerOptions(command=("train.py",), max_overcommit_pct=100)
    assert _overcommitted(offers(200, 100), resident) == ""
    assert _overcommitted(offers(200), ConsumerOptions(command=("train.py",))) == ""
