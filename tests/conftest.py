"""Shared fixtures: one real executor process per test session, a fresh session per test."""

from __future__ import annotations

import os
import shutil
import tempfile

# Before torch is first imported, here or in any process a test starts (they inherit it):
# OpenMP's idle threads then sleep instead of spinning. The suite runs a dozen torch
# processes at once on two cores, where each one's spinning threads burn the cores the
# others wait for: four 60-step demo_train runs at once took 24 s and 46 CPU s spinning,
# 9 s and 17 CPU s passive, with the same losses to the bit (the thread count is unchanged).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Nodes and executors start as forks of a process that imported torch and libp2p once
# (``cumulus_p2p.testing.forkstart``): fresh interpreters spent over half the suite's CPU
# importing them. CUMULUS_FORK_START=0 starts fresh interpreters instead.
os.environ.setdefault("CUMULUS_FORK_START", "1")

import pytest  # noqa: E402

import cumulus_p2p.remote as remote  # noqa: E402
from cumulus_p2p.native import missing_toolchain  # noqa: E402
from cumulus_p2p.testing.executor import executor_process  # noqa: E402
from cumulus_p2p.testing.native_process import stop_native_process  # noqa: E402
from cumulus_p2p.testing.nodes import REFERENCE_RUNS  # noqa: E402

_made_here = pytest.StashKey[str]()


def pytest_configure(config):
    """One directory of local reference runs for the whole session, its workers included
    (they start after this and inherit the environment): see ``nodes.LocalRun``."""
    if REFERENCE_RUNS not in os.environ:
        os.environ[REFERENCE_RUNS] = tempfile.mkdtemp(prefix="cumulus-reference-runs-")
        config.stash[_made_here] = os.environ[REFERENCE_RUNS]


def pytest_unconfigure(config):
    made = config.stash.get(_made_here, None)
    if made:
        shutil.rmtree(made, ignore_errors=True)
        del os.environ[REFERENCE_RUNS]


def pytest_collection_modifyitems(config, items):
    """A test marked ``timing`` is marked ``slow`` too: ``scripts/test --fast`` runs its
    tests in parallel workers only, whose load would break a wall-clock bound."""
    loose = [
        i.nodeid
        for i in items
        if i.get_closest_marker("timing") and not i.get_closest_marker("slow")
    ]
    if loose:
        raise pytest.UsageError("timing tests must be marked slow too: " + ", ".join(loose))


def pytest_runtest_setup(item):
    """A test marked ``native`` is skipped, with what to install, where the native device
    cannot be built."""
    if item.get_closest_marker("native") and (missing := missing_toolchain()) is not None:
        pytest.skip(f"the native device cannot be built here: {missing}")


@pytest.fixture(scope="module")
def native_child():
    """Stop the module's native device process (``testing.native_process``) after its
    last test."""
    yield
    stop_native_process()


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
