"""The repository stands alone: no file in it reads or links a folder beside the checkout.

A user's clone has nothing next to it, so a path that climbs out of the repository
(``../shared/...``, ``PROJECT_ROOT.parent``) is a broken link in the docs or a test that
fails on their machine. What the product needs from outside is copied in (the KubeRay CRDs
under ``deploy/schemas/kuberay/``, with their source commit).
"""

from __future__ import annotations

import re
import subprocess

from services.env import PROJECT_ROOT

TEXT_SUFFIXES = {".py", ".md", ".toml", ".yaml", ".yml", ".sh", ".cfg", ".ini", ".txt", ".json"}
OUTSIDE = re.compile(r"\.\./shared\b|PROJECT_ROOT\.parent\b|ROOT\.parent\s*/\s*[\"']shared")


def tracked_text_files() -> list:
    """The files git tracks (a clone's content), text ones only; Makefile and .ci/run too."""
    out = subprocess.run(
        ["git", "ls-files", "-z"], cwd=PROJECT_ROOT, capture_output=True, check=True
    ).stdout.decode()
    paths = [PROJECT_ROOT / p for p in out.split("\0") if p]
    return [
        p
        for p in paths
        if p.is_file() and (p.suffix in TEXT_SUFFIXES or p.name in ("Makefile", "run"))
    ]


def test_no_file_points_outside_the_repository():
    files = tracked_text_files()
    assert len(files) > 200  # the listing worked
    offenders = [
        f"{path.relative_to(PROJECT_ROOT)}:{n}: {line.strip()[:100]}"
        for path in files
        if path.name != "test_standalone.py"
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert offenders == [], "\n".join(offenders)


def test_the_pattern_catches_what_it_means_to():
    assert OUTSIDE.search("see [`../shared/spec/st-ppo.md`](../shared/spec/st-ppo.md)")
    assert OUTSIDE.search('CRD_DIR = PROJECT_ROOT.parent / "shared" / "schemas"')
    assert not OUTSIDE.search("- --corpus-path=/shared/data/corpus/passages.jsonl")  # in-pod path
