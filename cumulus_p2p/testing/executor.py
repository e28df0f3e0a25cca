"""Start a real executor process on loopback for tests and benchmarks; or drive sessions
of an in-process ``Executor`` over memory streams."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import trio
import trio.testing

from ..channel.secure import SecureClientChannel, connect_secure
from ..channel.transport import TrioFrameChannel
from ..identity import NodeIdentity
from ..wire.protocol import PROTOCOL_VERSION, decode_frame, encode_frame
from . import forkstart

_LISTENING = re.compile(r"listening on ([0-9.]+):(\d+)")
_KEY = re.compile(r"key=([0-9a-f]{64})")


@contextmanager
def executor_process(
    *,
    device: str = "cpu",
    quota: str = "8GiB",
    extra: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[tuple[str, subprocess.Popen]]:
    """Run ``cumulus-executor`` on 127.0.0.1, yield ``("127.0.0.1:PORT", process)``;
    ``env`` adds to this process's environment for it. Its log goes to a file, not a
    pipe nobody drains (a full one would stall it): ``log_tail(process)`` reads it.

    The process is terminated (then killed) on exit, whatever happened inside.
    """
    cmd = [sys.executable, "-m", "cumulus_p2p.host.executor_main", "--host", "127.0.0.1"]
    cmd += ["--port", "0", "--device", device, "--quota", quota, *(extra or [])]
    environ = {**os.environ, **(env or {})}
    log = tempfile.TemporaryFile()
    proc = forkstart.popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=environ)
    proc.log = log
    try:
        line = proc.stdout.readline()
        match = _LISTENING.search(line)
        if match is None:
            raise RuntimeError(f"executor did not start: {line!r} {log_tail(proc)}")
        key = _KEY.search(line)
        proc.provider_key = bytes.fromhex(key.group(1)) if key else None
        yield f"{match.group(1)}:{match.group(2)}", proc
    finally:
        stop(proc)
        log.close()


def wait_for_log(proc: subprocess.Popen, text: str, timeout: float = 60.0) -> None:
    """Wait until the log of an executor ``executor_process`` started holds ``text`` (an
    INFO line needs ``--verbose``).

    Raises:
        TimeoutError: it did not within ``timeout`` seconds; the message ends with the log.
    """
    deadline = time.monotonic() + timeout
    while text not in _whole_log(proc):
        if time.monotonic() > deadline or proc.poll() is not None:
            raise TimeoutError(f"no {text!r} in the executor's log:\n{log_tail(proc)}")
        time.sleep(0.05)


def _whole_log(proc: subprocess.Popen) -> str:
    proc.log.seek(0)
    return proc.log.read().decode(errors="replace")


def log_tail(proc: subprocess.Popen, nbytes: int = 4000) -> str:
    """The end of the log of an executor ``executor_process`` started."""
    end = proc.log.seek(0, os.SEEK_END)
    proc.log.seek(max(0, end - nbytes))
    return proc.log.read().decode(errors="replace")


@contextmanager
def secure_executor_channel(
    data_dir: str | Path, *, extra: list[str] | None = None, env: dict[str, str] | None = None
) -> Iterator[tuple[SecureClientChannel, subprocess.Popen]]:
    """Run ``cumulus-executor --secure`` on 127.0.0.1 (its key in ``data_dir``) for one new
    consumer key; yield a secure channel open to it as that consumer, and the process.
    ``extra`` and ``env`` as ``executor_process``'s."""
    consumer = NodeIdentity.generate()
    flags = [*(extra or []), "--secure", "--data-dir", str(data_dir)]
    flags += ["--allow-key", consumer.public_key.hex()]
    with executor_process(extra=flags, env=env) as (address, proc):
        host, port = address.split(":")
        channel = connect_secure(
            host, int(port), identity=consumer, expected_peer_public_key=proc.provider_key
        )
        yield channel, proc


@contextmanager
def executor_in(
    host, workdir: Path, device: str = "cpu", extra: tuple[str, ...] = ()
) -> Iterator[tuple[str, subprocess.Popen]]:
    """Run ``cumulus-executor`` on ``device`` in ``host``'s namespace (``netns.Host``),
    ``extra`` flags added; yield its address and process.

    It keeps a blob store in ``workdir``, as a provider does in its data directory, so a
    second session on it can skip what it already holds. Its output goes to a log there,
    not a pipe, so nobody has to keep reading it.
    """
    workdir.mkdir()
    log = workdir / "executor.log"
    cmd = [sys.executable, "-m", "cumulus_p2p.host.executor_main", "--host", host.address]
    cmd += ["--port", "0", "--device", device, "--quota", "8GiB"]
    cmd += ["--blob-dir", str(workdir / "blobs"), *extra]
    with open(log, "w+") as out:
        proc = subprocess.Popen(host.command(*cmd), stdout=out, stderr=subprocess.STDOUT)
        try:
            yield wait_listening(proc, log), proc
        finally:
            stop(proc)


def wait_listening(proc: subprocess.Popen, log: Path, timeout: float = 120.0) -> str:
    """The ``host:port`` the executor printed, once it has."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        for line in log.read_text().splitlines():
            if "listening on " in line:
                return line.split("listening on ")[1].split()[0]
        time.sleep(0.1)  # the executor's start-up (importing torch) takes seconds
    raise RuntimeError(f"executor did not start: {log.read_text()}")


def stop(proc: subprocess.Popen) -> None:
    """End a process: SIGTERM, then SIGKILL if it has not exited within 10 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait()


def cpu_executor(blob_dir: str | Path | None, **config):
    """An in-process ``Executor`` on the CPU that evicts to a blob store in ``blob_dir``;
    ``config`` sets the rest of its ``ExecutorConfig`` (``device_bytes``, ``cache_bytes``)."""
    from ..host.executor import Executor, ExecutorConfig  # torch: only where one is made

    store = None if blob_dir is None else str(blob_dir)
    return Executor(ExecutorConfig(device="cpu", blob_dir=store, **config))


class MemoryTenant:
    """A session of an in-process executor, driven frame by frame over a memory stream;
    ``terms`` are ``run_session``'s (``rank``, ``until``)."""

    def __init__(self, executor, nursery: trio.Nursery, **terms) -> None:
        client, server = trio.testing.memory_stream_pair()
        self.channel = TrioFrameChannel(client)
        nursery.start_soon(lambda: executor.run_session(TrioFrameChannel(server), **terms))

    async def hello(self, opening: str = "hello", options: dict | None = None) -> dict:
        """Open the session (or resume one: ``opening="resume"`` with its token); returns
        the welcome's information."""
        await self.channel.send_frame(encode_frame([opening, PROTOCOL_VERSION, options or {}]))
        header = decode_frame(await self.channel.receive_frame())[0]
        assert header[0] == "welcome", header
        return header[2]


async def one_batch(executor, batch: list, *, rank: tuple) -> bytes:
    """The reply frame (header and blobs) to ``batch`` (sequence number 1, no failure
    expected) in a session of its own on ``executor``, at ``rank``."""
    async with trio.open_nursery() as nursery:
        tenant = MemoryTenant(executor, nursery, rank=rank)
        await tenant.hello()
        await tenant.channel.send_frame(encode_frame(batch))
        reply = bytes(await tenant.channel.receive_frame())
        assert decode_frame(bytearray(reply))[0][:3] == ["reply", 1, None]
        await tenant.channel.send_frame(encode_frame(["bye"]))
    return reply
