"""model.path: a local HF folder is checked; a hub id resolves through the HF cache (offline
here: no hub is reachable), and the commands keep offline mode for local folders only."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from services.env import configure_local_caches
from services.model_source import (
    ModelSourceError,
    check_model_dir,
    is_hub_id,
    resolve_model_path,
)


def _folder(tmp_path: Path, template: bool = True, weights: bool = True) -> Path:
    folder = tmp_path / "m"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    tok = {"chat_template": "{{ messages }}"} if template else {}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok))
    if weights:
        (folder / "model.safetensors").write_bytes(b"")
    return folder


def test_is_hub_id() -> None:
    assert is_hub_id("Qwen/Qwen2.5-0.5B-Instruct")
    assert is_hub_id(Path("meta-llama/Llama-3.2-1B"))
    assert not is_hub_id("data/model/smollm2-135m-instruct")  # three parts: a path
    assert not is_hub_id("/abs/model") and not is_hub_id("./org/name") and not is_hub_id("m")


def test_local_folder_checks_name_the_field(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    assert check_model_dir(folder) == resolve_model_path(folder) == folder
    with pytest.raises(ModelSourceError, match=r"model\.path: .*no chat template"):
        check_model_dir(_folder(tmp_path / "a", template=False))
    with pytest.raises(ModelSourceError, match=r"model\.path: .*holds no weights"):
        check_model_dir(_folder(tmp_path / "b", weights=False))
    with pytest.raises(ModelSourceError, match=r"model\.path: .*config.json is missing"):
        (folder / "config.json").unlink()
        check_model_dir(folder)
    with pytest.raises(ModelSourceError, match="is not a folder"):
        resolve_model_path(tmp_path / "x" / "y" / "z")


def test_hub_id_offline_and_not_cached_fails_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants as hf_constants

    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelSourceError, match=r"model.path: nobody-xyz/no-model .*hub failed"):
        resolve_model_path(Path("nobody-xyz/no-model"))


def test_hub_id_resolves_from_the_hf_cache_offline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub.constants as hf_constants

    # the hub cache layout: models--org--name/{refs/main, snapshots/<commit>/...}
    cache = tmp_path / "hub"
    repo = cache / "models--acme--tiny-chat"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(_folder(tmp_path), repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    assert resolve_model_path(Path("acme/tiny-chat")) == repo / "snapshots" / commit


def test_offline_mode_is_left_off_only_for_a_hub_id(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    assert configure_local_caches(hub_online=True).get("HF_HUB_OFFLINE") is None
    assert "HF_HUB_OFFLINE" not in os.environ
    assert configure_local_caches()["HF_HUB_OFFLINE"] == "1"
