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

The job's wheels (Ray, the retrieval server's FastAPI stack, the CLI's typer and rich: what
the driver imports beyond the learner path, :func:`job_closure`) are ~100 MiB, more than one
command carries (64 MiB). ``prepare --job`` also writes them as a tar in parts of at most
``--part-mib`` (default: what one command has left, :func:`default_part_mib`) with a
manifest of sha256 sums, ``.gpu-bundle/job-parts/``; each
part goes up with one command while the machine stays warm (into the same ignored folder), and
there::

    python3 scripts/gpu_bundle.py join --bundle .gpu-bundle   # checks every part, then the tar
    python3 scripts/gpu_bundle.py install --bundle .gpu-bundle --job

``join`` names the parts still missing (or damaged) and writes nothing until all are there and
each sum matches; then ``install --job`` installs the job's wheels the interpreter lacks too.
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import importlib.metadata
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
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


JOB_ROOTS = (
    "ray",
    "fastapi",
    "uvicorn",
    "httptools",
    "uvloop",
    "httpx",
    "typer",
    "rich",
    "tqdm",
    "bm25s",
    "pystemmer",
    "prometheus-client",
)
"""What the job imports beyond the learner path (:data:`WHEELS`): local Ray, the retrieval
server (FastAPI, uvicorn, BM25), the driver's HTTP client and metrics, the CLI."""

MACHINE_ROOTS = ("torch", "transformers")
"""What the GPU machine's Python has, with everything they require."""

CARRY_MIB = 64
"""What one command to the GPU machine carries: the checkout's files, the learner bundle and
one job part."""

CARRY_MARGIN_MIB = 2
"""Room left in every carry (file-system rounding, a file added after ``prepare``)."""

MIN_PART_MIB = 8
"""Smaller job parts would take more commands than a 15-minute window has."""


def checkout_bytes(root: Path, exclude: Path) -> int:
    """Bytes of the files a command carries from the checkout at ``root``: what git tracks
    or would track (``git ls-files --cached --others --exclude-standard``); outside a git
    checkout, every file under ``root``. Files under ``exclude`` (the bundle) are left out."""
    exclude = exclude.resolve()
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            capture_output=True, check=True, timeout=60,
        ).stdout.decode()  # fmt: skip
        files = [root / name for name in out.split("\0") if name]
    except (OSError, subprocess.CalledProcessError):
        files = [f for f in root.rglob("*") if f.is_file()]
    return sum(
        f.stat().st_size
        for f in files
        if f.is_file() and not f.is_symlink() and not f.resolve().is_relative_to(exclude)
    )


def default_part_mib(root: Path, bundle: Path) -> int:
    """The largest job part that one command carries beside the checkout at ``root`` and the
    learner bundle (``bundle`` without ``job-parts/``): :data:`CARRY_MIB` minus both minus
    :data:`CARRY_MARGIN_MIB`, in whole MiB.

    Raises:
        RuntimeError: less than :data:`MIN_PART_MIB` would be left.
    """
    learner = tree_bytes(bundle) - tree_bytes(bundle / "job-parts")
    used = checkout_bytes(root, bundle) + learner
    part = int((CARRY_MIB - CARRY_MARGIN_MIB) - used / MIB)
    if part < MIN_PART_MIB:
        raise RuntimeError(
            f"the checkout and the learner bundle take {used / MIB:.1f} MiB of a command's "
            f"{CARRY_MIB}: less than {MIN_PART_MIB} MiB left for a job part"
        )
    return part


JOB_TAR = "job-wheels"
"""Stem of the job's tar, its parts (``job-wheels.tar.part-000``...) and manifest."""


def canonical(name: str) -> str:
    """PEP 503 normalised distribution name (``Pydantic_Core`` -> ``pydantic-core``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_name_version(path: Path) -> tuple[str, str]:
    """``(canonical name, version)`` from a wheel's file name."""
    name, version = path.name.split("-")[:2]
    return canonical(name), version


def download_command(
    dest: Path, python_version: str, pins: dict[str, str] | None = None
) -> list[str]:
    """The ``pip download`` command for the binary wheels of ``pins`` (default: those of
    :data:`WHEELS`, all but :data:`SDIST_ONLY`), for CPython ``python_version`` on
    manylinux x86_64."""
    digits = python_version.replace(".", "")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--python-version", python_version, "--implementation", "cp", "--abi", f"cp{digits}"]
    for platform in MANYLINUX:
        cmd += ["--platform", platform]
    cmd += ["-d", str(dest)]
    if pins is None:
        pins = {n: v for n, v in WHEELS.items() if n not in SDIST_ONLY}
    return cmd + [f"{n}=={v}" for n, v in pins.items()]


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


