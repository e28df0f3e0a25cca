"""Fork starts: a test's node or executor is a fork of a preloaded server, and must still
behave as the fresh ``python`` process it stands for."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from cumulus_p2p.testing import forkstart

pytestmark = pytest.mark.slow

SCRIPT = """
import os, sys, time
import torch
print("argv", sys.argv[1:], flush=True)
print("env", os.environ.get("FORKSTART_PROBE"), os.environ.get("HOME_FOR_TEST"), flush=True)
print("threads", torch.get_num_threads(), flush=True)
print("cwd", os.getcwd(), flush=True)
print("to stderr", file=sys.stderr, flush=True)
if sys.argv[1:] == ["hang"]:
    time.sleep(60)
sys.exit(int(sys.argv[1]) if sys.argv[1:] and sys.argv[1].isdigit() else 0)
"""


@pytest.fixture
def script(tmp_path, monkeypatch):
    monkeypatch.setenv(forkstart.ENV_SWITCH, "1")
    path = tmp_path / "probe.py"
    path.write_text(SCRIPT)
    return str(path)


def start(script, *args, env=None):
    return forkstart.popen(
        [sys.executable, script, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


def test_a_forked_script_gets_its_arguments_output_and_exit_status(script):
    child = start(script, "3")
    assert isinstance(child, forkstart.ForkedProcess)
    lines = child.stdout.read().splitlines()
    assert child.wait(30) == 3
    assert lines[0] == "argv ['3']"
    assert "to stderr" in lines


def test_a_forked_child_sees_the_environment_it_was_given_and_no_other(script, monkeypatch):
    monkeypatch.setenv("FORKSTART_PROBE", "from the parent")
    env = {"PATH": "/usr/bin:/bin", "HOME_FOR_TEST": "given", forkstart.ENV_SWITCH: "1"}
    child = start(script, env=env)
    assert "env None given" in child.stdout.read()
    assert child.wait(30) == 0


def test_omp_num_threads_sets_a_forked_childs_torch_threads(script):
    child = start(script, env={"OMP_NUM_THREADS": "1", forkstart.ENV_SWITCH: "1"})
    assert "threads 1" in child.stdout.read().splitlines()
    assert child.wait(30) == 0


def test_a_killed_fork_reports_the_signal_as_popen_does(script):
    child = start(script, "hang")
    assert child.stdout.readline().startswith("argv")
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.1)
    child.kill()
    assert child.wait(30) == -signal.SIGKILL


def test_a_command_that_is_not_this_python_starts_as_a_plain_subprocess(script):
    child = forkstart.popen(["echo", "hi"], stdout=subprocess.PIPE, text=True)
    assert isinstance(child, subprocess.Popen)
    assert child.communicate(timeout=30)[0] == "hi\n"


def test_fork_starts_are_off_unless_switched_on(script, monkeypatch):
    monkeypatch.setenv(forkstart.ENV_SWITCH, "0")
    child = start(script)
    assert isinstance(child, subprocess.Popen)
    assert child.communicate(timeout=60)[0].startswith("argv []")


def test_run_captures_each_stream_apart_in_the_directory_it_is_given(script, tmp_path):
    where = tmp_path / "elsewhere"
    where.mkdir()
    done = forkstart.run([sys.executable, script, "-c", "import os"], cwd=where, timeout=60)
    assert done.returncode == 0
    assert done.stdout.startswith("argv ['-c', 'import os']")
    assert f"cwd {where}" in done.stdout.splitlines()
    assert done.stderr == "to stderr\n"


def test_run_past_its_timeout_kills_the_child_and_says_so(script):
    with pytest.raises(subprocess.TimeoutExpired):
        forkstart.run([sys.executable, script, "hang"], timeout=3)


def test_a_forked_child_reads_what_is_written_to_its_piped_standard_input(tmp_path, monkeypatch):
    monkeypatch.setenv(forkstart.ENV_SWITCH, "1")
    echo = tmp_path / "echo.py"
    echo.write_text("import sys\nprint('got', sys.stdin.readline().strip(), flush=True)\n")
    child = forkstart.popen(
        [sys.executable, str(echo)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert isinstance(child, forkstart.ForkedProcess)
    child.stdin.write("a line\n")
    child.stdin.flush()
    assert child.stdout.readline() == "got a line\n"
    assert child.wait(30) == 0


def test_a_forked_script_runs_its_exit_handlers_as_the_interpreter_does(tmp_path, monkeypatch):
    monkeypatch.setenv(forkstart.ENV_SWITCH, "1")
    script = tmp_path / "handlers.py"
    script.write_text("import atexit, sys\natexit.register(print, 'handled')\nsys.exit(2)\n")
    done = forkstart.run([sys.executable, str(script)], timeout=30)
    assert (done.returncode, done.stdout) == (2, "handled\n")
