"""Options of the decoupled objective set under ``off_policy = "behavior"`` fail at load.

``behavior`` (the ratio against the behaviour policy) is the default objective; it was
``decoupled`` before. A rollout correction, M2PO or the log-linear proximal would do nothing
under it, so a config that sets one (for instance an old config that relied on the former
default) must fail at load, naming every such field it set and the setting it needs,
``off_policy = "decoupled"``, instead of training another objective without a word.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from learner.config import _BEHAVIOR_WEIGHT_MIGRATION, PPOConfig, STPPOConfig
from services.config import ConfigError, load_config, update_config

REPO = Path(__file__).resolve().parents[3]

DECOUPLED_ONLY = {
    # the documented migration of behavior_weight_cap = 2: the correction's own defaults
    "rollout_correction": {"is_level": "token", "is_cap": 2.0},
    "m2po_threshold": 0.04,
    "proximal": "loglinear",
}


@pytest.mark.parametrize("field", list(DECOUPLED_ONLY))
@pytest.mark.parametrize("cls", [PPOConfig, STPPOConfig])
def test_a_decoupled_option_with_the_default_objective_fails_naming_it(cls, field):
    with pytest.raises(ValidationError) as err:
        cls.model_validate({field: DECOUPLED_ONLY[field]})
    message = str(err.value)
    assert 'off_policy = "decoupled"' in message
    assert field in message
    # off_policy was left at its default: the message says so (the old default differed)
    assert "off_policy is not set" in message


def test_every_decoupled_option_set_is_named_in_one_message():
    with pytest.raises(ValidationError) as err:
        PPOConfig.model_validate({"off_policy": "behavior", **DECOUPLED_ONLY})
    message = str(err.value)
    assert 'off_policy = "decoupled"' in message
    for field in DECOUPLED_ONLY:
        assert field in message
    assert "off_policy is not set" not in message  # the user chose behavior


def test_unset_or_inert_values_load_under_the_behaviour_objective():
    for data in (
        {},
        {"rollout_correction": None},  # what a live switch to behavior writes
        {"m2po_threshold": None},
        {"proximal": "recompute"},
        {"off_policy": "behavior", "rollout_correction": None, "m2po_threshold": None},
    ):
        assert PPOConfig.model_validate(data).off_policy == "behavior"
    # a dump re-validated (a live change, a resume) sets every field, none of them active
    cfg = PPOConfig()
    assert PPOConfig.model_validate(cfg.model_dump()) == cfg
    # with the decoupled objective each option loads (M2PO with the recomputed proximal)
    for field, value in DECOUPLED_ONLY.items():
        cfg = PPOConfig.model_validate({"off_policy": "decoupled", field: value})
        assert field in cfg.model_fields_set


def test_a_config_file_and_a_live_change_fail_the_same_way(tmp_path):
    cfg_file = tmp_path / "old.toml"
    cfg_file.write_text(
        '[algorithm]\nvariant = "ppo"\n\n[algorithm.rollout_correction]\n'
        'is_level = "token"\nis_cap = 2.0\n'
    )
    with pytest.raises(ConfigError, match='off_policy = "decoupled"'):
        load_config(cfg_file)
    cfg = load_config(None, ['algorithm.variant="ppo"'])
    with pytest.raises(ConfigError, match='off_policy = "decoupled"'):
        update_config(cfg, {"algorithm": {"m2po_threshold": 0.04}})


def test_the_migration_text_says_to_set_the_objective(tmp_path):
    assert 'off_policy = "decoupled"' in _BEHAVIOR_WEIGHT_MIGRATION
    # the docs' worked example of the migration loads, and trains the decoupled objective
    doc = (REPO / "docs" / "algorithms.md").read_text()
    section = doc.split("### Migration: `behavior_weight_cap`", 1)[1]
    example = re.search(r"```toml\n(.*?)```", section, re.S)
    assert example is not None
    block = example.group(1)
    assert 'off_policy = "decoupled"' in block
    cfg_file = tmp_path / "migrated.toml"
    cfg_file.write_text(block.replace("[algorithm]\n", '[algorithm]\nvariant = "ppo"\n', 1))
    cfg = load_config(cfg_file)
    assert cfg.algorithm.off_policy == "decoupled"
    assert cfg.algorithm.rollout_correction is not None
    assert cfg.algorithm.rollout_correction.is_cap == 2.0
