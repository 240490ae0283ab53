"""services.env on a KubeRay pod: Ray's token auth is left on when a token is provided."""

from __future__ import annotations

import os
import subprocess
import sys


def _auth_mode_after_configure(extra_env: dict[str, str]) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env.update(extra_env)
    code = (
        "import os; from services.env import configure_local_caches; "
        "configure_local_caches(); print(os.environ.get('RAY_AUTH_MODE', '<unset>'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


def test_local_runs_disable_ray_auth():
    assert _auth_mode_after_configure({}) == "disabled"


def test_a_provided_ray_token_keeps_ray_auth_on():
    # KubeRay (authOptions.mode: token) gives Ray pods the token; the driver must not
    # switch auth off before `ray.init(address="auto")` on such a cluster
    assert _auth_mode_after_configure({"RAY_AUTH_TOKEN": "t" * 32}) == "<unset>"
    assert _auth_mode_after_configure({"RAY_AUTH_TOKEN_PATH": "/x/token"}) == "<unset>"
    assert _auth_mode_after_configure({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "t"}) == "token"
