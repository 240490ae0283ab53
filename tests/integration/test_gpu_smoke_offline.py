"""``scripts/gpu_smoke.sh --learner`` and ``--scale``'s offline path, emulated on a machine
without a GPU.

The GPU machine it is written for has no network, a system Python with CUDA torch and
transformers, and nothing else of the project but what is carried there (README, "GPU
users"). Here: a fresh folder holding only the checkout's files (``git ls-files``: tracked,
and untracked ones not ignored), the bundle ``scripts/gpu_bundle.py prepare`` makes (wheel
folder and tokenizer-only model; the wheels repacked from this venv, ``--from-installed``,
so no network is needed), no ``data/``, no ``.venv``; the project venv's python stands in
for the machine's, pip gets no index (``PIP_NO_INDEX=1``, no pip config), every bundled
wheel is installed (``STPPO_GPU_FORCE_INSTALL=1``: this venv already has them all), and
CUDA is hidden. The script must get through the install, the imports and the model folder
to its first CUDA check and stop there with "no CUDA device" (exit 3), not on an import or
a download.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from script_modules import load_script

from services.env import PROJECT_ROOT

pytestmark = pytest.mark.integration

MIB = 2**20
CARRY_LIMIT_MIB = 64
"""What the GPU machine's tool carries per command: checkout + bundle must fit."""
BUNDLED = (
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "tenacity",
    "hjson",
    "deepspeed",
)


