"""cumulus-node's command line: bad flags, bad places, bad data, each with a clear way out.

Every test runs the real command in a subprocess, as a user would; those that start a
node that joins a mesh are marked slow.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from cumulus_p2p._errors import NodeConfigError
from cumulus_p2p.cli._parser import build_parser
from cumulus_p2p.cli._run import _consumer_options, _provider_options
from cumulus_p2p.identity import KEY_FILE_NAME, NodeIdentity
from cumulus_p2p.market.ledger import Dispute, Ledger
from cumulus_p2p.market.messages import PriorityClass, Receipt, seal_message
from cumulus_p2p.node.consumer import script_command
from cumulus_p2p.node.datadir import DataDir
from cumulus_p2p.node.hardware import Detection, DeviceFacts, offered_devices, offered_gpu
from cumulus_p2p.node.provider import OfferedDevice, _executor_for
from cumulus_p2p.testing import forkstart
from cumulus_p2p.testing.nodes import (
    LOOPBACK_LISTEN,
    NodeProcess,
    node_command,
    start_consumer,
    start_node,
    start_provider,
)


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``cumulus-node ARGS`` in a bare environment (forked where the suite forks)."""
    env = {"COLUMNS": "200", "PATH": "/usr/bin:/bin"}
    env[forkstart.ENV_SWITCH] = os.environ.get(forkstart.ENV_SWITCH, "0")
    return forkstart.run(node_command(*args), timeout=timeout, env=env)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--provide", "--turbo", "2"], "unrecognized arguments: --turbo"),
        (["--provide", "--gpus", "2"], "--gpus is how many GPUs --consume leases"),
        (
            ["--consume", "--gpus", "2", "--native", "--", "python", "t.py"],
            "a job of several GPUs runs on the Python device (leave out --native)",
        ),
        (
            ["--consume", "--gpus", "2", "--", "torchrun", "--nproc-per-node", "2", "-m", "train"],
            "runs torchrun's ranks under the cumulus shim, which takes a script",
        ),
        (
            ["--provide", "--device", "gpu1"],
            "'gpu1': use auto, cpu, cuda, cuda:N or a list such as cuda:0,cuda:1",
        ),
        (
            ["--provide", "--graph-compiler", "tvm"],
            "invalid choice: 'tvm' (choose from 'loop', 'inductor')",
        ),
        (["--provide", "--overcommit", "2.5"], "--overcommit must be between 1.0 and 2.0"),
        (["--provide", "--overcommit", "0.5"], "--overcommit must be between 1.0 and 2.0"),
        (
            ["--consume", "--max-overcommit", "3", "--", "python", "x.py"],
            "--max-overcommit must be between 1.0 and 2.0",
        ),
    ],
    ids=[
        "an unknown flag, named",
        "--gpus for a provider",
        "--gpus with --native, saying to leave it out",
        "torchrun running a module",
        "a device that is not a device",
        "an unknown graph compiler, listing the choices",
        "an overcommit above 2.0",
        "an overcommit below 1.0",
        "a consumer's overcommit limit above 2.0",
    ],
)
def test_a_bad_command_line_is_a_usage_error_saying_what_is_wrong(tmp_path, args, says):
    result = run("--data-dir", str(tmp_path), *args)
    assert result.returncode == 2
    assert says in result.stderr


@pytest.mark.parametrize("flag", ["--blob-cap", "--ram-tier"])
def test_a_size_that_is_not_a_size_is_a_usage_error_naming_the_flag(tmp_path, flag):
    result = run("--data-dir", str(tmp_path), "--provide", flag, "lots")
    assert result.returncode == 2
    assert flag in result.stderr and "'lots'" in result.stderr


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--storage-price", "cheap", "not a price: 'cheap' (credits per GiB-hour)"),
        ("--storage-price", "-1", "a price must be a non-negative number"),
        ("--storage-gib", "-1", "'-1' is not a whole number of GiB from 0 to 1048576"),
        ("--storage-gib", "1.5", "'1.5' is not a whole number of GiB"),
        ("--storage-gib", "2000000", "is not a whole number of GiB"),
    ],
)
def test_bad_storage_terms_are_a_usage_error_naming_the_flag(tmp_path, flag, value, says):
    result = run("--data-dir", str(tmp_path), "--provide", flag, value)
    assert result.returncode == 2
    assert flag in result.stderr and says in result.stderr


