"""Real ``cumulus-node`` processes on loopback, for tests, the demo and benchmarks."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from . import forkexec, forkstart

LOOPBACK_LISTEN = "/ip4/127.0.0.1/tcp/0"
#: Seconds between a test node's re-announcements of its offers or bid (the product's
#: default is 10). A change (shares taken or freed, a node started) is announced at once
#: whatever this is. Each round re-stores the offer sheet in the DHT: at one round a
#: second a node on loopback took 7-8 % of a core doing so, at one every 2 s about 4 %,
#: and the test workers keep ten or so nodes up at a time on 2 cores.
ANNOUNCE_INTERVAL = "2"
#: The performance units a test provider declares (``--perf-units``) instead of running
#: its self benchmark. The benchmark measured a quiet instant (13 to 77 units on the
#: 2-core machine), the parallel suite's load then cut what the device delivered
#: tenfold, and consumers' probes, right to hold a host to its claim, set honest hosts
#: aside as misrepresenting. A claim of 1 is what a host sharing a busy machine keeps up.
SHARED_MACHINE_PERF = "1"


@dataclass
class NodeProcess:
    """A running ``cumulus-node`` and what it printed so far.

    A node that ``listens`` prints ``listening on ADDR`` once up: ``addr`` waits for that
    line the first time it is read, so that nodes started one after another start
    together (read ``boot.addr`` only when the next node needs it).
    """

    proc: subprocess.Popen
    data_dir: Path
    lines: list[str] = field(default_factory=list)
    listens: bool = False
    drained: threading.Event = field(default_factory=threading.Event)
    _addr: str = field(default="", repr=False)

    @property
    def addr(self) -> str:
        """The address in the node's ``listening on`` line (waited for, up to 30 s);
        ``""`` for a node that does not listen."""
        if self.listens and not self._addr:
            self._addr = self.wait_for("listening on").split()[-1]
        return self._addr

    def output(self) -> str:
        return "".join(self.lines)

    def state(self) -> dict:
        """The node's ``state.json``; ``{}`` until it is first written. A read that meets
        the file half written tries again (the node rewrites it every second)."""
        for _ in range(20):
            try:
                return json.loads((self.data_dir / "state.json").read_text())
            except FileNotFoundError:
                return {}
            except ValueError:
                time.sleep(0.05)
        raise ValueError(f"{self.data_dir / 'state.json'} never parsed")

    def wait_for_state(self, check, timeout: float = 60.0) -> dict:
        """Wait until ``check(state)`` holds for the node's ``state.json``; return it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.state()
            if state and check(state):
                return state
            time.sleep(0.2)
        raise TimeoutError(f"the node's state never got there within {timeout}s: {self.state()}")

    def stop(self) -> None:
        """SIGTERM the node and wait for it to leave (SIGKILL after 10 s)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            self._reap()

    def _reap(self) -> None:
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def wait_for(self, text: str, timeout: float = 30.0, *, start: int = 0) -> str:
        """Wait until a printed line (from line ``start`` on) contains ``text``; return it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.lines[start:]:
                if text in line:
                    return line
            if self.proc.poll() is not None and not any(text in x for x in self.lines[start:]):
                raise RuntimeError(
                    f"cumulus-node exited ({self.proc.returncode}):\n" + self.output()
                )
            time.sleep(0.05)
        raise TimeoutError(f"no line with {text!r} within {timeout}s:\n{self.output()}")


def start_provider(
    data_dir: Path, bootstrap: str, *args: str, **options: str | None
) -> NodeProcess:
    """A CPU provider joined through ``bootstrap`` that re-announces its offer every
    ``announce_interval`` seconds; ``args`` add flags (``--price``...), ``options`` are
    ``provider_command``'s. Wait for its ``providing`` line before leasing from it."""
    command = provider_command(data_dir, bootstrap, *args, **options)  # type: ignore[arg-type]
    return start_process(command, data_dir, listens=True)


def provider_command(
    data_dir: Path,
    bootstrap: str,
    *args: str,
    listen: str = LOOPBACK_LISTEN,
    receipt_interval: str = "1s",
    perf_units: str | None = SHARED_MACHINE_PERF,
    bench_seconds: str = "0.1",
    announce_interval: str = ANNOUNCE_INTERVAL,
) -> list[str]:
    """The command ``start_provider`` runs, for a caller that starts it its own way;
    ``perf_units`` None runs the self benchmark (``bench_seconds`` long) instead of
    declaring a figure."""
    flags = ["--provide", "--listen", listen, "--bootstrap", bootstrap]
    flags += ["--announce-interval", announce_interval]
    flags += ["--receipt-interval", receipt_interval, "--no-live"]
    if perf_units is None:
        flags += ["--bench-seconds", bench_seconds]
    else:
        flags += ["--perf-units", perf_units]
    return node_command("--data-dir", str(data_dir), *flags, *args)


