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


def _folder(tmp_path: Path) -> Path:
    import numpy as np

    rng = np.random.default_rng(0)
    folder = tmp_path / "wheels"
    folder.mkdir()
    for i, size in enumerate([5000, 12000, 1, 7000]):
        (folder / f"pkg{i}-1.0-py3-none-any.whl").write_bytes(rng.bytes(size))
    return folder


def test_split_then_join_gives_the_files_back(tmp_path: Path):
    folder = _folder(tmp_path)
    manifest = gpu_bundle.split_folder(folder, tmp_path / "parts", part_bytes=4096)
    parts = sorted((tmp_path / "parts").glob("*.part-*"))
    assert len(parts) > 4 and all(p.stat().st_size <= 4096 for p in parts)
    again = gpu_bundle.split_folder(folder, tmp_path / "parts2", part_bytes=4096)
    assert manifest.read_text() == again.read_text()  # deterministic: same parts, same sums
    names = gpu_bundle.join_parts(manifest, tmp_path / "out")
    assert names == sorted(p.name for p in folder.iterdir())
    for name in names:
        assert (tmp_path / "out" / name).read_bytes() == (folder / name).read_bytes()


def test_join_names_missing_and_damaged_parts_and_writes_nothing(tmp_path: Path):
    manifest = gpu_bundle.split_folder(_folder(tmp_path), tmp_path / "parts", part_bytes=4096)
    parts = sorted((tmp_path / "parts").glob("*.part-*"))
    parts[1].rename(tmp_path / "aside")
    parts[3].unlink()
    with pytest.raises(FileNotFoundError, match=f"2 of {len(parts)} parts missing") as missing:
        gpu_bundle.join_parts(manifest, tmp_path / "out")
    assert parts[1].name in str(missing.value) and parts[3].name in str(missing.value)
    (tmp_path / "aside").rename(parts[1])
    data = bytearray(parts[2].read_bytes())
    data[100] ^= 1
    parts[2].write_bytes(bytes(data))
    parts[3].write_bytes(b"")
    with pytest.raises(ValueError, match=parts[2].name):
        gpu_bundle.join_parts(manifest, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_job_closure_is_what_the_machine_lacks():
    """Ray and the retrieval server's stack, with their requirements, less what torch and
    transformers bring and less the learner bundle."""
    job = gpu_bundle.job_closure()
    assert {"ray", "fastapi", "uvicorn", "bm25s", "msgpack"} <= set(job)
    assert not {"torch", "transformers", "numpy", "deepspeed", "pydantic"} & set(job)
    assert job["ray"] == "2.60.0"


def test_default_part_leaves_room_for_the_checkout_and_the_learner_bundle(tmp_path: Path):
    root = tmp_path / "checkout"  # not a git checkout: every file under it is carried
    (root / "code").mkdir(parents=True)
    (root / "code" / "big.bin").write_bytes(b"\0" * (10 * gpu_bundle.MIB))
    bundle = root / ".gpu-bundle"
    (bundle / "wheels").mkdir(parents=True)
    (bundle / "wheels" / "w.whl").write_bytes(b"\0" * (5 * gpu_bundle.MIB + 1))
    (bundle / "job-parts").mkdir()
    (bundle / "job-parts" / "old.part-000").write_bytes(b"\0" * gpu_bundle.MIB)  # not counted
    # 64 - 2 margin - (10 + 5.000001) MiB = 46.99... -> 46
    assert gpu_bundle.default_part_mib(root, bundle) == 46
    (root / "code" / "big.bin").write_bytes(b"\0" * (50 * gpu_bundle.MIB))
    with pytest.raises(RuntimeError, match=r"take 55\.0 MiB of a command's 64"):
        gpu_bundle.default_part_mib(root, bundle)
