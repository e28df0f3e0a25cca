"""The ``python`` that ``forkexec.python_exec`` names: run ``python [-u] -m MODULE ...``
or ``python [-u] SCRIPT.py ...`` as a fork of the forkexec server.

It runs with ``-I -S`` and imports only the standard library, so it starts in a few
hundredths of a second. It passes its standard streams, environment and working directory
to the server, relays the signals it is sent to the fork, and exits as the fork did (a
fork killed by a signal kills it with the same signal). Anything else it is asked to run
runs in a fresh interpreter.
"""

import ctypes
import json
import os
import signal
import socket
import struct
import sys

_PR_SET_PDEATHSIG = 1
RELAYED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def main() -> None:
    args, env = sys.argv[1:], dict(os.environ)
    path = env.pop("CUMULUS_FORKEXEC_SOCKET")
    while args[:1] == ["-u"]:
        env["PYTHONUNBUFFERED"] = "1"
        args = args[1:]
    if args[:1] == ["-m"] and len(args) >= 2:
        entry = ["-m", args[1], args[2:]]
    elif args and args[0].endswith(".py"):
        entry = ["", args[0], args[1:]]
    else:
        os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
    # A launcher killed outright (SIGKILL) cannot pass it on: this client then dies with
    # it, its connection closes, and the server kills the fork.
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.connect(path)
    payload = json.dumps({"entry": entry, "env": env, "cwd": os.getcwd()}).encode()
    socket.send_fds(server, [struct.pack(">I", len(payload))], [0, 1, 2])
    server.sendall(payload)
    replies = server.makefile("r")
    pid = int(replies.readline().split()[1])
    for number in RELAYED:
        signal.signal(number, lambda number, _frame: _relay(pid, number))
    line = replies.readline()
    code = int(line.split()[1]) if line else -signal.SIGKILL
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


def _relay(pid: int, number: int) -> None:
    try:
        os.kill(pid, number)
    except ProcessLookupError:  # it has just ended: its status is on its way
        pass


if __name__ == "__main__":
    main()
