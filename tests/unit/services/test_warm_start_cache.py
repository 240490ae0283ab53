"""The warm start's cache key follows what the warm start depends on, and the cache keeps
complete entries only, the newest two."""

from __future__ import annotations

import json
import os
from pathlib import Path

from fixture_paths import FIXTURE_CORPUS

from services.config import load_config, update_config
from services.loop.warm_start_cache import DONE, KEEP, WarmStartCache, warm_start_key


def config(model: Path, index: Path, **changes):
    cfg = load_config(None, [f"model.path={json.dumps(str(model))}",
                             f"retrieval.server.corpus_path={json.dumps(str(FIXTURE_CORPUS))}",
                             f"retrieval.server.index_dir={json.dumps(str(index))}"])  # fmt: skip
    return update_config(cfg, changes) if changes else cfg


def test_the_key_changes_with_what_the_warm_start_depends_on_and_only_that(tmp_path):
    model, index = tmp_path / "model", tmp_path / "index"
    model.mkdir()
    index.mkdir()
    (model / "model.safetensors").write_bytes(b"weights")
    base = warm_start_key(config(model, index), "fp32")
    assert base == warm_start_key(config(model, index), "fp32")  # stable
    same = [
        {"algorithm": {"variant": "ppo"}},  # the warm start does not use it
        {"run": {"num_steps": 7, "output_dir": str(tmp_path / "elsewhere")}},
        {"buffer": {"max_staleness": 4}},
        {"learner": {"actor_lr": 3e-5, "critic_lr": 1e-4}},  # RL's, set after loading
    ]
    for change in same:
        assert warm_start_key(config(model, index, **change), "fp32") == base, change
    different = [
        {"sft": {"lr": 1e-3}},
        {"learner": {"num_ranks": 2}},  # its checkpoint resumes on the same ranks only
        {"run": {"seed": 1}},
        {"rollout": {"max_information_tokens": 99}},
        {"retrieval": {"server": {"method": "dense"}}},
    ]
    for change in different:
        assert warm_start_key(config(model, index, **change), "fp32") != base, change
    assert warm_start_key(config(model, index), "bf16") != base  # "auto" resolved otherwise
    stat = (model / "model.safetensors").stat()
    os.utime(model / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert warm_start_key(config(model, index), "fp32") != base  # a re-prepared model


def test_only_complete_entries_count_and_the_newest_are_kept(tmp_path):
    cache = WarmStartCache(tmp_path)
    staged = cache.staging("a")
    (staged / "learner_state.json").write_text("{}")
    assert cache.lookup("a") is None  # staged, not committed: an interrupted run's
    for i, key in enumerate(["a", "b", "c"]):
        if key != "a":
            cache.staging(key)
        entry = cache.commit(key, {"policy_version": i})
        os.utime(entry / DONE, ns=(i * 10**9, i * 10**9))  # commit order, whatever the clock
    folder, record = cache.lookup("c")
    assert folder == tmp_path / "c" / "learner" and record == {"policy_version": 2}
    assert cache.lookup("a") is None and len(list(tmp_path.iterdir())) == KEEP
