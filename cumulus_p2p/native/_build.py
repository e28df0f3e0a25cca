"""Building the native device's C++ extension with torch's ``cpp_extension`` and g++.

The build is cached: ninja recompiles only the translation units whose sources (or
headers) changed, so a second build, or a process that only loads the library, costs
well under a second. The build directory is ``build/native/torch-<version>`` in a
source checkout (git ignores ``build/``), else a per-user cache; a torch upgrade gets a
fresh directory because the library is only valid against the headers it was compiled
with.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

#: The extension's module name; the built library is ``<build dir>/cumulus_native.so``.
NAME = "cumulus_native"
CSRC = Path(__file__).parent / "csrc"
#: The device's sources, compiled as two unity builds (see device_core.cpp).
SOURCES = ("device_core.cpp", "device_ops.cpp")
#: The executor's replay loop: a library of its own, because the device library registers
#: PrivateUse1 kernels at load and an executor process must not own that key.
REPLAY_NAME = "cumulus_replay"
REPLAY_SOURCES = ("replay_unity.cpp",)
#: -O2 because the fallback runs once per op; NDEBUG drops torch's debug-only asserts.
CFLAGS = ("-O2", "-DNDEBUG")


def build_directory() -> Path:
    """Where the extension is built: under the checkout's ``build/``, else a user cache."""
    override = os.environ.get("CUMULUS_NATIVE_BUILD_DIR")
    if override:
        return Path(override)
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "pyproject.toml").exists() and os.access(checkout, os.W_OK):
        base = checkout / "build" / "native"
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "cumulus_p2p"
    # The installed version, read without importing torch (a second or two).
    return base / f"torch-{importlib.metadata.version('torch')}"


def is_fresh() -> bool:
    """Whether the built library is newer than every source and header (no torch import)."""
    libraries = [build_directory() / f"{NAME}.so", _replay_directory() / f"{REPLAY_NAME}.so"]
    if not all(library.exists() for library in libraries):
        return False
    newest = max(path.stat().st_mtime for path in CSRC.iterdir())
    return all(library.stat().st_mtime >= newest for library in libraries)


def _replay_directory() -> Path:
    return build_directory() / "replay"


def _search_path() -> str:
    """PATH plus this interpreter's bin directory, where ``pip install ninja`` puts ninja."""
    return os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])


def missing_toolchain() -> str | None:
    """Why the extension cannot be built here, naming what to install; None if it can."""
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return (
            f"no C++ compiler ({cxx!r} is not on PATH): install g++ "
            "(Debian/Ubuntu: apt-get install g++)"
        )
    if shutil.which("ninja", path=_search_path()) is None:
        return "no ninja on PATH: pip install ninja (or apt-get install ninja-build)"
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        return "no Python headers (Python.h): install python3-dev"
    return None


def build(verbose: bool = False) -> ModuleType:
    """Compile (if anything changed) and import the extension.

    Importing it registers the PrivateUse1 kernels, allocator, guard and hooks, so call
    this only through ``cumulus_p2p.native.load``, which checks the process first.

    Raises:
        RuntimeError: the toolchain is missing (the message names what to install) or
            the compiler failed (its output is in the message).
    """
    return _compiled("device", NAME, SOURCES, build_directory(), verbose)


def build_replay(verbose: bool = False) -> ModuleType:
    """Compile (if anything changed) and import the executor's replay loop.

    It registers nothing with the dispatcher, so any process may load it, one that
    imported ``cumulus_p2p.remote`` included.

    Raises:
        RuntimeError: as ``build``.
    """
    return _compiled("executor", REPLAY_NAME, REPLAY_SOURCES, _replay_directory(), verbose)


def _compiled(
    what: str, name: str, sources: tuple[str, ...], directory: Path, verbose: bool
) -> ModuleType:
    """Compile ``sources`` (if anything changed) into ``directory`` and import them."""
    from torch.utils import cpp_extension

    reason = missing_toolchain()
    if reason is not None:
        raise RuntimeError(f"cannot build the native cumulus {what}: {reason}")
    directory.mkdir(parents=True, exist_ok=True)
    os.environ["PATH"] = _search_path()
    return cpp_extension.load(
        name=name,
        sources=[str(CSRC / source) for source in sources],
        extra_cflags=list(CFLAGS),
        build_directory=str(directory),
        verbose=verbose,
    )
