"""``stppo prepare`` against damaged assets: the corpus is verified by content (sha256), an
unpacked package folder is checked against its package before reuse, a manifest missing a
key names the key, and the command prints one ``error:`` line, never a traceback."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from prepare.corpus import build_corpus
from prepare.manifest import ManifestError, read_manifest
from prepare.packages import PinnedPackage
from prepare.unpacked import unpack_checked
from services.cli import app

PASSAGES = b'{"id": "0", "contents": "\\"Lima\\"\\nLima is the capital of Peru."}\n'


def _corpus(data_dir: Path, passages: bytes = PASSAGES) -> Path:
    """A finished corpus folder as build_corpus leaves it (one passage)."""
    corpus = data_dir / "corpus"
    corpus.mkdir(parents=True)
    (corpus / "passages.jsonl").write_bytes(passages)
    (corpus / "ATTRIBUTION").write_text("test\n")
    manifest = {
        "num_passages": 1,
        "num_words": 5,
        "counts_by_source": {"wikipedia": 1},
        "passages_bytes": len(passages),
        "passages_sha256": hashlib.sha256(passages).hexdigest(),
    }
    (corpus / "manifest.json").write_text(json.dumps(manifest))
    return corpus


def test_intact_corpus_verifies(tmp_path: Path) -> None:
    _corpus(tmp_path)
    report = build_corpus(tmp_path)
    assert (report.built, report.num_passages) == (False, 1)


def test_same_size_edit_of_passages_is_caught(tmp_path: Path) -> None:
    corpus = _corpus(tmp_path)
    edited = PASSAGES.replace(b"Lima is", b"Rome is")
    assert len(edited) == len(PASSAGES)
    (corpus / "passages.jsonl").write_bytes(edited)
    with pytest.raises(
        ValueError, match=r"passages.jsonl has sha256 [0-9a-f]{64}, manifest.json says"
    ):
        build_corpus(tmp_path)


def test_manifest_missing_a_key_names_it(tmp_path: Path) -> None:
    corpus = _corpus(tmp_path)
    manifest = json.loads((corpus / "manifest.json").read_text())
    del manifest["passages_sha256"]
    (corpus / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match=r"manifest.json has no key 'passages_sha256'"):
        build_corpus(tmp_path)


def test_read_manifest_rejects_non_objects(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    path.write_text("[1, 2]")
    with pytest.raises(ManifestError, match="is not a JSON object"):
        read_manifest(path, ())
    path.write_text("{not json")
    with pytest.raises(ManifestError, match="cannot read manifest"):
        read_manifest(path, ())


def test_damaged_unpacked_folder_is_unpacked_again(tmp_path: Path) -> None:
    packages = tmp_path / "packages"
    packages.mkdir()
    wheel = packages / "demo-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("demo/data.txt", "the original content\n")
        zf.writestr("demo/other.txt", "x" * 100)
    package = PinnedPackage(
        name="demo",
        version="1.0",
        filename=wheel.name,
        sha256=hashlib.sha256(wheel.read_bytes()).hexdigest(),
        kind="wheel",
        licence="MIT",
        what="test",
    )
    folder = unpack_checked(package, packages, packages / "unpacked")
    data = folder / "demo" / "data.txt"
    assert data.read_text() == "the original content\n"
    data.write_text("the damaged  content\n")  # same size, other bytes
    (folder / "demo" / "other.txt").unlink()
    again = unpack_checked(package, packages, packages / "unpacked")
    assert again == folder
    assert data.read_text() == "the original content\n"
    assert (folder / "demo" / "other.txt").read_text() == "x" * 100


@pytest.mark.parametrize("damage", ["missing_key", "same_size_edit"])
def test_prepare_prints_one_error_line(tmp_path: Path, damage: str) -> None:
    corpus = _corpus(tmp_path)
    if damage == "missing_key":
        manifest = json.loads((corpus / "manifest.json").read_text())
        del manifest["num_passages"]
        (corpus / "manifest.json").write_text(json.dumps(manifest))
    else:
        (corpus / "passages.jsonl").write_bytes(PASSAGES.replace(b"Lima is", b"Rome is"))
    result = CliRunner().invoke(app, ["prepare", "--data-dir", str(tmp_path), "--only", "corpus"])
    assert result.exit_code == 2
    errors = result.stderr.strip()  # the progress bar goes to stdout
    assert "Traceback" not in result.output
    assert errors.startswith("error: ") and len(errors.splitlines()) == 1, errors
    assert ("'num_passages'" if damage == "missing_key" else "sha256") in errors