def test_a_contend_price_above_the_ask_is_a_usage_error():
    result = run("--provide", "--price", "0.5", "--contend-price", "0.6")
    assert result.returncode == 2
    assert "--contend-price must not be above --price" in result.stderr


def test_contending_shares_without_a_contend_price_are_a_usage_error():
    result = run("--provide", "--contend-shares", "4")
    assert result.returncode == 2
    assert "--contend-shares needs a --contend-price" in result.stderr


def test_a_declared_performance_below_one_unit_is_a_usage_error():
    result = run("--provide", "--perf-units", "0")
    assert result.returncode == 2
    assert "--perf-units must be at least 1" in result.stderr


def test_a_declared_performance_is_offered_instead_of_the_self_benchmark():
    import trio
    from rich.console import Console

    from cumulus_p2p.cli._run import _benchmarked

    args = build_parser().parse_args(["--provide", "--perf-units", "7", "--bench-seconds", "60"])
    facts = DeviceFacts("cpu", 0, "cpu", 4096, None, "")
    started = time.monotonic()
    (device,) = trio.run(_benchmarked, [facts], args, Console(quiet=True))
    assert device.perf_units == 7
    assert time.monotonic() - started < 5  # the 60 s benchmark never ran


def test_paying_the_bid_on_a_contending_lease_is_a_usage_error():
    result = run("--consume", "--priority", "contend", "--pay-bid", "--", "python", "x.py")
    assert result.returncode == 2
    assert "--pay-bid does not apply to --priority contend" in result.stderr


def test_paying_the_bid_reaches_the_consumers_options():
    wish = build_parser().parse_args(["--consume", "--max-price", "0.7", "--pay-bid"])
    assert _consumer_options(wish, ["x.py"]).pay_bid
    assert not _consumer_options(build_parser().parse_args(["--consume"]), ["x.py"]).pay_bid


def test_the_contend_terms_and_the_contend_priority_reach_the_options():
    device = OfferedDevice(DeviceFacts("cpu", 0, "cpu", 4096, None, ""), perf_units=100)
    args = build_parser().parse_args(
        ["--provide", "--price", "0.5", "--contend-price", "0.2", "--shares", "3"]
    )
    options = _provider_options(args, devices=(device,))
    # As many contending shares as on-demand ones, unless told otherwise.
    assert (options.contend_price, options.contend_shares) == (200_000, 3)
    args = build_parser().parse_args(
        ["--provide", "--contend-price", "0.2", "--contend-shares", "12"]
    )
    assert _provider_options(args, devices=(device,)).contend_shares == 12
    wish = build_parser().parse_args(["--consume", "--priority", "contend"])
    assert _consumer_options(wish, ["x.py"]).priority is PriorityClass.CONTEND


def test_the_storage_terms_reach_the_providers_offer():
    args = build_parser().parse_args(
        ["--provide", "--storage-price", "0.02", "--storage-gib", "50"]
    )
    device = OfferedDevice(DeviceFacts("cpu", 0, "cpu", 4096, None, ""), perf_units=100)
    options = _provider_options(args, devices=(device,))
    assert (options.storage_price, options.storage_gib) == (20_000, 50)
    defaults = _provider_options(build_parser().parse_args(["--provide"]), devices=(device,))
    assert (defaults.storage_price, defaults.storage_gib) == (0, 0)


@pytest.mark.parametrize(
    ("flag", "setting"), [("--blob-cap", "blob_cap"), ("--ram-tier", "ram_bytes")]
)
def test_a_size_flag_reaches_the_providers_executor(tmp_path, flag, setting):
    args = build_parser().parse_args(["--provide", flag, "3GiB"])
    device = OfferedDevice(DeviceFacts("cpu", 0, "cpu", 4096, None, ""), perf_units=100)
    options = _provider_options(args, devices=(device,))
    executor = _executor_for(device, options, DataDir(tmp_path))
    assert getattr(executor.config, setting) == 3 * 1024**3


def test_no_peer_links_reaches_the_providers_executor(tmp_path):
    device = OfferedDevice(DeviceFacts("cpu", 0, "cpu", 4096, None, ""), perf_units=100)
    for flags, links in (([], True), (["--no-peer-links"], False)):
        options = _provider_options(build_parser().parse_args(["--provide", *flags]), (device,))
        assert _executor_for(device, options, DataDir(tmp_path)).config.peer_links is links


