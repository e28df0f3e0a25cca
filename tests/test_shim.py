"""``python -m cumulus_p2p.shim``: a user's script runs with the cumulus device attached."""

from __future__ import annotations

import json
import os
import runpy
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cumulus_p2p import cuda_compat, remote, shim
from cumulus_p2p.remote.client import CURRENT
from cumulus_p2p.testing import forkstart
from cumulus_p2p.testing.executor import executor_process

# Runs scripts under the shim against real executor processes: scripts/test --fast skips it.
pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).parent / "scripts"
PROBE = SCRIPTS / "shim_probe.py"


def run_shim(*args: str, executor: str | None, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != shim.ENV_EXECUTOR}
    if executor is not None:
        env[shim.ENV_EXECUTOR] = executor
    return forkstart.run(
        [sys.executable, "-m", "cumulus_p2p.shim", *args], env=env, cwd=cwd, timeout=120
    )


def report(proc: subprocess.CompletedProcess) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[0])


def test_script_runs_as_main_on_the_remote_device(executor_address, tmp_path):
    proc = run_shim(str(PROBE), "a", "--b", executor=executor_address, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    seen = report(proc)
    assert seen["argv"] == [str(PROBE), "a", "--b"]
    assert seen["name"] == "__main__"
    assert seen["path0"] == str(SCRIPTS)
    assert seen["cuda"] is True
    assert seen["device"] == "cumulus:0"
    assert seen["sum"] == 3.0


def test_no_cuda_compat_attaches_the_device_but_leaves_cuda_alone(executor_address, tmp_path):
    proc = run_shim("--no-cuda-compat", str(PROBE), executor=executor_address, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    seen = report(proc)
    assert seen["cuda"] is False  # this torch has no CUDA of its own
    assert seen["device"] == "cumulus:0"


def test_exit_status_is_the_scripts(executor_address, tmp_path):
    proc = run_shim(str(PROBE), "exit", "3", executor=executor_address, cwd=tmp_path)
    assert proc.returncode == 3
    assert report(proc)["device"] == "cumulus:0"


def test_script_exceptions_propagate_with_their_traceback(executor_address, tmp_path):
    proc = run_shim(str(PROBE), "raise", executor=executor_address, cwd=tmp_path)
    assert proc.returncode == 1
    assert "ValueError: boom from the script" in proc.stderr
    assert "shim_probe.py" in proc.stderr


def test_sigterm_ends_the_script_through_a_clean_exit(executor_address, tmp_path):
    env = {**os.environ, shim.ENV_EXECUTOR: executor_address}
    proc = subprocess.Popen(
        [sys.executable, "-m", "cumulus_p2p.shim", str(PROBE), "wait"],
        env=env,
        cwd=tmp_path,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert json.loads(proc.stdout.readline())["device"] == "cumulus:0"
        proc.terminate()
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM  # SystemExit: finally blocks ran
    finally:
        proc.kill()
        proc.wait()
        proc.stdin.close()
        proc.stdout.close()


def test_sigterm_inside_an_op_waits_for_the_op_then_exits_cleanly(executor_address, tmp_path):
    proc = run_shim(str(SCRIPTS / "sigterm_mid_op.py"), executor=executor_address, cwd=tmp_path)
    assert proc.stdout.strip() == "op done"
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr


def test_cuda_training_script_under_the_shim_matches_the_cpu(executor_address, tmp_path):
    train = SCRIPTS / "cuda_train.py"
    under_shim = run_shim(str(train), "1", executor=executor_address, cwd=tmp_path)
    assert under_shim.returncode == 0, under_shim.stderr
    saved, sys.argv = sys.argv, [str(train), "1"]
    try:
        local = runpy.run_path(str(train), run_name="__main__")  # here: no shim, no CUDA
    finally:
        sys.argv = saved
    remote_report = report(under_shim)
    assert (local["param_device"], remote_report["device"]) == ("cpu", "cumulus:0")
    assert remote_report["losses"] == local["losses"]
    assert remote_report["peak"] > 0


def test_a_nanogpt_style_compiled_script_under_the_shim_matches_it_compiled_on_a_cpu(
    executor_address, tmp_path
):
    train = str(SCRIPTS / "nanogpt_train.py")
    under_shim = run_shim(train, "4", executor=executor_address, cwd=tmp_path)
    assert under_shim.returncode == 0, under_shim.stderr
    assert "runs eagerly" not in under_shim.stderr  # the model was captured, not run eagerly
    local = subprocess.run(  # a process that never imports cumulus: inductor on this CPU
        [sys.executable, train, "4"], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert local.returncode == 0, local.stderr
    remote_report, local_report = report(under_shim), report(local)
    assert (local_report["device"], remote_report["device"]) == ("cpu", "cumulus:0")
    assert remote_report["losses"] == pytest.approx(local_report["losses"], abs=1e-5)


def test_nanogpt_with_its_optimizer_step_compiled_too_runs_captured_under_the_shim(
    executor_address, tmp_path
):
    train = str(SCRIPTS / "nanogpt_train.py")
    compiled = run_shim(
        train, "4", "float32", "compile-step", executor=executor_address, cwd=tmp_path
    )
    assert compiled.returncode == 0, compiled.stderr
    assert "runs eagerly" not in compiled.stderr  # model and optimizer step captured
    eager_step = run_shim(train, "4", executor=executor_address, cwd=tmp_path)
    assert eager_step.returncode == 0, eager_step.stderr
    # The compiled step is capturable AdamW; eagerly it is not: rounding differs.
    assert report(compiled)["losses"] == pytest.approx(report(eager_step)["losses"], abs=1e-5)


def test_missing_executor_environment_says_what_to_set(tmp_path):
    proc = run_shim(str(PROBE), executor=None, cwd=tmp_path)
    assert proc.returncode == shim.EXIT_CANNOT_START
    assert shim.ENV_EXECUTOR in proc.stderr and "cumulus-node --consume" in proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize("argv", [[], ["--no-cuda-compat"], ["--bogus", "x.py"], ["-m"]], ids=str)
def test_bad_command_lines_exit_with_usage(argv, capsys):
    assert shim.main(argv) == shim.EXIT_CANNOT_START
    assert "usage:" in capsys.readouterr().err


def test_missing_script_file_is_reported(capsys, tmp_path):
    assert shim.main([str(tmp_path / "nope.py")]) == shim.EXIT_CANNOT_START
    assert "nope.py" in capsys.readouterr().err


@pytest.fixture
def attached_sessions(monkeypatch):
    """Every session ``shim.connect`` attaches, in order."""
    sessions = []
    real_connect = shim.connect

    def connect(environ):
        sessions.append(real_connect(environ))
        return sessions[-1]

    monkeypatch.setattr(shim, "connect", connect)
    return sessions


@pytest.mark.parametrize(
    "ending", [[], ["exit", "4"], ["raise"]], ids=["returns", "exits", "raises"]
)
def test_session_is_detached_and_compat_off_however_the_script_ends(
    executor_address, attached_sessions, capsys, ending
):
    env = {shim.ENV_EXECUTOR: executor_address}
    try:
        shim.run(str(PROBE), ending, environ=env)
    except (SystemExit, ValueError):
        pass
    capsys.readouterr()
    assert len(attached_sessions) == 1 and attached_sessions[0].closed
    assert CURRENT.session is None
    assert not cuda_compat.is_enabled()


def test_module_form_runs_the_module_as_main(
    executor_address, attached_sessions, monkeypatch, capsys
):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    shim.run("shim_probe", ["x"], module=True, environ={shim.ENV_EXECUTOR: executor_address})
    seen = json.loads(capsys.readouterr().out)
    assert seen["name"] == "__main__"
    assert seen["argv"] == [str(PROBE), "x"]
    assert seen["device"] == "cumulus:0"


def test_an_executor_entry_with_spares_turns_failover_on(executor_address):
    environ = {shim.ENV_EXECUTOR: f"{executor_address}|127.0.0.1:9"}
    session = shim.connect(environ)
    try:
        assert session._reconnect is not None and session.failover_statistics().checkpoints == 0
    finally:
        remote.detach()


def test_an_executor_entry_without_spares_leaves_failover_off(executor_address):
    session = shim.connect({shim.ENV_EXECUTOR: executor_address})
    try:
        assert session._reconnect is None
    finally:
        remote.detach()


def test_a_reconnect_dials_its_own_executor_first_then_the_spares(executor_address):
    reconnect = shim._first_answering(["127.0.0.1:9", executor_address])
    channel = reconnect()
    try:
        assert channel.peer_address.endswith(executor_address)
    finally:
        channel.close()


def test_a_reconnect_with_no_executor_answering_names_each_that_did_not():
    reconnect = shim._first_answering(["127.0.0.1:9", "127.0.0.1:7"])
    with pytest.raises(OSError, match="127.0.0.1:9: .*; 127.0.0.1:7: "):
        reconnect()


@pytest.mark.parametrize(
    ("entry", "why"),
    [("|no-port", "must look like host:port"), ("", "could not convert string to float")],
)
def test_a_bad_spare_or_interval_is_refused_at_the_start_saying_what(executor_address, entry, why):
    environ = {shim.ENV_EXECUTOR: f"{executor_address}{entry or '|127.0.0.1:9'}"}
    if not entry:
        environ["CUMULUS_CHECKPOINT_INTERVAL"] = "soon"
    before = CURRENT.session
    with pytest.raises(shim.SessionClosedError, match=why):
        shim.connect(environ)
    assert CURRENT.session is before  # nothing was attached


def test_several_executors_named_to_a_process_no_launcher_started_are_its_devices(
    executor_address,
):
    with executor_process() as (second, _):
        session = shim.connect({shim.ENV_EXECUTOR: f"{executor_address},{second}"})
        try:
            assert len(CURRENT.sessions) == 2 and CURRENT.sessions[0] is session
            assert CURRENT.sessions[1].device.index == 1
        finally:
            remote.detach()


def test_spares_for_the_devices_of_one_process_are_refused_saying_why(executor_address):
    environ = {shim.ENV_EXECUTOR: f"{executor_address}|127.0.0.1:9,{executor_address}"}
    with pytest.raises(shim.SessionClosedError, match="failover is for one device per process"):
        shim.connect(environ)
    assert CURRENT.session is None


def test_a_cuda_script_splitting_its_model_across_two_gpus_trains_on_two_hosts_as_on_a_cpu(
    executor_address, tmp_path
):
    script = SCRIPTS / "pipeline_train.py"
    local = forkstart.run([sys.executable, str(script), "6"], cwd=tmp_path, timeout=120)
    assert local.returncode == 0, local.stderr
    with executor_process() as (second, _):
        proc = run_shim(str(script), "6", executor=f"{executor_address},{second}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    split, reference = report(proc), report(local)
    assert split["placed"] == ["cumulus:0", "cumulus:1"]  # its cuda:0 and cuda:1
    assert split["losses"] == pytest.approx(reference["losses"], abs=1e-6)