def start_consumer(
    data_dir: Path,
    bootstrap: str,
    *args: str,
    command: list[str],
    env: dict | None = None,
    announce_interval: str = ANNOUNCE_INTERVAL,
) -> NodeProcess:
    """A consumer joined through ``bootstrap`` that re-announces its bid every
    ``announce_interval`` seconds and runs ``python *command``; ``args`` add flags before
    the ``--``."""
    return start_node(
        data_dir, "--consume", "--listen", LOOPBACK_LISTEN, "--bootstrap", bootstrap,
        "--announce-interval", announce_interval, *args, "--", "python", *command, env=env,
    )  # fmt: skip


def node_command(*args: str) -> list[str]:
    """``cumulus-node`` with this interpreter (what the console script runs)."""
    return [sys.executable, "-m", "cumulus_p2p.cli", *args]


def start_node(data_dir: Path, *args: str, env: dict | None = None) -> NodeProcess:
    """Start ``cumulus-node --data-dir DATA_DIR ARGS`` with its output captured.

    A node that listens (not ``--consume``) has its ``addr`` once it prints it.
    """
    command = node_command("--data-dir", str(data_dir), *args)
    return start_process(command, data_dir, listens="--consume" not in args, env=env)


def start_process(
    command: list[str], data_dir: Path, *, listens: bool, env: dict | None = None
) -> NodeProcess:
    """Start a node-like ``command`` with its output captured, without waiting for it;
    when it ``listens``, its ``addr`` is the ``ADDR`` of its ``listening on ADDR`` line
    (``NodeProcess.addr`` waits for it)."""
    full_env = {**os.environ, "COLUMNS": "200", **(env or {})}
    proc = forkstart.popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env
    )
    node = NodeProcess(proc, Path(data_dir), listens=listens)
    threading.Thread(target=_pump, args=(proc, node), daemon=True).start()
    return node


def stop_all(nodes: Iterable[NodeProcess]) -> None:
    """Stop ``nodes`` together: SIGTERM each at once, then wait for each (SIGKILL after
    10 s), so that their goodbyes overlap instead of adding up (``NodeProcess.stop``)."""
    running = [node for node in nodes if node.proc.poll() is None]
    for node in running:
        node.proc.terminate()
    for node in running:
        node._reap()


def _pump(proc: subprocess.Popen, node: NodeProcess) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        node.lines.append(line)
    node.drained.set()


def final_json(lines: list[str]) -> dict:
    """The last JSON line a script printed (``demo_train`` ends with its results)."""
    return json.loads(next(x for x in reversed(lines) if x.startswith("{")))


def json_lines(out: str) -> list[dict]:
    """Every JSON line of ``out`` (a torchrun job's: one per rank)."""
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def demo_reference(steps: int) -> list[str]:
    """The arguments of a local ``demo_train`` run of ``steps`` steps. A job of that many
    demo steps through the mesh must end with its loss, however often either logs: one
    set of arguments per count lets a test session compute each count once (``LocalRun``).
    """
    return ["-m", "cumulus_p2p.demo_train", "--steps", str(steps)]


def local_final_loss(script: list[str]) -> float:
    """The final loss of ``python *script`` run here, on the CPU (what a job through the
    mesh must end with); a run past its timeout is killed."""
    with LocalRun(script) as run:
        return run.final_loss()


def assert_local_final_loss(node: NodeProcess, script: list[str]) -> None:
    """Assert that the job ``node`` ran through the mesh ended with the final loss of
    ``python *script`` run here (``local_final_loss``)."""
    got, expected = final_json(node.lines)["final_loss"], local_final_loss(script)
    assert got == expected, f"final loss {got} through the mesh, {expected} run here"


#: A directory in which ``LocalRun`` keeps each script's output, keyed by its arguments,
#: for the rest of a test session (``tests/conftest.py`` sets it). The scripts are seeded
#: and run on the CPU, so a second run of the same arguments prints the same bytes: a
#: session computes each reference once instead of in every test that compares with it.
REFERENCE_RUNS = "CUMULUS_REFERENCE_RUNS"


def _kept_output(script: list[str]) -> Path | None:
    root = os.environ.get(REFERENCE_RUNS)
    if not root:
        return None
    key = hashlib.sha256(json.dumps([sys.executable, *script]).encode()).hexdigest()
    return Path(root) / f"{key[:24]}.out"


