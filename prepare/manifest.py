"""Read the JSON manifests the prepare steps write (``corpus/manifest.json``, the model's
build info, ``qa/report.json``) with errors that name the file and the missing key.

Example::

    manifest = read_manifest(corpus_dir / "manifest.json", ("passages_sha256", "num_passages"))
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any


class ManifestError(ValueError):
    """A manifest is missing, not a JSON object, or lacks a key (the message names both)."""


def read_manifest(path: Path, required: Iterable[str], hint: str = "") -> dict[str, Any]:
    """The JSON object in ``path``, checked to hold every key of ``required``.

    Args:
        path: the manifest file.
        required: top-level keys that must be present.
        hint: what to do about it, appended to the message (e.g. ``delete data/corpus``).

    Raises:
        ManifestError: the file is missing or unreadable, is not a JSON object, or lacks a
            key; e.g. ``data/corpus/manifest.json has no key 'passages_sha256' (...)``.
    """
    suffix = f" ({hint})" if hint else ""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(f"cannot read manifest {path}: {exc}{suffix}") from None
    if not isinstance(data, dict):
        raise ManifestError(f"{path} is not a JSON object{suffix}")
    for key in required:
        if key not in data:
            raise ManifestError(f"{path} has no key {key!r}{suffix}")
    return data
