"""Shared fixtures: one real executor process per test session, a fresh session per test."""

from __future__ import annotations

import pytest

import cumulus_p2p.remote as remote
from cumulus_p2p.testing.executor import executor_process


@pytest.fixture(scope="session")
def executor_address():
    """A real ``cumulus-executor`` process on loopback, shared by the test session."""
    with executor_process(device="cpu", quota="2GiB") as (address, _proc):
        yield address


@pytest.fixture
def cumulus(executor_address):
    """Attach a fresh session as the ``cumulus`` device for one test; detach after."""
    with remote.attach(executor_address) as session:
        yield session
