"""Project-local cache and temp folders, so runs leave nothing in /tmp or ~.

Call :func:`configure_local_caches` before importing torch, ray, deepspeed or vllm: those
libraries read these variables at import time.
"""

from __future__ import annotations

import os
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
"""The repository root (the folder holding pyproject.toml)."""

CACHE_ROOT = Path(os.environ.get("STPPO_CACHE_DIR", PROJECT_ROOT / ".cache"))
"""All caches live under here (git-ignored). Override with ``STPPO_CACHE_DIR``."""

_CACHE_VARS = {
    "HF_HOME": "huggingface",
    "TORCH_EXTENSIONS_DIR": "torch_extensions",
    "TORCHINDUCTOR_CACHE_DIR": "torchinductor",
    "VLLM_CACHE_ROOT": "vllm",
    "TRITON_CACHE_DIR": "triton",
    "MPLCONFIGDIR": "matplotlib",
    "TMPDIR": "tmp",
}


_DEFAULTS = (
    ("HF_HUB_OFFLINE", "1"),
    ("TRANSFORMERS_OFFLINE", "1"),
    ("RAY_AUTH_MODE", "disabled"),
    # per-process "Loading weights" bars from every actor would bury the step lines
    ("HF_HUB_DISABLE_PROGRESS_BARS", "1"),
    ("TRANSFORMERS_VERBOSITY", "error"),
)


def ray_temp_dir() -> Path:
    """Ray's ``_temp_dir`` (short path: Ray's unix sockets must stay under 107 bytes)."""
    path = CACHE_ROOT / "ray"
    path.mkdir(parents=True, exist_ok=True)
    return path


def configure_local_caches(hub_online: bool = False) -> dict[str, str]:
    """Point every cache/temp variable at ``CACHE_ROOT`` unless the user already set it.

    Also sets, unless already set: ``HF_HUB_OFFLINE=1`` (no hub is reachable; fail fast
    instead of retrying), ``RAY_AUTH_MODE=disabled`` for the local cluster (see README; not
    when a Ray token is in the environment, as on a KubeRay cluster with token auth),
    and quiet transformers logging (no per-actor weight-loading bars).

    Args:
        hub_online: leave ``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE`` unset (``model.path``
            is a hub id: :mod:`services.model_source` downloads it once, then every
            component loads the downloaded folder).

    Returns:
        The variables this call set (name -> value).
    """
    changed: dict[str, str] = {}
    for var, sub in _CACHE_VARS.items():
        if var not in os.environ:
            path = CACHE_ROOT / sub
            path.mkdir(parents=True, exist_ok=True)
            os.environ[var] = changed[var] = str(path)
    for var, value in _DEFAULTS:
        if var == "RAY_AUTH_MODE" and _ray_token_configured():
            continue  # a token is there (KubeRay's authOptions): leave Ray's auth to Ray
        if hub_online and var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
            continue
        if var not in os.environ:
            os.environ[var] = changed[var] = value
    return changed


def _ray_token_configured() -> bool:
    """True when the environment hands Ray a token (``RAY_AUTH_TOKEN`` or
    ``RAY_AUTH_TOKEN_PATH``), as KubeRay does in pods of a cluster with token auth."""
    return bool(os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH"))