def test_a_gpu_this_machine_lacks_is_a_usage_error(tmp_path):
    result = run("--data-dir", str(tmp_path), "--provide", "--device", "cuda:1")
    assert result.returncode == 2
    assert "--device cuda:1" in result.stderr
    assert "try --device auto" in result.stderr or "this machine has cuda:0" in result.stderr


def test_consume_without_a_script_says_how_to_give_one(tmp_path):
    result = run("--data-dir", str(tmp_path), "--consume")
    assert result.returncode == 2
    assert "-- python train.py" in result.stderr


def test_a_bad_size_or_duration_says_what_form_is_expected(tmp_path):
    size = run("--consume", "--min-vram", "lots", "--", "python", "x.py")
    duration = run("--consume", "--match-timeout", "soon", "--", "python", "x.py")
    assert size.returncode == duration.returncode == 2
    assert "try 8GiB" in size.stderr
    assert "try 90s" in duration.stderr


def test_a_consumer_score_bar_outside_0_to_1_is_a_usage_error():
    result = run("--provide", "--min-consumer-score", "45")
    assert result.returncode == 2
    assert "'45' is not a score between 0 and 1" in result.stderr


def test_an_explorer_port_outside_0_to_65535_is_a_usage_error(tmp_path):
    for args in (("explore", "--data-dir", str(tmp_path)), ("--data-dir", str(tmp_path))):
        result = run(*args, "--explore-port", "99999")
        assert result.returncode == 2
        assert "'99999' is not a port number (0-65535)" in result.stderr


def test_an_explorer_port_in_use_is_a_clear_error(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        result = run("explore", "--data-dir", str(tmp_path), "--explore-port", port)
    assert result.returncode == 3
    assert f"cannot listen on 127.0.0.1:{port}" in result.stdout
    assert "--explore-port" in result.stdout


def test_a_consumer_runs_its_script_on_the_native_device_by_default():
    options = _consumer_options(build_parser().parse_args(["--consume"]), ["x.py"])
    assert options.native


def test_python_device_runs_the_script_under_the_shims_python_device():
    argv = ["--consume", "--python-device"]
    options = _consumer_options(build_parser().parse_args(argv), ["x.py"])
    assert not options.native
    assert script_command(("python", "x.py"), cuda_compat=True, native=False)[2:] == [
        "cumulus_p2p.shim",
        "x.py",
    ]


def test_each_torchrun_rank_runs_the_script_under_the_shim():
    command = ("torchrun", "--standalone", "--nproc-per-node", "2", "train.py", "--lr", "1")
    assert script_command(command, cuda_compat=True, native=False)[1:] == [
        "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "cumulus_p2p.shim", "train.py", "--lr", "1",
    ]  # fmt: skip


def test_gpus_reach_the_consumers_options_on_the_python_device():
    argv = ["--consume", "--gpus", "3"]
    options = _consumer_options(build_parser().parse_args(argv), ["torchrun", "x.py"])
    assert options.gpus == 3 and not options.native


def test_gpus_on_the_native_device_is_a_usage_error(tmp_path):
    command = ["--", "torchrun", "--nproc-per-node", "2", "t.py"]
    result = run("--data-dir", str(tmp_path), "--consume", "--gpus", "2", "--native", *command)
    assert result.returncode == 2
    assert "--native has no collectives yet" in result.stderr


def test_native_and_python_device_together_are_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["--consume", "--native", "--python-device"])
    assert exited.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def _no_native_device(monkeypatch, tmp_path) -> None:
    """A machine where the native device is not built and has no compiler to build it."""
    monkeypatch.setenv("CUMULUS_NATIVE_BUILD_DIR", str(tmp_path / "unbuilt"))
    monkeypatch.setenv("CXX", "no-such-compiler")


def test_without_a_compiler_a_consumer_falls_back_to_the_python_device_and_says_so(
    monkeypatch, tmp_path, capsys
):
    _no_native_device(monkeypatch, tmp_path)
    options = _consumer_options(build_parser().parse_args(["--consume"]), ["x.py"])
    assert not options.native
    err = capsys.readouterr().err
    assert "no C++ compiler ('no-such-compiler' is not on PATH): install g++" in err
    assert "the script runs on the Python device" in err