def prepare_job(
    out: Path, python_version: str, from_installed: bool, part_mib: int | None = None
) -> Path:
    """The job's wheels (:func:`job_closure`) as parts under ``out/job-parts``, each at most
    ``part_mib`` MiB (None: :func:`default_part_mib` for the checkout in the working
    directory); returns the manifest's path.

    Raises:
        subprocess.CalledProcessError: pip failed.
        RuntimeError: the wheel folder does not hold one wheel per distribution, or no room
            is left for a part.
    """
    if part_mib is None:
        shutil.rmtree(out / "job-parts", ignore_errors=True)  # not counted: replaced below
        part_mib = default_part_mib(Path.cwd(), out)
    pins = job_closure(python_version)
    with tempfile.TemporaryDirectory() as tmp:
        wheels = Path(tmp)
        if from_installed:
            for name in pins:
                repack_installed(name, wheels)
        else:
            cmd = download_command(wheels, python_version, pins)
            print("[gpu-bundle] " + " ".join(cmd[1:]), flush=True)
            subprocess.run(cmd, check=True)
        found = sorted(wheel_name_version(p)[0] for p in wheels.glob("*.whl"))
        if found != sorted(pins):
            raise RuntimeError(f"job wheels {found}, expected one of each of {sorted(pins)}")
        print(f"[gpu-bundle] job wheels: {len(pins)}, {tree_bytes(wheels) / MIB:.1f} MiB")
        manifest = split_folder(wheels, out / "job-parts", part_mib * MIB)
    parts = json.loads(manifest.read_text())["parts"]
    print(f"[gpu-bundle] job parts: {len(parts)} of at most {part_mib} MiB in {manifest.parent}")
    return manifest


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


def requirement_closure(roots: tuple[str, ...], python_version: str = "3.12") -> dict[str, str]:
    """Installed distributions ``roots`` need, themselves included, at their installed
    versions: ``Requires-Dist`` followed transitively (extras not followed), markers
    evaluated for CPython ``python_version`` on Linux. Requirements not installed here are
    left out.

    Returns:
        canonical name -> installed version.
    """
    from packaging.markers import default_environment
    from packaging.requirements import Requirement

    env = {**default_environment(), "python_version": python_version, "sys_platform": "linux"}
    env["python_full_version"] = f"{python_version}.0"
    found: dict[str, str] = {}
    stack = list(roots)
    while stack:
        name = canonical(stack.pop())
        if name in found:
            continue
        version = installed_version(name)
        if version is None:
            continue
        found[name] = version
        for line in importlib.metadata.distribution(name).requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({**env, "extra": ""}):
                stack.append(req.name)
    return found


