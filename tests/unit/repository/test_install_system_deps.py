"""scripts/install_system_deps.sh fails loudly when it cannot install (no silent skips),
unless STPPO_ALLOW_SKIP lists prometheus. apt-get and dpkg-query are fakes on PATH."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "install_system_deps.sh"


def _fake_bin(tmp: Path) -> Path:
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    fakes = {
        "dpkg-query": "exit 1",  # nothing installed
        "apt-get": "echo 'E: no mirror' >&2; exit 100",  # cannot install
        "tee": "cat >/dev/null; exit 1",  # never writes /usr/sbin/policy-rc.d
        "sudo": 'shift; exec "$@"',  # `sudo -n true` succeeds when not root
    }
    for name, body in fakes.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return bin_dir


@pytest.mark.parametrize(("allow", "rc"), [("", 1), ("vllm", 1), ("vllm, prometheus", 0)])
def test_cannot_install_fails_unless_allowed(tmp_path: Path, allow: str, rc: int):
    env = {**os.environ, "PATH": f"{_fake_bin(tmp_path)}:{os.environ['PATH']}"}
    env["STPPO_ALLOW_SKIP"] = allow
    out = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == rc, out.stdout + out.stderr
    assert "prometheus not installed" in out.stderr
    assert ("STPPO_ALLOW_SKIP=prometheus" in out.stderr) == (rc == 1)
