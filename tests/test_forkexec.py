"""``testing.forkexec``: the ``python`` torchrun starts ranks with, whose processes are
forks of a preloaded server, must behave as the fresh interpreter it stands for."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from cumulus_p2p.testing import forkexec, forkstart
from cumulus_p2p.testing.processes import alive, gone_within

pytestmark = pytest.mark.slow  # the server is a fork start: a fork server imports torch

PROBE = """
import os, sys, time
import torch
print("argv", sys.argv[1:], "cwd", os.getcwd(), "env", os.environ.get("PROBE"), flush=True)
print("read", sys.stdin.readline().strip(), flush=True)
print("to stderr", file=sys.stderr, flush=True)
if sys.argv[1:] == ["hang"]:
    print("pid", os.getpid(), flush=True)
    time.sleep(60)
sys.exit(int(sys.argv[1]) if sys.argv[1:] and sys.argv[1].isdigit() else 0)
"""


@pytest.fixture
def python(monkeypatch) -> str:
    monkeypatch.setenv(forkstart.ENV_SWITCH, "1")
    return forkexec.python_exec()["PYTHON_EXEC"]


@pytest.fixture
def probe(tmp_path) -> str:
    (tmp_path / "probe.py").write_text(PROBE)
    return str(tmp_path / "probe.py")


def start(python: str, *args: str, cwd=None) -> subprocess.Popen:
    return subprocess.Popen(
        [python, "-u", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env={**os.environ, "PROBE": "seen"},
    )


def test_a_script_gets_its_arguments_cwd_environment_streams_and_exit_status(
    python, probe, tmp_path
):
    child = start(python, probe, "3", cwd=tmp_path)
    out, err = child.communicate("a line\n", timeout=60)
    assert out.splitlines() == [f"argv ['3'] cwd {tmp_path} env seen", "read a line"]
    assert err == "to stderr\n"
    assert child.returncode == 3


def test_a_module_runs_as_python_dash_m_runs_it(python, tmp_path):
    (tmp_path / "probe_module.py").write_text(PROBE)
    child = start(python, "-m", "probe_module", "0", cwd=tmp_path)
    out, _ = child.communicate("\n", timeout=60)
    assert out.startswith("argv ['0']") and child.returncode == 0


@pytest.fixture
def hanging(python, probe):
    """A client whose script sleeps, and the pid of the fork that runs it (the script
    prints it); killed at the end."""
    child = start(python, probe, "hang")
    child.stdin.write("\n")
    child.stdin.flush()
    for _ in range(2):  # its arguments, then the line it read
        child.stdout.readline()
    yield child, int(child.stdout.readline().split()[1])
    child.kill()
    child.wait()


def test_it_forks_the_server_instead_of_starting_an_interpreter(hanging):
    child, fork = hanging
    assert fork != child.pid  # the fork runs the script; the client waits for it
    assert alive(fork)


def test_a_signal_sent_to_the_client_ends_the_fork_and_the_client_as_it(hanging):
    child, fork = hanging
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=30) == -signal.SIGTERM
    assert gone_within(fork, 10)


def test_a_client_killed_outright_takes_its_fork_with_it(hanging, python, probe):
    child, fork = hanging
    child.kill()
    child.wait()
    assert gone_within(fork, 10)
    # Killed with the server's words unread, it reset their connection: the server serves on.
    after = start(python, probe, "0")
    assert after.communicate("\n", timeout=60)[0].startswith("argv") and after.returncode == 0


def test_a_command_it_cannot_fork_runs_in_a_fresh_interpreter(python):
    done = subprocess.run(
        [python, "-c", "import os, sys; print(sys.flags.isolated, 'site' in sys.modules)"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.stdout.split() == ["0", "True"]  # not the client's -I -S interpreter


def test_without_fork_starts_torchrun_keeps_its_own_python(monkeypatch):
    monkeypatch.setenv(forkstart.ENV_SWITCH, "0")
    assert forkexec.python_exec() == {}
