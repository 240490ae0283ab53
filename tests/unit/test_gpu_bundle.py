"""``scripts/gpu_bundle.py``: the offline GPU bundle's wheel list stays in step with the
project's pins and the GPU docs page's recipe; an incomplete wheel folder is refused before pip
runs. (The install itself, end to end: ``tests/integration/test_gpu_smoke_offline.py``.)"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from script_modules import load_script

from services.env import PROJECT_ROOT

gpu_bundle = load_script(PROJECT_ROOT / "scripts" / "gpu_bundle.py", "gpu_bundle")


def test_bundled_versions_are_the_project_pins():
    deps = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = dict(
        re.match(r"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?==([^\s;,]+)", d).groups()
        for d in deps
        if "==" in d
    )
    pins = {gpu_bundle.canonical(k): v for k, v in pins.items()}
    pinned = {n: v for n, v in gpu_bundle.WHEELS.items() if n in pins}
    assert set(pinned) == {"pydantic", "tenacity", "deepspeed"}
    assert pinned == {n: pins[n] for n in pinned}


def test_gpu_page_recipe_names_every_bundled_wheel():
    page = (PROJECT_ROOT / "docs" / "gpu.md").read_text()
    for name, version in gpu_bundle.WHEELS.items():
        assert f"{name}=={version}" in page, name


def test_download_command_is_binary_only_for_python_312_manylinux(tmp_path: Path):
    cmd = gpu_bundle.download_command(tmp_path, "3.12")
    assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"]
    assert "--only-binary=:all:" in cmd and cmd[cmd.index("--abi") + 1] == "cp312"
    assert "deepspeed==0.19.8" not in cmd  # sdist only: built by build_command
    assert "deepspeed==0.19.8" in gpu_bundle.build_command(tmp_path)


def test_install_refuses_a_wheel_folder_missing_a_distribution(tmp_path: Path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for name, version in gpu_bundle.WHEELS.items():
        if name != "hjson":
            stem = name.replace("-", "_")
            (wheels / f"{stem}-{version}-py3-none-any.whl").write_bytes(b"")
    with pytest.raises(RuntimeError, match="hjson"):
        gpu_bundle.install(tmp_path, tmp_path / "site", force=True)
    assert not (tmp_path / "site").exists()
