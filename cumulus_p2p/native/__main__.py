"""``python -m cumulus_p2p.native --build``: build the native device ahead of time.

``scripts/bootstrap`` runs this so that the first process that loads the device does
not wait for the compiler. Without a compiler it prints what to install and exits 0
unless ``--strict``: the native device is optional until it becomes the default, and
nothing else in the project needs it.

Each library builds in a child process of its own, the two at once: building imports
the library, and the device's registers kernels for PrivateUse1, which this process may
not own; together they keep both cores of a small machine busy (the device's two
translation units and the replay loop's one).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time

from ._build import build_directory, is_fresh, missing_toolchain

_CHILD = "import sys; from cumulus_p2p.native import _build; getattr(_build, sys.argv[1])()"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", action="store_true", help="compile (cached) and check")
    parser.add_argument("--strict", action="store_true", help="exit 1 when it cannot build")
    args = parser.parse_args()
    if not args.build:
        parser.print_help()
        return 0
    reason = missing_toolchain()
    if reason is not None:
        print(f"cumulus native device not built: {reason}", file=sys.stderr)
        return 1 if args.strict else 0
    if is_fresh():
        print(f"cumulus native device: up to date ({build_directory()})")
        return 0
    started = time.perf_counter()
    with tempfile.TemporaryFile("w+") as replay_log, tempfile.TemporaryFile("w+") as device_log:
        # Logs in files, not pipes: a compiler's errors can fill a pipe nobody reads yet.
        children = [
            (subprocess.Popen([sys.executable, "-c", _CHILD, name], stdout=log, stderr=log), log)
            for name, log in (("build_replay", replay_log), ("build", device_log))
        ]
        failed = []
        for child, log in children:
            if child.wait() != 0:
                log.seek(0)
                failed.append(log.read())
    if failed:
        print("cumulus native device: the build failed", *failed, sep="\n", file=sys.stderr)
        return 1
    took = time.perf_counter() - started
    print(f"cumulus native device: built in {took:.1f} s ({build_directory()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
