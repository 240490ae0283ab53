"""The offline bundle for ``scripts/gpu_smoke.sh --learner`` on a GPU machine with no network.

Such a machine (README, "GPU users") has a system Python 3.12 with CUDA torch and
transformers but not the project's other imports on the learner path. This module makes the
folder that is carried there, and installs from it there, standard library only:

``prepare`` (here, with the package registry reachable)::

    .venv/bin/python scripts/gpu_bundle.py prepare --out .gpu-bundle

writes ``.gpu-bundle/wheels/`` (the wheels of :data:`WHEELS`, for CPython 3.12 manylinux
x86_64, no dependencies resolved: the list is complete against that machine) and
``.gpu-bundle/data/model/smollm2-135m-instruct/`` (config, generation config, tokenizer and
chat template of the prepared model, no weights: the tests build random tiny models from the
tokenizer and ``benchmarks/learner_step.py --random-init`` random SmolLM2-135M weights from
the config), then prints the sizes. The wheels come from ``pip download --only-binary=:all:``
except DeepSpeed, which PyPI has only as an sdist: ``pip wheel --no-build-isolation`` builds
its pure-Python wheel with this environment's torch (pip's wheel cache answers after the
first build). ``--from-installed`` repacks the wheels from this interpreter's installed
distributions instead (no network; for this interpreter's Python version and platform: the
CPU test in ``tests/integration/test_gpu_smoke_offline.py`` uses it).

``install`` (there; ``scripts/gpu_smoke.sh`` calls it)::

    python3 scripts/gpu_bundle.py install --bundle .gpu-bundle --target .cache/gpu-site

installs every bundled wheel whose distribution the interpreter lacks, or has at another
version, into ``--target`` (put it first on ``PYTHONPATH``) with ``pip install --no-index
--no-deps --find-links``; the interpreter's own packages are never touched.
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import importlib.metadata
import io
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

WHEELS: dict[str, str] = {
    "pydantic": "2.14.3",
    "pydantic-core": "2.50.4",
    "annotated-types": "0.8.0",
    "typing-inspection": "0.4.5",
    "tenacity": "9.2.1",
    "hjson": "3.1.0",
    "deepspeed": "0.19.8",
}
"""Distribution -> version: what the learner path (``learner/``, ``actors/``, ``tests/gpu``,
``benchmarks/learner_step.py``) imports that the GPU machine's Python lacks, with their own
dependencies that it lacks too (pydantic's three; DeepSpeed's ``hjson``). The versions are
the project's pins (``pyproject.toml``) and what pip resolved with them."""

SDIST_ONLY = {"deepspeed"}
"""Distributions PyPI ships without a wheel: built here with ``pip wheel``."""

MODEL_NAME = "smollm2-135m-instruct"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx")
MANYLINUX = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
MIB = 2**20


def canonical(name: str) -> str:
    """PEP 503 normalised distribution name (``Pydantic_Core`` -> ``pydantic-core``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_name_version(path: Path) -> tuple[str, str]:
    """``(canonical name, version)`` from a wheel's file name."""
    name, version = path.name.split("-")[:2]
    return canonical(name), version


def download_command(dest: Path, python_version: str) -> list[str]:
    """The ``pip download`` command for the binary wheels of :data:`WHEELS` (all but
    :data:`SDIST_ONLY`), for CPython ``python_version`` on manylinux x86_64."""
    digits = python_version.replace(".", "")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--python-version", python_version, "--implementation", "cp", "--abi", f"cp{digits}"]
    for platform in MANYLINUX:
        cmd += ["--platform", platform]
    cmd += ["-d", str(dest)]
    return cmd + [f"{n}=={v}" for n, v in WHEELS.items() if n not in SDIST_ONLY]


def build_command(dest: Path) -> list[str]:
    """The ``pip wheel`` command for :data:`SDIST_ONLY` (pure-Python wheels; DeepSpeed's
    setup imports torch, hence no build isolation)."""
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    return cmd + ["-w", str(dest)] + [f"{n}=={WHEELS[n]}" for n in sorted(SDIST_ONLY)]