def job_closure(python_version: str = "3.12") -> dict[str, str]:
    """The job's wheels: :data:`JOB_ROOTS`' closure less what the machine has
    (:data:`MACHINE_ROOTS`' closure) and less the learner bundle (:data:`WHEELS`)."""
    machine = requirement_closure(MACHINE_ROOTS, python_version)
    job = requirement_closure(JOB_ROOTS, python_version)
    return {n: v for n, v in sorted(job.items()) if n not in machine and n not in WHEELS}


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes (``hashlib.file_digest``, Python 3.11+)."""
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def split_folder(folder: Path, out: Path, part_bytes: int, stem: str = JOB_TAR) -> Path:
    """Write ``folder``'s files as one tar in parts of at most ``part_bytes`` into ``out``,
    with a manifest; returns the manifest's path.

    The tar is deterministic (sorted names, mtime 0, no owners), so the same folder gives
    the same parts. Manifest (``<stem>.manifest.json``): the tar's bytes and sha256, each
    part's file name, bytes and sha256, and each member's sha256.

    Raises:
        ValueError: ``part_bytes < 1`` or ``folder`` holds no file.
    """
    if part_bytes < 1:
        raise ValueError(f"part_bytes must be >= 1, got {part_bytes}")
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    if not files:
        raise ValueError(f"{folder} holds no file to split")
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob(f"{stem}.tar.part-*"):
        old.unlink()
    tar_path = out / f"{stem}.tar"
    with tarfile.open(tar_path, "w", format=tarfile.PAX_FORMAT) as tar:
        for path in files:
            info = tar.gettarinfo(path, arcname=str(path.relative_to(folder)))
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            with path.open("rb") as f:
                tar.addfile(info, f)
    parts = []
    with tar_path.open("rb") as f:
        for index in range(1 << 16):
            data = f.read(part_bytes)
            if not data:
                break
            part = out / f"{stem}.tar.part-{index:03d}"
            part.write_bytes(data)
            parts.append(
                {"file": part.name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            )
    manifest = {
        "tar": tar_path.name,
        "bytes": tar_path.stat().st_size,
        "sha256": sha256_file(tar_path),
        "parts": parts,
        "members": {str(p.relative_to(folder)): sha256_file(p) for p in files},
    }
    tar_path.unlink()
    path = out / f"{stem}.manifest.json"
    path.write_text(json.dumps(manifest, indent=2) + "\n")
    return path


def join_parts(manifest_path: Path, out: Path) -> list[str]:
    """Check the parts beside ``manifest_path`` against it, then unpack their tar into
    ``out``; returns the member names written.

    Nothing is written unless every part is present with its sha256, the joined tar has
    the manifest's sha256 and every member unpacks to its own.

    Raises:
        FileNotFoundError: parts are missing (all of them named).
        ValueError: a part, the tar or a member does not match its sha256 (named).
    """
    manifest = json.loads(manifest_path.read_text())
    folder = manifest_path.parent
    missing = [p["file"] for p in manifest["parts"] if not (folder / p["file"]).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{len(missing)} of {len(manifest['parts'])} parts missing in {folder}: "
            + ", ".join(missing)
        )
    for part in manifest["parts"]:
        if sha256_file(folder / part["file"]) != part["sha256"]:
            raise ValueError(f"{part['file']}: sha256 differs from the manifest (damaged)")
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        tar_path = Path(tmp) / manifest["tar"]
        with tar_path.open("wb") as joined:
            for part in manifest["parts"]:
                joined.write((folder / part["file"]).read_bytes())
        if sha256_file(tar_path) != manifest["sha256"]:
            raise ValueError(f"{manifest['tar']}: the joined parts' sha256 differs")
        staging = Path(tmp) / "members"
        with tarfile.open(tar_path) as tar:
            tar.extractall(staging, filter="data")
        for name, digest in manifest["members"].items():
            if sha256_file(staging / name) != digest:
                raise ValueError(f"{name}: sha256 differs from the manifest")
        out.mkdir(parents=True, exist_ok=True)
        for name in manifest["members"]:
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.move(staging / name, out / name)
    return sorted(manifest["members"])


def installed_version(name: str) -> str | None:
    """The version of distribution ``name`` this interpreter imports, or None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def install(bundle: Path, target: Path, force: bool, job: bool = False) -> list[str]:
    """Install the bundled wheels this interpreter lacks (or has at another version) into
    ``target`` with pip, no index. ``force`` installs every bundled wheel; ``job`` the
    job's wheels (``job-wheels/``, written by ``join``) instead of the learner's.

    Returns:
        The canonical names installed.

    Raises:
        FileNotFoundError: the bundle has no wheel folder.
        RuntimeError: a distribution of :data:`WHEELS` has no wheel in the bundle.
        subprocess.CalledProcessError: pip failed.
    """
    folder = bundle / ("job-wheels" if job else "wheels")
    if not folder.is_dir():
        how = "`scripts/gpu_bundle.py join`" if job else "`scripts/gpu_bundle.py prepare`"
        raise FileNotFoundError(f"{folder} is missing: make it with {how}")
    by_name = {wheel_name_version(p)[0]: p for p in sorted(folder.glob("*.whl"))}
    absent = [] if job else sorted(set(WHEELS) - set(by_name))
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
    prep.add_argument(
        "--job", action="store_true", help="also the job's wheels, in parts (job-parts/)"
    )
    prep.add_argument(
        "--part-mib",
        type=int,
        default=None,
        help=f"largest job part (default: {CARRY_MIB} MiB less the checkout and the learner "
        "bundle, which every command carries too)",
    )
    inst = sub.add_parser("install", help="install what is missing, there (no index)")
    inst.add_argument("--bundle", type=Path, default=Path(".gpu-bundle"))
    inst.add_argument("--target", type=Path, default=Path(".cache/gpu-site"))
    inst.add_argument("--force", action="store_true", help="install every bundled wheel")
    inst.add_argument("--job", action="store_true", help="the job's wheels (after join)")
    join = sub.add_parser("join", help="check the job parts and unpack them, there")
    join.add_argument("--bundle", type=Path, default=Path(".gpu-bundle"))
    args = parser.parse_args(argv)
    try:
        if args.command == "prepare":
            prepare(args.out, args.model, args.python_version, args.from_installed)
            if args.job:
                prepare_job(args.out, args.python_version, args.from_installed, args.part_mib)
        elif args.command == "join":
            manifest = args.bundle / "job-parts" / f"{JOB_TAR}.manifest.json"
            names = join_parts(manifest, args.bundle / "job-wheels")
            print(f"[gpu-bundle] joined {len(names)} job wheels into {args.bundle / 'job-wheels'}")
        else:
            install(args.bundle, args.target, args.force, args.job)
    except (subprocess.CalledProcessError, OSError, RuntimeError, ValueError) as error:
        sys.exit(f"[gpu-bundle] {args.command} failed: {error}")


if __name__ == "__main__":
    main()