def test_native_without_a_compiler_is_an_error_naming_what_to_install(monkeypatch, tmp_path):
    _no_native_device(monkeypatch, tmp_path)
    with pytest.raises(NodeConfigError, match="--native: the native device cannot be built"):
        _consumer_options(build_parser().parse_args(["--consume", "--native"]), ["x.py"])


def test_native_with_no_cuda_compat_runs_the_native_shim_without_compatibility():
    argv = ["--consume", "--native", "--no-cuda-compat"]
    options = _consumer_options(build_parser().parse_args(argv), ["x.py"])
    assert (options.native, options.cuda_compat) == (True, False)
    assert script_command(("python", "x.py"), cuda_compat=False, native=True)[2:] == [
        "cumulus_p2p.shim",
        "--native",
        "--no-cuda-compat",
        "x.py",
    ]


def test_native_runs_the_script_under_the_shims_native_device():
    options = _consumer_options(build_parser().parse_args(["--consume", "--native"]), ["x.py"])
    assert options.native
    assert script_command(("python", "x.py"), cuda_compat=True, native=True)[2:] == [
        "cumulus_p2p.shim",
        "--native",
        "x.py",
    ]


def test_the_consumers_checkpoint_backoff_and_privacy_flags_reach_its_options():
    argv = ["--consume", "--checkpoint-to", "both", "--standby-gib", "2", "--host-backoff"]
    argv += ["3s", "--private", "--max-storage-price", "0.5"]
    options = _consumer_options(build_parser().parse_args(argv), ["x.py"])
    assert (options.checkpoint_to, options.standby_gib, options.private) == ("both", 2, True)
    assert (options.backoff.base_s, options.max_storage_price) == (3, 500_000)
    defaults = _consumer_options(build_parser().parse_args(["--consume"]), ["x.py"])
    assert (defaults.checkpoint_to, defaults.private, defaults.backoff.base_s) == (
        "standby",
        False,
        15,
    )


def test_a_checkpoint_place_that_does_not_exist_is_a_usage_error():
    result = run("--consume", "--checkpoint-to", "cloud", "--", "python", "x.py")
    assert result.returncode == 2
    assert "invalid choice: 'cloud'" in result.stderr


def test_consume_refuses_a_command_that_is_not_a_python_script():
    result = run("--consume", "--", "bash", "train.sh")
    assert result.returncode == 2
    assert "runs a Python script" in result.stderr


def test_provide_and_consume_together_are_refused():
    result = run("--provide", "--consume", "--", "python", "x.py")
    assert result.returncode == 2
    assert "not allowed with argument" in result.stderr


def test_help_documents_every_flag():
    result = run("--help")
    assert result.returncode == 0
    for flag in (
        "--provide",
        "--consume",
        "--bootstrap",
        "--mdns",
        "--price",
        "--settle-grace",
        "--circuit-duration",
        "--circuit-bytes",
        "--min-consumer-score",
        "--leave-timeout",
        "--shares",
        "--gpu",
        "--min-vram",
        "--max-price",
        "--priority",
        "--match-timeout",
        "--graph-compiler",
        "--blob-cap",
        "--storage-price",
        "--storage-gib",
        "--data-dir",
        "status|peers|offers|reputation|ledger",
    ):
        assert flag in result.stdout


def test_each_command_has_its_own_help():
    result = run("logs", "--help")
    assert result.returncode == 0
    assert "usage: cumulus-node logs" in result.stdout and "--follow" in result.stdout


def test_a_word_that_is_no_command_is_named_as_an_unrecognized_argument():
    result = run("--consume", "python", "train.py")
    assert result.returncode == 2
    assert "unrecognized arguments: python train.py" in result.stderr


def test_a_node_flag_before_a_command_is_a_usage_error(tmp_path):
    result = run("--price", "2", "status", "--data-dir", str(tmp_path))
    assert result.returncode == 2
    assert "--price does not apply to status" in result.stderr


def test_a_view_takes_the_data_dir_before_or_after_its_name(tmp_path):
    for args in (("status", "--data-dir", str(tmp_path)), ("--data-dir", str(tmp_path), "status")):
        result = run(*args)
        assert result.returncode == 3
        assert f"no node has run on {tmp_path}" in result.stdout.replace("\n", "")