def repack_installed(name: str, dest: Path) -> Path:
    """Rebuild the wheel of installed distribution ``name`` from its RECORD into ``dest``.

    Keeps the files under site-packages (scripts installed elsewhere and ``*.pyc`` are
    dropped), the tags of its ``WHEEL`` file and a fresh RECORD.

    Raises:
        importlib.metadata.PackageNotFoundError: ``name`` is not installed.
        ValueError: its metadata has no RECORD or no wheel tag.
    """
    dist = importlib.metadata.distribution(name)
    files = dist.files
    wheel_meta = dist.read_text("WHEEL") or ""
    tags = [
        line.split(":", 1)[1].strip() for line in wheel_meta.splitlines() if line.startswith("Tag:")
    ]
    if not files or not tags:
        raise ValueError(f"{name}: installed without a RECORD or WHEEL tag; cannot repack")
    parts = [sorted({t.split("-")[i] for t in tags}) for i in range(3)]
    tag = "-".join(".".join(p) for p in parts)
    stem = re.sub(r"[-_.]+", "_", dist.metadata["Name"])
    out = dest / f"{stem}-{dist.version}-{tag}.whl"
    record_name = next(str(f) for f in files if str(f).endswith(".dist-info/RECORD"))
    rows = []
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as whl:
        for f in files:
            rel = str(f)
            skip = ("INSTALLER", "REQUESTED", "direct_url.json", "RECORD")
            if rel.startswith("..") or rel.endswith(".pyc") or rel.rsplit("/", 1)[-1] in skip:
                continue
            data = Path(dist.locate_file(f)).read_bytes()
            whl.writestr(rel, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            rows.append((rel, f"sha256={digest.decode()}", str(len(data))))
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows([*rows, (record_name, "", "")])
        whl.writestr(record_name, buf.getvalue())
    return out


def copy_tokenizer_only(model_dir: Path, dest: Path) -> list[Path]:
    """Copy ``model_dir``'s files except weights (:data:`WEIGHT_SUFFIXES`) into ``dest``.

    Raises:
        FileNotFoundError: ``model_dir`` has no ``config.json`` or ``tokenizer_config.json``.
    """
    for needed in ("config.json", "tokenizer_config.json"):
        if not (model_dir / needed).is_file():
            raise FileNotFoundError(f"{model_dir / needed} is missing: run `stppo prepare` first")
    dest.mkdir(parents=True, exist_ok=True)
    copied = []
    for src in sorted(model_dir.iterdir()):
        if src.is_file() and not src.name.endswith(WEIGHT_SUFFIXES):
            copied.append(Path(shutil.copy2(src, dest / src.name)))
    return copied


def tree_bytes(path: Path) -> int:
    """Total size in bytes of the files under ``path``."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def prepare(out: Path, model_dir: Path, python_version: str, from_installed: bool) -> None:
    """Write the bundle (see the module docstring) and print its sizes.

    Raises:
        subprocess.CalledProcessError: a pip command failed.
        RuntimeError: the wheel folder does not hold exactly one wheel per :data:`WHEELS` entry.
    """
    wheels = out / "wheels"
    if wheels.exists():
        shutil.rmtree(wheels)
    wheels.mkdir(parents=True)
    if from_installed:
        for name in WHEELS:
            print(f"[gpu-bundle] repacked {repack_installed(name, wheels).name}", flush=True)
    else:
        for cmd in (download_command(wheels, python_version), build_command(wheels)):
            print("[gpu-bundle] " + " ".join(cmd[1:]), flush=True)
            subprocess.run(cmd, check=True)
    found = sorted(wheel_name_version(p)[0] for p in wheels.glob("*.whl"))
    if found != sorted(WHEELS):
        raise RuntimeError(f"wheel folder holds {found}, expected one of each of {sorted(WHEELS)}")
    model_out = out / "data" / "model" / MODEL_NAME
    if model_out.exists():
        shutil.rmtree(model_out)
    copy_tokenizer_only(model_dir, model_out)
    print(f"[gpu-bundle] wheels {tree_bytes(wheels) / MIB:.1f} MiB in {wheels}")
    print(f"[gpu-bundle] tokenizer-only model {tree_bytes(model_out) / MIB:.1f} MiB in {model_out}")
    print(f"[gpu-bundle] total {tree_bytes(out) / MIB:.1f} MiB in {out}")


def installed_version(name: str) -> str | None:
    """The version of distribution ``name`` this interpreter imports, or None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def install(bundle: Path, target: Path, force: bool) -> list[str]:
    """Install the bundled wheels this interpreter lacks (or has at another version) into
    ``target`` with pip, no index. ``force`` installs every bundled wheel.

    Returns:
        The canonical names installed.

    Raises:
        FileNotFoundError: the bundle has no wheel folder.
        RuntimeError: a distribution of :data:`WHEELS` has no wheel in the bundle.
        subprocess.CalledProcessError: pip failed.
    """
    folder = bundle / "wheels"
    if not folder.is_dir():
        raise FileNotFoundError(
            f"{folder} is missing: make it with `scripts/gpu_bundle.py prepare`"
        )
    by_name = {wheel_name_version(p)[0]: p for p in sorted(folder.glob("*.whl"))}
    absent = sorted(set(WHEELS) - set(by_name))
    if absent:
        raise RuntimeError(f"{folder} has no wheel for {absent}")
    todo = []
    for name, path in sorted(by_name.items()):
        have, want = installed_version(name), wheel_name_version(path)[1]
        if force or have != want:
            todo.append(name)
        state = "install" if name in todo else "present"
        print(f"[gpu-smoke] {name:18s} machine {have or '-':10s} bundle {want:10s} -> {state}")
    if todo:
        target.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps"]
        cmd += ["--no-compile", "--upgrade", "--find-links", str(folder), "--target", str(target)]
        env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
        subprocess.run(cmd + [str(by_name[n]) for n in todo], check=True, env=env)
        print(f"[gpu-smoke] installed {', '.join(todo)} into {target}")
    return todo


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="make the bundle here (wheels + tokenizer-only model)")
    prep.add_argument("--out", type=Path, default=Path(".gpu-bundle"))
    prep.add_argument("--model", type=Path, default=Path("data/model") / MODEL_NAME)
    prep.add_argument("--python-version", default="3.12", help="the GPU machine's Python")
    prep.add_argument(
        "--from-installed",
        action="store_true",
        help="repack this interpreter's installed distributions (no network; its own Python "
        "version and platform, not --python-version)",
    )
    inst = sub.add_parser("install", help="install what is missing, there (no index)")
    inst.add_argument("--bundle", type=Path, default=Path(".gpu-bundle"))
    inst.add_argument("--target", type=Path, default=Path(".cache/gpu-site"))
    inst.add_argument("--force", action="store_true", help="install every bundled wheel")
    args = parser.parse_args(argv)
    try:
        if args.command == "prepare":
            prepare(args.out, args.model, args.python_version, args.from_installed)
        else:
            install(args.bundle, args.target, args.force)
    except (subprocess.CalledProcessError, OSError, RuntimeError, ValueError) as error:
        sys.exit(f"[gpu-bundle] {args.command} failed: {error}")


if __name__ == "__main__":
    main()
