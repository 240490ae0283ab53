"""Package pins: sha256 check, missing/corrupt files are errors that name the file."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from services.prepare.packages import (
    PACKAGES,
    PackageError,
    PinnedPackage,
    unpack_package,
    verify_package,
)


def _wheel(tmp_path: Path, name: str = "demo-1.0-py3-none-any.whl") -> tuple[Path, str]:
    path = tmp_path / name
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("demo/data.txt", "hello")
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


def _pin(filename: str, sha256: str) -> PinnedPackage:
    return PinnedPackage("demo", "1.0", filename, sha256, "wheel", "MIT", "test data")


def test_verify_accepts_matching_sha256(tmp_path: Path) -> None:
    path, digest = _wheel(tmp_path)
    assert verify_package(_pin(path.name, digest), tmp_path) == path


def test_checksum_mismatch_names_the_file(tmp_path: Path) -> None:
    path, _ = _wheel(tmp_path)
    wrong = "0" * 64
    with pytest.raises(PackageError, match="sha256 mismatch") as err:
        verify_package(_pin(path.name, wrong), tmp_path)
    assert str(path) in str(err.value)
    assert wrong in str(err.value)


def test_missing_file_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(PackageError, match="is missing") as err:
        verify_package(_pin("absent-1.0-py3-none-any.whl", "0" * 64), tmp_path)
    assert "absent-1.0-py3-none-any.whl" in str(err.value)


def test_corrupt_wheel_with_matching_sha_is_reported(tmp_path: Path) -> None:
    # A truncated download whose sha256 was (wrongly) pinned still fails at unzip, naming it.
    path = tmp_path / "broken-1.0-py3-none-any.whl"
    path.write_bytes(b"PK\x03\x04 not really a zip")
    pin = _pin(path.name, hashlib.sha256(path.read_bytes()).hexdigest())
    with pytest.raises(PackageError, match="not a valid wheel") as err:
        unpack_package(pin, tmp_path, tmp_path / "unpacked")
    assert str(path) in str(err.value)
    assert not (tmp_path / "unpacked" / "demo-1.0").exists()  # no half-unpacked folder


def test_unpack_writes_then_renames(tmp_path: Path) -> None:
    path, digest = _wheel(tmp_path)
    target = unpack_package(_pin(path.name, digest), tmp_path, tmp_path / "unpacked")
    assert target == tmp_path / "unpacked" / "demo-1.0"
    assert (target / "demo" / "data.txt").read_text() == "hello"
    assert not (tmp_path / "unpacked" / "demo-1.0.tmp").exists()


def test_every_pin_is_exact() -> None:
    for p in PACKAGES.values():
        assert len(p.sha256) == 64 and int(p.sha256, 16) >= 0
        assert p.version in p.filename.replace("%3a", ":")
        assert p.kind in ("wheel", "deb")
