"""Load a repository script (benchmarks/, scripts/, deploy/ are folders of scripts, not
packages) as a module by its path, for tests of its functions (importable because pytest
puts ``tests/`` on sys.path for the root conftest)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_script(path: Path, name: str) -> ModuleType:
    """Execute the file at ``path`` as module ``name`` and return it.

    The module is registered in ``sys.modules`` first: dataclasses resolve annotations
    through it.

    Raises:
        FileNotFoundError: no file at ``path``.
    """
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
