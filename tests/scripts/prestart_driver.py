"""Drive a ``PrestartedScript`` as the consumer node does, for tests/test_prestart.py.

    python prestart_driver.py SCENARIO MODULE [ARGS...]

Forks ``python -m MODULE ARGS`` ahead of its environment (the working directory must
hold MODULE), then plays SCENARIO and prints one JSON line: what it saw.

- ``start``: start it with ``PROBE=given`` added to the environment; wait for it.
- ``interrupt-then-start``: send the waiting child SIGINT (Ctrl-C at a terminal reaches
  it too), then start it and wait.
- ``drop``: drop it without starting it.
- ``vanish``: exit at once without starting it, as a node killed while it matched
  (prints the child's pid first).
"""

import atexit
import json
import os
import signal
import sys
import time

from cumulus_p2p.node.prestart import PrestartedScript


def main() -> None:
    scenario, module, *args = sys.argv[1:]
    atexit.register(print, "the driver's own exit handler ran")
    # The module itself among the imports: it must still run once, as ``__main__`` only.
    script = PrestartedScript.fork([sys.executable, "-m", module, *args], ("json", module))
    assert script is not None, "the driver runs one thread: the fork must happen"
    if scenario == "vanish":
        print(json.dumps({"child": script.pid}), flush=True)
        os._exit(0)
    if scenario == "drop":
        script.drop()
        print(json.dumps({"status": script.returncode}), flush=True)
        return
    if scenario == "interrupt-then-start":
        time.sleep(0.2)
        os.kill(script.pid, signal.SIGINT)
        time.sleep(0.2)
    script.start({**os.environ, "PROBE": "given"})
    print(json.dumps({"status": script.wait()}), flush=True)


if __name__ == "__main__":
    main()
