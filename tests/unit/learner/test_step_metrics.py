"""The step's metric bookkeeping (learner/step_metrics.py): token-weighted micro-batch
means, per-optimizer-step means, and the one-rank reduce."""

from __future__ import annotations

import pytest

from learner.step_metrics import StepAccumulator

ZERO = {"clip_ratio_turn": 0.0, "approx_kl": 0.0, "kl_ref": 0.0, "entropy": 0.0,
        "clip_ratio_dual": 0.0, "token_bound_ratio": 0.0}  # fmt: skip


def test_token_metrics_are_token_weighted_and_turn_metrics_turn_weighted():
    acc = StepAccumulator()
    # micro 1: 30 tokens at clip 0.1, 2 turns at 0.5; micro 2: 10 tokens at 0.5, 6 turns at 0
    acc.add_micro({**ZERO, "clip_ratio": 0.1, "clip_ratio_turn": 0.5}, 30, 2)
    acc.add_micro({**ZERO, "clip_ratio": 0.5, "clip_ratio_turn": 0.0}, 10, 6)
    acc.reduce(world_size=1)
    # (0.1 * 30 + 0.5 * 10) / 40 = 8 / 40 = 0.2, not the micro-batch mean 0.3
    assert acc.mean("clip_ratio") == pytest.approx(0.2)
    # (0.5 * 2 + 0 * 6) / 8 turns = 0.125
    assert acc.mean("clip_ratio_turn") == pytest.approx(0.125)


def test_per_update_metrics_average_over_optimizer_steps():
    acc = StepAccumulator()
    acc.mini["pg_loss"] += [0.4, -0.2]  # two optimizer steps
    acc.mini["clip_bias_scale"] += [1.0, 0.5]
    acc.reduce(world_size=1)
    assert acc.mean("pg_loss") == pytest.approx(0.1)
    assert acc.mean("clip_bias_scale") == pytest.approx(0.75)
    assert acc.mean("clip_bias_norm", default=-1.0) == -1.0  # none logged: the default
    assert acc.mean("entropy") == 0.0  # no micro-batch: the default, not a division by 0
