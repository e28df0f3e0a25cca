"""``python -m cumulus_p2p.native --build``: what scripts/bootstrap runs, and what it says.

The real compile is what bootstrap does once per checkout; these specs point the build at
an empty directory and a compiler that fails at once, so they cost a second or two.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# Each runs the build's three processes, importing torch: the fast tier skips them.
pytestmark = pytest.mark.slow


def _build(tmp_path: Path, cxx: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "CXX": str(cxx), "CUMULUS_NATIVE_BUILD_DIR": str(tmp_path / "out")}
    command = [sys.executable, "-m", "cumulus_p2p.native", "--build"]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


def _compiler(tmp_path: Path, body: str) -> Path:
    cxx = tmp_path / "fake-c++"
    cxx.write_text(f"#!/bin/sh\n{body}\n")
    cxx.chmod(0o755)
    return cxx


@pytest.mark.skipif(
    subprocess.run(["which", "ninja"], capture_output=True).returncode != 0
    and not (Path(sys.executable).parent / "ninja").exists(),
    reason="no ninja: bootstrap installs it with the native device",
)
def test_a_failed_compile_exits_1_with_the_compilers_words(tmp_path):
    # It tells torch its version (cpp_extension asks first), then refuses to compile.
    real = 'if [ "$1" = --version ]; then exec c++ --version; fi'
    cxx = _compiler(tmp_path, f'{real}\necho "fake-c++: refusing $*" >&2; exit 1')
    done = _build(tmp_path, cxx)
    assert done.returncode == 1
    assert "the build failed" in done.stderr
    assert "fake-c++: refusing" in done.stderr


def test_without_a_compiler_it_names_what_to_install_and_exits_0(tmp_path):
    done = _build(tmp_path, tmp_path / "no-such-c++")
    assert done.returncode == 0
    assert "install g++" in done.stderr