def test_a_corrupt_key_file_stops_the_node_and_is_left_untouched(tmp_path):
    key = tmp_path / KEY_FILE_NAME
    key.write_bytes(b"not a key\n")
    result = run("--data-dir", str(tmp_path), "--listen", LOOPBACK_LISTEN)
    assert result.returncode == 3
    assert "corrupt" in result.stdout and "move it away" in result.stdout
    assert key.read_bytes() == b"not a key\n"


def test_a_corrupt_config_file_is_reported_and_left_untouched(tmp_path):
    config = tmp_path / "config.json"
    config.write_text("{price: cheap")
    result = run("--data-dir", str(tmp_path), "--listen", LOOPBACK_LISTEN, timeout=30)
    assert result.returncode == 3
    assert "config.json is not valid JSON" in result.stdout
    assert config.read_text() == "{price: cheap"


def test_a_corrupt_ledger_is_reported_and_left_untouched(tmp_path):
    ledger = tmp_path / "ledger.jsonl"
    ledger.write_bytes(b'garbage line\n{"also": 1}\n')
    result = run("ledger", "--data-dir", str(tmp_path))
    assert result.returncode == 3
    assert ledger.read_bytes() == b'garbage line\n{"also": 1}\n'


def test_the_ledger_view_lists_disputed_receipts_with_their_reasons(tmp_path):
    host = NodeIdentity.generate()
    claim = Receipt("L1", host.peer_id.to_base58(), 0, 1e9, 1e9 + 60, 9999, 0, 1e9 + 600, 1)
    with Ledger.open(tmp_path) as ledger:
        ledger.record_dispute(Dispute.of(seal_message(host, claim, now=1e9), "too many", at=1e9))
    result = run("ledger", "--data-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "disputes (refused receipts)" in result.stdout and "too many" in result.stdout


@pytest.mark.slow  # starts a node that dials
def test_an_unreachable_bootstrap_peer_is_a_clear_error(tmp_path):
    nobody = NodeIdentity.generate().peer_id.to_base58()
    result = run(
        "--data-dir",
        str(tmp_path),
        "--listen",
        LOOPBACK_LISTEN,
        "--bootstrap",
        f"/ip4/127.0.0.1/tcp/9/p2p/{nobody}",
    )
    assert result.returncode == 3
    assert "no bootstrap peer could be reached" in result.stdout


def test_a_bad_listen_address_is_a_clear_error(tmp_path):
    result = run("--data-dir", str(tmp_path), "--listen", "127.0.0.1:4001")
    assert result.returncode == 3
    assert "is not a multiaddr" in result.stdout


def test_status_before_any_node_ran_says_how_to_start_one(tmp_path):
    result = run("status", "--data-dir", str(tmp_path))
    assert result.returncode == 3
    assert "start one with cumulus-node --provide" in result.stdout


@pytest.mark.slow  # starts a node
def test_a_second_node_on_the_same_data_dir_is_refused(tmp_path):
    first = start_node(tmp_path, "--listen", LOOPBACK_LISTEN)
    try:
        first.wait_for("listening on")  # up, and holding the data directory
        second = run("--data-dir", str(tmp_path), "--listen", LOOPBACK_LISTEN)
    finally:
        first.stop()
    assert second.returncode == 3
    assert "another cumulus-node is running" in second.stdout


def _has_torch_loaded(node: NodeProcess) -> bool:
    return "libtorch" in Path(f"/proc/{node.proc.pid}/maps").read_text()


@pytest.mark.slow  # starts two nodes
def test_a_boot_node_and_a_consumers_node_run_without_loading_torch(tmp_path):
    # Only a provider runs tensors (and the consumer's script, in its own process):
    # loading torch would cost every other node about 2 s of CPU at each start.
    # Fresh interpreters: a fork of the suite's preloaded server has torch already.
    fresh = {forkstart.ENV_SWITCH: "0"}
    boot = start_node(tmp_path / "boot", "--listen", LOOPBACK_LISTEN, env=fresh)
    consumer = start_consumer(
        tmp_path / "c", boot.addr, "--min-vram", "100000GiB", command=["train.py"], env=fresh
    )
    try:
        consumer.wait_for_state(lambda state: state.get("role") == "consumer")
        assert not _has_torch_loaded(boot)
        assert not _has_torch_loaded(consumer)
    finally:
        consumer.stop()
        boot.stop()


@pytest.mark.slow  # starts a mesh
def test_impossible_requirements_end_after_the_match_timeout_with_what_the_book_held(tmp_path):
    boot = start_node(tmp_path / "boot", "--listen", LOOPBACK_LISTEN)
    provider = start_provider(tmp_path / "p", boot.addr)
    try:
        provider.wait_for("providing")
        started = time.monotonic()
        result = run(
            "--data-dir",
            str(tmp_path / "c"),
            "--consume",
            "--listen",
            LOOPBACK_LISTEN,
            "--bootstrap",
            boot.addr,
            "--min-vram",
            "100000GiB",
            "--match-timeout",
            "4s",
            "--",
            "python",
            "train.py",
        )
        elapsed = time.monotonic() - started
    finally:
        provider.stop()
        boot.stop()
    assert result.returncode == 4, result.stdout + result.stderr
    assert "none meets the bid" in result.stdout and "Largest VRAM offered" in result.stdout
    assert elapsed < 30


def test_our_error_wins_over_errors_raised_while_the_node_stops():
    from cumulus_p2p._errors import NoMatchError
    from cumulus_p2p.cli._exits import plain_errors

    group = BaseExceptionGroup("nursery", [RuntimeError("teardown"), NoMatchError("no offer")])
    with pytest.raises(NoMatchError, match="no offer"), plain_errors():
        raise group
    with pytest.raises(BaseExceptionGroup), plain_errors():
        raise BaseExceptionGroup("nursery", [RuntimeError("a bug")])


@pytest.mark.slow  # starts a provider
def test_config_json_supplies_flag_defaults(tmp_path):
    (tmp_path / "config.json").write_text('{"price": 0.25, "shares": 2, "bench_seconds": 0.1}')
    provider = start_node(tmp_path, "--provide", "--listen", LOOPBACK_LISTEN, "--no-live")
    try:
        line = provider.wait_for("providing")
    finally:
        provider.stop()
    assert "2 shares at 0.250000/share-hour" in line


def test_config_json_naming_an_unknown_flag_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text('{"prize": 0.25}')
    result = run("--data-dir", str(tmp_path), "--listen", LOOPBACK_LISTEN, timeout=30)
    assert result.returncode == 3
    assert "unknown flags ['prize']" in result.stdout


@pytest.mark.slow  # starts two nodes
def test_two_nodes_with_mdns_find_each_other_without_bootstrap(tmp_path):
    first = start_node(tmp_path / "a", "--listen", LOOPBACK_LISTEN, "--mdns")
    second = start_node(tmp_path / "b", "--listen", LOOPBACK_LISTEN, "--mdns")
    try:
        wanted = NodeIdentity.load_or_create(tmp_path / "b").peer_id.to_base58()
        deadline = time.monotonic() + 30
        seen: list[str] = []
        while time.monotonic() < deadline and wanted not in seen:
            time.sleep(0.5)
            result = run("peers", "--data-dir", str(tmp_path / "a"), "--json")
            if result.returncode == 0:
                seen = [row["peer"] for row in json.loads(result.stdout)]
        assert wanted in seen
    finally:
        first.stop()
        second.stop()


RIG = Detection(tuple(DeviceFacts("cuda", i, f"GPU {i}", 24576, 0, "550") for i in range(3)))


def test_a_rig_offers_every_gpu_by_default():
    assert offered_devices("auto", RIG) == RIG.devices


def test_a_rig_offers_the_gpus_a_device_list_names_in_its_order():
    assert [d.index for d in offered_devices("cuda:2,cuda", RIG)] == [2, 0]


def test_a_gpu_named_twice_is_refused():
    with pytest.raises(ValueError, match="a GPU is named twice"):
        offered_devices("cuda:0,cuda", RIG)


def test_a_device_list_with_a_bad_entry_is_a_usage_error(tmp_path):
    result = run("--data-dir", str(tmp_path), "--provide", "--device", "cuda:0,gpu1")
    assert result.returncode == 2
    assert "'cuda:0,gpu1': use auto, cpu, cuda, cuda:N" in result.stderr


def test_a_rig_offers_the_gpu_its_device_flag_names():
    rig = Detection(RIG.devices[:2])
    assert offered_gpu("cuda:1", rig).model == "GPU 1"
    assert offered_gpu("cuda", rig).index == 0
    with pytest.raises(ValueError, match=r"has cuda:0 \(GPU 0\), cuda:1 \(GPU 1\)"):
        offered_gpu("cuda:2", rig)
