"""``python -m cumulus_p2p.shim --native``: a script runs on the native C++ device.

The script's process loads the native device, so it never imports the Python one; each
test starts a real ``cumulus-executor`` and runs the shim as a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cumulus_p2p import shim
from cumulus_p2p.testing import forkstart
from cumulus_p2p.testing.executor import executor_process
from cumulus_p2p.testing.nodes import local_result

pytestmark = [pytest.mark.slow, pytest.mark.native]

SCRIPT = Path(__file__).parent / "scripts" / "native_train.py"
#: Sums split across threads round differently: the executor runs one, as the script.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def _shim(*args: str, executor: str, script: Path = SCRIPT) -> subprocess.Popen:
    env = {**os.environ, shim.ENV_EXECUTOR: executor}
    command = [sys.executable, "-m", "cumulus_p2p.shim", "--native", str(script), *args]
    return forkstart.popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _losses(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def test_a_script_trains_on_the_native_device_with_a_local_runs_losses():
    local = local_result(str(SCRIPT), "cpu")
    with executor_process(env=ONE_THREAD) as (address, _):
        out, err = _shim("cumulus", executor=address).communicate(timeout=120)
    ran = _losses(out)
    assert ran["device"] == "cumulus:0", err
    assert ran["losses"] == local["losses"]


def test_a_cuda_style_script_runs_unchanged_on_the_native_device():
    script = SCRIPT.parent / "cuda_style_train.py"
    local = local_result(str(script))
    with executor_process(env=ONE_THREAD) as (address, _):
        out, err = _shim(executor=address, script=script).communicate(timeout=120)
    ran = _losses(out)
    assert ran["device"] == "cumulus:0", err
    assert ran["losses"] == local["losses"]
    assert ran["name"].startswith("cumulus (")
    assert ran["allocated"] >= ran["params"] > 0  # weights, Adam's moments, the batch
    assert ran["peak"] >= ran["allocated"]


def test_a_script_that_loses_its_executor_ends_saying_it_cannot_fail_over(tmp_path):
    gate = tmp_path / "gate"
    with executor_process(env=ONE_THREAD) as (address, executor):
        script = _shim("cumulus", "3", str(gate), executor=address)
        assert script.stdout.readline().strip() == "holding"
        executor.kill()
        executor.wait()
        gate.touch()
        out, err = script.communicate(timeout=60)
    assert script.returncode == 1
    assert "lost the executor" in err
    assert "the session cannot move: it was opened with one executor" in err


def test_an_unreachable_executor_is_a_start_failure_naming_the_address():
    proc = _shim("cumulus", executor="127.0.0.1:9")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == shim.EXIT_CANNOT_START
    assert "cannot open a native session with the executor at 127.0.0.1:9" in err


def test_a_machine_that_cannot_build_the_device_is_told_what_to_install(tmp_path):
    env = {**os.environ, shim.ENV_EXECUTOR: "127.0.0.1:9", "CXX": "no-such-compiler"}
    env["CUMULUS_NATIVE_BUILD_DIR"] = str(tmp_path)  # nothing built there
    command = [sys.executable, "-m", "cumulus_p2p.shim", "--native", str(SCRIPT), "cumulus"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == shim.EXIT_CANNOT_START
    assert "no C++ compiler ('no-such-compiler' is not on PATH): install g++" in done.stderr


def test_a_ddp_script_on_the_native_device_is_told_to_run_on_the_python_device(tmp_path):
    script = SCRIPT.parent / "ddp_train.py"
    with executor_process(env=ONE_THREAD) as (address, _):
        env = {**os.environ, shim.ENV_EXECUTOR: address, "LOCAL_RANK": "0"}
        command = [sys.executable, "-m", "cumulus_p2p.shim", "--native", str(script)]
        done = subprocess.run(
            [*command, str(tmp_path / "out.pt")], env=env, capture_output=True, text=True
        )
    assert done.returncode == 1
    assert "without --native" in done.stderr