class LocalRun:
    """``python *script`` started now on this machine's CPU, in the background: what a job
    through the mesh must end with, computed while a test waits on its nodes. Read it
    with ``result`` or ``final_loss``; a run still going at ``close`` is killed. Where
    ``CUMULUS_REFERENCE_RUNS`` names a directory, a run of the same arguments already
    finished there is read instead of started again.

        with LocalRun(demo_reference(20)) as local:
            ...  # the job through the mesh
            assert final_json(consumer.lines)["final_loss"] == local.final_loss()
    """

    def __init__(self, script: list[str]) -> None:
        self.script = script
        self._kept = _kept_output(script)
        self._out: str | None = None
        self._err = ""
        self.proc: subprocess.Popen | forkstart.ForkedProcess | None = None
        if self._kept is not None and self._kept.exists():
            self._out = self._kept.read_text()
            return
        self.proc = forkstart.popen(
            [sys.executable, *script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    def result(self, timeout: float = 120.0) -> dict:
        """The last JSON line the script printed (waits for it to exit).

        Raises:
            subprocess.CalledProcessError: the script failed.
        """
        if self._out is None:
            assert self.proc is not None
            self._out, self._err = self.proc.communicate(timeout=timeout)
            if self.proc.returncode != 0:
                raise subprocess.CalledProcessError(
                    self.proc.returncode, self.script, self._out, self._err
                )
            self._keep(self._out)
        return final_json(self._out.splitlines())

    def _keep(self, out: str) -> None:
        if self._kept is not None:
            _write_whole(self._kept, out)

    def final_loss(self, timeout: float = 120.0) -> float:
        return self.result(timeout)["final_loss"]

    def close(self) -> None:
        if self._out is None and self.proc is not None:
            self.proc.kill()
            self._out, self._err = self.proc.communicate()

    def __enter__(self) -> LocalRun:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def local_result(*script: str, timeout: float = 120.0) -> dict:
    """The last JSON line of ``python *script`` run here (``LocalRun``), waiting for it."""
    with LocalRun(list(script)) as run:
        return run.result(timeout)


#: ``torchrun`` on two ranks of this machine's CPU (``torchrun``).
TORCHRUN_LOCAL = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def torchrun(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``torchrun`` (``TORCHRUN_LOCAL``) of ``args`` on this machine, its output captured;
    ``env`` adds to the environment. Its ranks start as forks where the suite's fork starts
    are on (``forkexec``): as fresh interpreters they cost 3 to 5 CPU seconds each."""
    environ = {**os.environ, **forkexec.python_exec(), **(env or {})}
    return forkstart.run([sys.executable, *TORCHRUN_LOCAL, *args], env=environ, timeout=300)


def local_ddp_run(script: Path, *args: str, scratch: Path) -> tuple[Path, list[dict]]:
    """``torchrun`` of ``script OUT *args`` on this machine's CPU, with gloo: what a job of
    two leased GPUs must end with. Returns OUT, the parameters the script saved there, and
    each rank's JSON line.

    Where ``CUMULUS_REFERENCE_RUNS`` names a directory, the first test to ask for these
    arguments computes them there, and the others read its files. Elsewhere it runs in
    ``scratch``.
    """
    kept = _kept_output(["torchrun", str(script), *args])
    if kept is not None and kept.exists():
        return kept.with_suffix(".pt"), json_lines(kept.read_text())
    base = kept if kept is not None else scratch / "local-ddp.out"
    # The parameters are in place before the output: a test in another worker that sees
    # the output sees the parameters too.
    partial = base.with_suffix(f".{os.getpid()}.partial.pt")
    done = torchrun(str(script), str(partial), *args)
    if done.returncode != 0:
        raise RuntimeError(f"the local torchrun failed ({done.returncode}):\n{done.stderr[-4000:]}")
    os.replace(partial, base.with_suffix(".pt"))
    _write_whole(base, done.stdout)
    return base.with_suffix(".pt"), json_lines(done.stdout)


def _write_whole(path: Path, text: str) -> None:
    """Write ``text`` aside and rename it to ``path``, so that a test in another worker
    reads all of it or none."""
    partial = path.with_suffix(f".{os.getpid()}.partial")
    partial.write_text(text)
    os.replace(partial, path)


def start_liar(data_dir: Path, bootstrap: str, lie: str, *, price: str = "0.1") -> NodeProcess:
    """A provider that lies about ``lie`` (``cumulus_p2p.testing.liar``), cheapest on the
    mesh by default; wait for its ``providing`` line before leasing from it."""
    command = [
        sys.executable, "-m", "cumulus_p2p.testing.liar", "--bootstrap", bootstrap,
        "--data", str(data_dir), "--price", price, "--lie", lie,
    ]  # fmt: skip
    return start_process(command, data_dir, listens=True)


def start_rig(data_dir: Path, bootstrap: str, *, devices: int, shares: int) -> NodeProcess:
    """A provider offering ``devices`` devices of ``shares`` shares each
    (``cumulus_p2p.testing.rig``); wait for its ``providing`` line before leasing."""
    command = [
        sys.executable, "-m", "cumulus_p2p.testing.rig", "--bootstrap", bootstrap,
        "--data", str(data_dir), "--devices", str(devices), "--shares", str(shares),
    ]  # fmt: skip
    return start_process(command, data_dir, listens=True)


@contextmanager
def boot_and_provider(root: Path, *args: str) -> Iterator[tuple[NodeProcess, NodeProcess]]:
    """A bootstrap node under ``root/boot`` and a provider on it under ``root/provider``
    (``args`` add its flags), yielded once it is providing; both stopped at the end."""
    boot = start_node(root / "boot", "--listen", LOOPBACK_LISTEN)
    provider = start_provider(root / "provider", boot.addr, *args)
    try:
        provider.wait_for("providing")
        yield boot, provider
    finally:
        stop_all((provider, boot))
