"""The script's interpreter is forked at the node's start and runs the script once the
lease is held (``cumulus_p2p.node.prestart``); to the script it is ``python -m``."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cumulus_p2p.node.prestart import PrestartedScript
from cumulus_p2p.testing import forkstart
from cumulus_p2p.testing.nodes import LOOPBACK_LISTEN, start_consumer, start_node
from cumulus_p2p.testing.processes import gone_within

DRIVER = Path(__file__).parent / "scripts" / "prestart_driver.py"

PROBE = """\
import atexit, json, os, sys, threading, time
atexit.register(print, "the script's exit handler ran")
def late():
    time.sleep(0.3)
    print("a thread the interpreter waited for")
threading.Thread(target=late).start()
print(json.dumps({"probe": os.environ.get("PROBE"), "argv": sys.argv[1:], "name": __name__,
                  "path0": sys.path[0]}), flush=True)
if sys.argv[1] == "exit":
    sys.exit(3)
if sys.argv[1] == "raise":
    raise ValueError("from the script")
"""


def drive(tmp_path: Path, scenario: str, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "probe.py").write_text(PROBE)
    command = [sys.executable, str(DRIVER), scenario, "probe", *args]
    return forkstart.run(command, cwd=tmp_path, timeout=60, check=True)


def lines(done: subprocess.CompletedProcess) -> list[str]:
    return done.stdout.splitlines()


def test_a_started_script_runs_as_python_m_with_the_environment_given_at_start(tmp_path):
    done = drive(tmp_path, "start", "exit")
    seen = json.loads(lines(done)[0])
    assert seen == {"probe": "given", "argv": ["exit"], "name": "__main__", "path0": str(tmp_path)}
    assert json.loads(lines(done)[-2]) == {"status": 3}
    # Imported before it ran, it would have run twice, and runpy would have warned.
    assert sum(line.startswith('{"probe"') for line in lines(done)) == 1
    assert "RuntimeWarning" not in done.stderr


def test_a_script_ends_as_the_interpreter_ends_it(tmp_path):
    done = drive(tmp_path, "start", "raise")
    # Its threads are waited for, then its exit handlers run; the node's own do not.
    assert lines(done)[1:3] == [
        "a thread the interpreter waited for",
        "the script's exit handler ran",
    ]
    assert "ValueError: from the script" in done.stderr
    assert json.loads(lines(done)[3]) == {"status": 1}
    assert lines(done)[4:] == ["the driver's own exit handler ran"]


def test_ctrl_c_while_the_node_matches_does_not_reach_the_waiting_script(tmp_path):
    done = drive(tmp_path, "interrupt-then-start", "ok")
    assert json.loads(lines(done)[0])["probe"] == "given"
    assert json.loads(lines(done)[-2]) == {"status": 0}
    assert "KeyboardInterrupt" not in done.stderr


def test_a_script_never_started_is_killed_before_it_ran_anything(tmp_path):
    done = drive(tmp_path, "drop", "ok")
    assert lines(done) == [
        json.dumps({"status": -signal.SIGKILL}),
        "the driver's own exit handler ran",
    ]


def test_a_waiting_script_whose_node_vanished_exits_without_running(tmp_path):
    done = drive(tmp_path, "vanish", "ok")
    child = json.loads(lines(done)[0])["child"]
    assert gone_within(child, 30)
    assert lines(done) == [json.dumps({"child": child})]


def test_no_fork_beside_other_threads_or_for_a_command_that_is_not_python_m():
    assert PrestartedScript.fork(["torchrun", "train.py"]) is None
    assert PrestartedScript.fork([sys.executable, "train.py"]) is None
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        assert PrestartedScript.fork([sys.executable, "-m", "json.tool"]) is None
    finally:
        stop.set()
        other.join()


@pytest.mark.slow  # starts two nodes
def test_a_consumer_nodes_script_imports_torch_while_it_matches_and_never_runs_unleased(
    tmp_path,
):
    # Fresh interpreters: a fork of the suite's preloaded server has torch already.
    fresh = {forkstart.ENV_SWITCH: "0"}
    (tmp_path / "train.py").write_text("open('ran', 'w').write('yes')\n")
    boot = start_node(tmp_path / "boot", "--listen", LOOPBACK_LISTEN, env=fresh)
    consumer = start_consumer(
        tmp_path / "c",
        boot.addr,
        "--min-vram",
        "100000GiB",
        command=[str(tmp_path / "train.py")],
        env=fresh,
    )
    try:
        consumer.wait_for_state(lambda state: state.get("role") == "consumer")
        (child,) = children(consumer.proc.pid)
        deadline = time.monotonic() + 60
        while "libtorch" not in Path(f"/proc/{child}/maps").read_text():
            assert time.monotonic() < deadline, "the script's interpreter never loaded torch"
            time.sleep(0.2)
    finally:
        consumer.stop()
        boot.stop()
    # Its node kills it as it stops; a node too slow to stop is killed, and the child then
    # ends when its imports are done and it finds the pipe closed.
    assert gone_within(child, 30)
    assert not (tmp_path / "ran").exists()


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as listing:
        return [int(p) for p in listing.read().split()]
