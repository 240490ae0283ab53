"""The variant resolved into a typed objective (learner.objective): each variant gets
exactly its parts, and the loss options are ones the policy loss takes."""

from __future__ import annotations

import inspect

import pytest
from pydantic import TypeAdapter

from learner.config import AlgorithmConfig
from learner.losses import compute_policy_loss
from learner.objective import Objective

ADAPTER = TypeAdapter(AlgorithmConfig)

# variant: (advantages from, ratio level, clip bias, segment gradient, objective)
TABLE = {
    "ppo": ("critic", "token", False, "mean", "clip"),
    "turn_ppo": ("critic", "turn", False, "mean", "clip"),
    "s_ppo": ("critic", "token", True, "mean", "clip"),
    "st_ppo": ("critic", "turn", True, "mean", "clip"),
    "gspo": ("critic", "sequence", False, "token", "clip"),
    "cispo": ("critic", "token", False, "mean", "cispo"),
    "grpo": ("group", "token", False, "mean", "clip"),
    "so_grpo": ("group", "turn", True, "mean", "clip"),
}


@pytest.mark.parametrize("variant", sorted(TABLE))
def test_each_variant_resolves_to_its_parts(variant):
    advantages, level, bias, segment, kind = TABLE[variant]
    objective = Objective.from_config(ADAPTER.validate_python({"variant": variant}))
    assert objective.variant == variant
    assert (objective.critic is not None, objective.group is not None) == (
        advantages == "critic", advantages == "group"
    )  # fmt: skip
    assert (objective.clip_bias is not None) == bias
    assert objective.loss.ratio_level == level
    assert objective.loss.segment_gradient == segment and objective.loss.objective == kind
    assert objective.decoupled is None  # the default objective: the behaviour policy
    accepted = set(inspect.signature(compute_policy_loss).parameters)
    assert set(objective.loss.kwargs()) <= accepted
    assert objective.loss.kwargs()["check_values"] is False


def test_options_reach_their_part():
    objective = Objective.from_config(
        ADAPTER.validate_python({
            "variant": "st_ppo", "turn_advantage": "turn_mean", "scale_target": "loss",
            "off_policy": "decoupled", "m2po_threshold": 0.04,
            "clip_eps_high": 0.28, "gamma": 0.9, "kl_mode": "loss", "entropy_coef": 0.01,
        })
    )  # fmt: skip
    assert objective.loss.turn_advantage == "turn_mean" and objective.loss.clip_eps_high == 0.28
    assert objective.clip_bias.needs_pre_pass and objective.clip_bias.scale_target == "loss"
    assert objective.decoupled.proximal == "recompute"
    assert objective.decoupled.m2po_threshold == 0.04
    assert objective.decoupled.correction.is_level == "token"  # the default correction
    assert objective.critic.gamma == 0.9
    assert (objective.kl_mode, objective.entropy_coef) == ("loss", 0.01)
    # turn_advantage belongs to turn-ratio variants: a token-level one keeps "token"
    plain = Objective.from_config(ADAPTER.validate_python({"variant": "s_ppo"}))
    assert plain.loss.turn_advantage == "token" and not plain.clip_bias.needs_pre_pass
