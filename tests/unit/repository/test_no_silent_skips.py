"""The suite's skip policy (tests/conftest.py): only GPU-only tests and allowed categories."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _policy():
    import importlib.util

    spec = importlib.util.spec_from_file_location("_root_conftest", ROOT / "tests" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.skip_allowed, module.skip_category


def test_categories_and_permission():
    skip_allowed, skip_category = _policy()
    assert skip_category("Debian package `prometheus` is not installed") == "prometheus"
    assert skip_category("promtool missing") == "prometheus"
    assert skip_category("vllm not installed") == "vllm"
    assert skip_category("something else") is None
    assert skip_allowed("tests/gpu/test_x.py::t", False, "needs a CUDA device", "")
    assert skip_allowed("tests/unit/t.py::t", True, "needs a CUDA device", "")
    assert not skip_allowed("tests/unit/t.py::t", False, "vllm not installed", "")
    assert not skip_allowed("tests/unit/t.py::t", False, "vllm not installed", "prometheus")
    assert skip_allowed("tests/unit/t.py::t", False, "vllm not installed", "prometheus, vllm")
    assert not skip_allowed("tests/unit/t.py::t", False, "no reason given", "vllm,prometheus")


@pytest.mark.parametrize(("allow", "rc"), [("", 1), ("prometheus", 0), ("vllm", 1)])
def test_a_skip_fails_the_run_unless_allowed(tmp_path: Path, allow: str, rc: int):
    """A real pytest run of a test that skips for a missing Prometheus binary."""
    import shutil

    folder = tmp_path / "probe"
    folder.mkdir()
    shutil.copy(ROOT / "tests" / "conftest.py", folder / "conftest.py")  # the real policy
    (folder / "test_probe.py").write_text(
        "import pytest\n\ndef test_p():\n    pytest.skip('prometheus binary missing')\n"
    )
    env = {**os.environ, "STPPO_ALLOW_SKIP": allow}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", os.devnull,
         "--rootdir", str(folder), str(folder)],
        cwd=folder, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == rc, out.stdout + out.stderr
    if rc:
        assert "skipped without permission" in out.stdout
        assert "STPPO_ALLOW_SKIP=prometheus" in out.stdout
