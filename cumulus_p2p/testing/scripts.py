"""Loading the repository's scripts (``benchmarks/``, ``simulations/``) as modules, for
tests that drive their functions: the scripts are files, not a package."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load_script(path: str, name: str) -> ModuleType:
    """The script at ``path`` (relative to the repository) imported as module ``name``."""
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    assert spec is not None and spec.loader is not None, f"no script at {path}"
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while defining
    spec.loader.exec_module(module)
    return module
