"""The consumer's script: a child process that lives and dies with its node.

Nothing must train on a provider with no node left to countersign for it. So:

- When the node is asked to stop (SIGTERM from systemd or ``kill``, SIGINT from a
  terminal), it passes SIGTERM to the script and gives it ``grace`` seconds to end (the
  shim turns SIGTERM into ``SystemExit``, so the session is detached in order); then it
  kills it. A second signal kills it at once. The node goes on to settle the leases and
  exits with the script's status.
- When the node dies without a say (SIGKILL, a crash), the shim in the script sees the
  node's control channel close and stops the script (``shim._stop_when_node_is_gone``);
  the kernel's parent-death signal is the backstop. That signal is bound to the *thread*
  that started the child, so the script is started here, from trio's own thread, and not
  with ``trio.run_process`` (which starts children from a worker thread that exits when
  idle, and would take the script with it).
"""

from __future__ import annotations

import logging
import signal
import subprocess

import trio

from .prestart import PrestartedScript

log = logging.getLogger("cumulus_p2p.node.script")

#: Seconds a script has to end after SIGTERM before it is killed.
STOP_GRACE_S = 10.0


async def run_script(
    argv: list[str],
    env: dict[str, str],
    *,
    grace: float = STOP_GRACE_S,
    prestarted: PrestartedScript | None = None,
) -> int:
    """Run the script to its end, stopping it when this process is told to stop; in
    ``prestarted`` (which runs ``argv``) where the node forked one at start-up.

    Returns:
        The script's exit status (``128 + n`` when signal ``n`` ended it, as a shell says).
    """
    process: subprocess.Popen | PrestartedScript
    if prestarted is not None:
        process = prestarted.start(env)
    else:
        process = subprocess.Popen(argv, env=env)
    try:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_stop_on_signals, signals, process, grace)
                code = await trio.to_thread.run_sync(process.wait, abandon_on_cancel=True)
                nursery.cancel_scope.cancel()
    finally:
        if process.poll() is None:  # cancelled from outside: the script goes too
            process.kill()
            process.wait()
    return 128 - code if code < 0 else code


async def _stop_on_signals(
    signals, process: subprocess.Popen | PrestartedScript, grace: float
) -> None:
    async for signum in signals:
        name = signal.Signals(signum).name
        log.warning("got %s; stopping the script (up to %g s)", name, grace)
        process.send_signal(signal.SIGTERM)
        break
    with trio.move_on_after(grace):
        async for signum in signals:
            log.warning("got %s again; killing the script", signal.Signals(signum).name)
            break
    if process.poll() is None:
        process.kill()
