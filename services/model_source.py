"""Where the policy model comes from: a local Hugging Face folder, or a hub model id.

``model.path`` is either

- a local folder holding a causal-LM checkpoint that transformers loads (``config.json``
  with a ``model_type``, safetensors / bin weights, and a tokenizer with a chat template:
  the agent's prompt is the tokenizer's own chat template, so a Llama-3 or Qwen2 folder gets
  its own template in every rollout prompt); or
- a hub id ``org/name`` (with ``model.revision``), downloaded once by the driver with
  ``huggingface_hub.snapshot_download`` into the project's HF cache; every component then
  loads the downloaded folder, so rollout actors and the learner never reach the hub.

Offline mode (``HF_HUB_OFFLINE=1``, set by :func:`services.env.configure_local_caches`) stays
on for local folders, such as the embedded default; the commands turn it off only for a hub
id (:func:`is_hub_id`), unless you set ``HF_HUB_OFFLINE`` yourself. Offline, a hub id still
resolves when its snapshot is in the cache.

Example::

    folder = resolve_model_path(Path("Qwen/Qwen2.5-0.5B-Instruct"), revision=None)
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.config import RunConfig

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
_WEIGHTS = ("*.safetensors", "*.bin", "*.gguf")


class ModelSourceError(ValueError):
    """``model.path`` is neither a usable local folder nor a hub id that could be fetched."""


def is_hub_id(path: Path | str) -> bool:
    """True when ``path`` is not an existing local path and reads as ``org/name``."""
    text = str(path)
    return not Path(text).exists() and bool(_HUB_ID.match(text))


def check_model_dir(folder: Path, field: str = "model.path") -> Path:
    """Check that ``folder`` is a Hugging Face causal-LM folder the project can use.

    Raises:
        ModelSourceError: no folder, no or unreadable ``config.json`` / ``model_type``, no
            weights, no tokenizer, or a tokenizer without a chat template (naming ``field``).
    """
    if not folder.is_dir():
        raise ModelSourceError(f"{field}: {folder} is not a folder (nor an org/name hub id)")
    config_path = folder / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelSourceError(f"{field}: {config_path} is missing or not JSON ({e})") from None
    if not config.get("model_type"):
        raise ModelSourceError(f"{field}: {config_path} has no model_type")
    if not any(any(folder.glob(p)) for p in _WEIGHTS):
        raise ModelSourceError(f"{field}: {folder} holds no weights ({', '.join(_WEIGHTS)})")
    tok_config = folder / "tokenizer_config.json"
    if not tok_config.is_file():
        raise ModelSourceError(f"{field}: {folder} has no tokenizer (tokenizer_config.json)")
    template = json.loads(tok_config.read_text()).get("chat_template")
    if not template and not (folder / "chat_template.jinja").is_file():
        raise ModelSourceError(
            f"{field}: the tokenizer in {folder} has no chat template (tokenizer_config.json "
            "chat_template or chat_template.jinja); the agent prompt is built with it"
        )
    return folder


def resolve_model_path(path: Path, revision: str | None = None) -> Path:
    """The local folder of ``model.path``: the folder itself, or a hub id's downloaded
    snapshot (weights, configs and tokenizer files only), checked by :func:`check_model_dir`.

    Raises:
        ModelSourceError: see :func:`check_model_dir`; or a hub id that cannot be fetched
            (offline and not cached, unknown repo, no network), with the hub's reason.
    """
    if not is_hub_id(path):
        return check_model_dir(Path(path))
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(
            repo_id=str(path),
            revision=revision,
            allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"],
        )
    except Exception as e:  # huggingface_hub raises many types (offline, 404, HTTP, OS)
        raise ModelSourceError(
            f"model.path: {path} is not a local folder, and fetching it from the hub failed "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); offline, a hub "
            "id works only once it is in the HF cache"
        ) from None
    return check_model_dir(Path(folder))


def with_resolved_model(cfg: RunConfig) -> RunConfig:
    """``cfg`` with ``model.path`` replaced by its local folder (:func:`resolve_model_path`),
    so Ray actors and the learner load that folder and never reach the hub.

    Raises:
        ModelSourceError: as :func:`resolve_model_path`.
    """
    from services.config import update_config

    folder = resolve_model_path(cfg.model.path, cfg.model.revision)
    if folder == cfg.model.path:
        return cfg
    return update_config(cfg, {"model": {"path": str(folder)}})
