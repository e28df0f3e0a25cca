"""``python -m cumulus_p2p.native --build``: build the native device ahead of time.

``scripts/bootstrap`` runs this so that the first process that loads the device does
not wait for the compiler. Without a compiler it prints what to install and exits 0
unless ``--strict``: the native device is optional until it becomes the default, and
nothing else in the project needs it.

The build runs in a child process: building imports the library, which registers
kernels for PrivateUse1, and this process may not own that key.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from ._build import build_directory, is_fresh, missing_toolchain

_CHILD = "from cumulus_p2p.native import _build; print(f'{_build.timed_build()[1]:.1f}')"


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
    done = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        print(f"cumulus native device: the build failed\n{done.stderr}", file=sys.stderr)
        return 1
    print(f"cumulus native device: built in {done.stdout.strip()} s ({build_directory()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