def checkout_files() -> list[str]:
    """The files a fresh clone has (tracked, plus new files not ignored yet committed)."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=PROJECT_ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    # data/: the built assets (a folder, ignored; a link in a worktree, not ignored)
    return [f for f in out.split("\0") if f and f.split("/")[0] != "data"]


@pytest.mark.parametrize("mode", ["--learner", "--scale", "--job"])
def test_learner_smoke_installs_offline_and_stops_at_the_cuda_check(
    tmp_path: Path, model_dir: Path, mode: str
):
    root = tmp_path / "checkout"
    for rel in checkout_files():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        if (PROJECT_ROOT / rel).is_symlink():  # services/configs -> ../deploy/configs
            (root / rel).symlink_to(os.readlink(PROJECT_ROOT / rel))
        else:
            shutil.copy2(PROJECT_ROOT / rel, root / rel)
    assert not (root / "data").exists() and not (root / ".venv").exists()

    prep = subprocess.run(
        [
            *(sys.executable, "scripts/gpu_bundle.py", "prepare", "--out", ".gpu-bundle"),
            *("--model", str(model_dir), "--from-installed"),
            *(["--job"] if mode == "--job" else []),
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert prep.returncode == 0, prep.stdout + prep.stderr
    bundle = root / ".gpu-bundle"
    assert not list(bundle.rglob("*.safetensors"))
    assert (bundle / "data/model/smollm2-135m-instruct/tokenizer.json").is_file()
    # what one command carries: checkout + learner bundle, plus at most one job part
    parts = sorted(bundle.glob("job-parts/*.part-*"))
    total = sum(f.stat().st_size for f in root.rglob("*") if f.is_file() and f not in parts)
    largest = max((p.stat().st_size for p in parts), default=0)
    assert total + largest < CARRY_LIMIT_MIB * MIB, f"one carry {(total + largest) / MIB:.1f} MiB"
    assert (mode == "--job") == bool(parts)

    cache = str(PROJECT_ROOT / ".cache")  # conftest pointed HF_HOME, TMPDIR... there
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PIP_", "STPPO_", "PYTHON", "VIRTUAL_ENV")) and not v.startswith(cache)
    }
    env.update(
        PIP_NO_INDEX="1",
        PIP_CONFIG_FILE=os.devnull,  # no find-links or extra index from this machine's config
        STPPO_GPU_PYTHON=sys.executable,
        STPPO_GPU_FORCE_INSTALL="1",
        CUDA_VISIBLE_DEVICES="",
    )
    out = tmp_path / "report"
    run = subprocess.run(
        ["bash", "scripts/gpu_smoke.sh", mode, "--out", str(out)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    log = run.stdout + run.stderr
    assert run.returncode == 3, log
    assert "FAILED: no CUDA device" in run.stderr, log
    assert "Traceback" not in log and "ModuleNotFoundError" not in log, log
    site = root / ".cache" / "gpu-site"
    installed = {p.name.split("-")[0].lower().replace("_", "-") for p in site.glob("*.dist-info")}
    if mode == "--job":  # the learner's wheels and the job's, joined from the parts
        assert set(BUNDLED) | {"ray", "fastapi", "uvicorn", "bm25s"} <= installed, log
        assert "[gpu-bundle] joined" in run.stdout, log
    else:
        assert installed == set(BUNDLED), log
    # the bundled copies are the ones imported (the site folder comes first on the path)
    imported = dict(re.findall(r"^\[gpu-smoke\]\s+(\S+)\s+\S*\s+(/\S+)$", run.stdout, re.M))
    assert imported["deepspeed"] == f"{site}/deepspeed/__init__.py", log
    assert imported["pydantic"] == f"{site}/pydantic/__init__.py", log
    assert imported["learner.trainer"] == f"{root}/learner/trainer.py", log
    if mode == "--job":
        assert imported["ray"] == f"{site}/ray/__init__.py", log
        assert imported["services.driver"] == f"{root}/services/driver.py", log
    assert "model: llama, 30 layers, hidden 576" in log, log
    figures = json.loads((out / "figures.json").read_text())
    assert figures["status"] == "stopped" and figures["reason"].startswith("no CUDA device")
    assert "no CUDA device" in (out / "report.txt").read_text()


def test_job_bundle_parts_join_and_install_offline(tmp_path: Path, model_dir: Path):
    """The job's wheels (Ray, FastAPI, BM25...) made into parts of at most 48 MiB (repacked
    from this venv), carried part by part, joined (every sum checked) and installed with no
    index into a target folder, from which ray and the retrieval server's stack import."""
    bundle = tmp_path / "bundle"
    prep = subprocess.run(
        [
            *(sys.executable, str(PROJECT_ROOT / "scripts/gpu_bundle.py"), "prepare"),
            *("--out", str(bundle), "--model", str(model_dir), "--from-installed", "--job"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert prep.returncode == 0, prep.stdout + prep.stderr
    parts = sorted((bundle / "job-parts").glob("*.part-*"))
    assert len(parts) >= 2 and all(p.stat().st_size <= 48 * MIB for p in parts)
    # the machine: parts arrive one command at a time; join refuses until all are there
    there = tmp_path / "there"
    (there / "job-parts").mkdir(parents=True)
    shutil.copy2(bundle / "job-parts" / "job-wheels.manifest.json", there / "job-parts")
    script = [sys.executable, str(PROJECT_ROOT / "scripts/gpu_bundle.py")]
    for i, part in enumerate(parts):
        joined = subprocess.run(
            [*script, "join", "--bundle", str(there)], capture_output=True, text=True
        )
        assert joined.returncode == 1 and f"{len(parts) - i} of {len(parts)} parts missing" in (
            joined.stderr
        ), joined.stderr
        shutil.copy2(part, there / "job-parts")
    joined = subprocess.run(
        [*script, "join", "--bundle", str(there)], capture_output=True, text=True
    )
    assert joined.returncode == 0, joined.stderr
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_CONFIG_FILE": os.devnull}
    site = tmp_path / "site"
    install = subprocess.run(
        [*script, "install", "--bundle", str(there), "--target", str(site), "--job", "--force"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import ray, fastapi, uvicorn, bm25s; print(ray.__file__, fastapi.__file__)",
        ],
        capture_output=True,
        text=True,
        env={**env, "PYTHONPATH": str(site)},
    )
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.split() == [
        f"{site}/ray/__init__.py",
        f"{site}/fastapi/__init__.py",
    ], probe.stdout


def _link_distributions(names, site: Path) -> None:
    """Symlink the top-level files and folders of installed distributions ``names`` into
    ``site`` (a bare venv's site-packages): that venv then imports exactly those."""
    import importlib.metadata as metadata

    for name in names:
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        root = Path(dist.locate_file(""))
        for top in {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}:
            if (root / top).exists() and not (site / top).exists():
                (site / top).symlink_to(root / top)


def test_the_job_imports_from_the_machine_and_the_bundles_alone(tmp_path: Path):
    """A bare venv holding only what the GPU machine has (torch, transformers and what they
    and the learner's DeepSpeed require) and the two bundles' distributions imports every
    module the job starts, and the CLI answers: the job's wheel list misses nothing the
    job imports at start-up. (The whole 4-step synthetic job ran this way on the CPU.)"""
    gpu_bundle = load_script(PROJECT_ROOT / "scripts" / "gpu_bundle.py", "gpu_bundle")
    venv = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [python, "-c", "import site; print(site.getsitepackages()[0])"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
    )  # fmt: skip
    machine = gpu_bundle.requirement_closure((*gpu_bundle.MACHINE_ROOTS, "deepspeed"))
    _link_distributions([*machine, *gpu_bundle.WHEELS, *gpu_bundle.job_closure()], site)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    modules = "services.driver, services.cli, retrieval_server.server, actors.engines.hf"
    probe = subprocess.run(
        [python, "-c", f"import {modules}, learner.trainer, ray, fastapi; print(ray.__file__)"],
        cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert probe.stdout.strip().startswith(str(site)), probe.stdout
    cli = subprocess.run(
        [python, "-m", "services.cli", "--help"],
        cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert cli.returncode == 0 and "prepare-synthetic" in cli.stdout, cli.stderr[-2000:]
