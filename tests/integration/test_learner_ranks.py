"""The learner on N ranks equals the learner on one (real Ray actors, a real gloo group, real
DeepSpeed, a tiny random Llama in fp32): the same fixed batch, one learner step of two
optimizer steps (8 trajectories, mini-batches of 4), ``num_ranks`` 1 vs 2, for ``ppo``,
``st_ppo`` and ``so_grpo`` at ZeRO-2 and ZeRO-3. Parameters after the steps and every
exported metric agree within the tolerances of ``tests/rank_groups.py`` and below.

One Ray cluster and one 1-rank plus one 2-rank group of :class:`LearnerRank` actors serve the
whole module: the ranks join their process groups once and rebuild their learners per case.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
from learner_factories import make_batch
from rank_groups import Ranks, assert_same_weights, rank_groups

from learner.config import LearnerConfig, PPOConfig, SOGRPOConfig, STPPOConfig

pytestmark = pytest.mark.integration

METRIC_RTOL, METRIC_ATOL = 1e-5, 1e-6

NOT_COMPARED = {"step_s", "tokens_per_s"}  # wall time


@pytest.fixture(scope="module")
def groups() -> Iterator[dict[int, Ranks]]:
    yield from rank_groups((1, 2), num_cpus=4)


def run(ranks: Ranks, model: Path, algorithm, zero_stage: int, micro: int):
    config = LearnerConfig(
        dtype="fp32",
        zero_stage=zero_stage,
        num_ranks=len(ranks.actors),
        train_batch_size=8,
        mini_batch_size=4,
        micro_batch_size=micro,
        actor_lr=1e-3,
        critic_lr=1e-3,
    )
    ranks.build(model, config, algorithm)
    metrics = ranks.call("step", make_batch(11, num=8))
    exports = ranks.call("export_weights")
    return metrics, exports


def turn_values(metrics) -> list[float | None]:
    """``StepMetrics.turn_advantages`` flattened: mean, min, max of every turn, in order
    (None for an excluded trajectory)."""
    flat: list[float | None] = []
    for turns in metrics.to_dict()["turn_advantages"]:
        if turns is None:
            flat.append(None)
            continue
        flat += [turn[k] for turn in turns for k in ("mean", "min", "max")]
    return flat


def assert_same_metrics(actual, expected, *, rtol: float, atol: float) -> None:
    for name, value in expected.to_dict().items():
        if name in NOT_COMPARED:
            continue
        if name == "turn_advantages":
            assert turn_values(actual) == pytest.approx(turn_values(expected), rel=rtol, abs=atol)
            continue
        other = actual[name]
        if isinstance(value, float) and math.isnan(value):
            assert isinstance(other, float) and math.isnan(other), name
        elif isinstance(value, float):
            assert other == pytest.approx(value, rel=rtol, abs=atol), name
        else:
            assert other == value, name


VARIANTS = {  # ppo: decoupled (proximal log-probs all-gathered); the others clip from token 1
    "ppo": PPOConfig(off_policy="decoupled"),
    "st_ppo": STPPOConfig(tau=1e-3, off_policy="behavior"),
    "so_grpo": SOGRPOConfig(tau=1e-3, off_policy="behavior"),
}


@pytest.mark.parametrize("zero_stage", [2, 3])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_two_ranks_equal_one(groups, tiny_llama_dir, variant, zero_stage):
    algorithm = VARIANTS[variant]
    (one,), (one_export,) = run(groups[1], tiny_llama_dir, algorithm, zero_stage, micro=1)
    two, two_exports = run(groups[2], tiny_llama_dir, algorithm, zero_stage, micro=1)

    # every rank reports the same (global) metrics, and they equal one rank's
    assert two[0].optimizer_steps == one.optimizer_steps == 2
    assert one.skipped_steps == two[0].skipped_steps == 0
    assert_same_metrics(two[1], two[0], rtol=0.0, atol=0.0)
    assert_same_metrics(two[0], one, rtol=METRIC_RTOL, atol=METRIC_ATOL)
    if variant != "ppo":
        assert 0.0 < one.clip_bias_scale < 1.0  # the scale acted

    # rank 0 exports the gathered HF-named weights, rank 1 nothing
    weights, version = two_exports[0]
    assert two_exports[1].state_dict == {} and version == one_export.policy_version == 1
    assert sorted(weights) == sorted(one_export.state_dict)
    worst_abs, worst_rel = 0.0, 0.0
    for name, tensor in one_export.state_dict.items():
        diff = (weights[name] - tensor).abs()
        worst_abs = max(worst_abs, float(diff.max()))
        big = tensor.abs() > 1e-3
        if big.any():
            worst_rel = max(worst_rel, float((diff[big] / tensor.abs()[big]).max()))
        assert_same_weights(name, weights[name], tensor)
    print(
        f"[{variant} zero{zero_stage}] max |dw| {worst_abs:.2e}, max rel (|w|>1e-3) {worst_rel:.2e}"
    )


@pytest.mark.parametrize("variant", ["st_ppo", "so_grpo"])
def test_one_clip_bias_norm_and_scale_whatever_ranks_and_micro_batches(
    groups, tiny_llama_dir, variant
):
    """One ``||C||`` and one ``s`` per optimizer step, identical on every rank, for 1 rank
    with the mini-batch in one forward and 2 ranks with micro-batches of 1 and 2."""
    algorithm = VARIANTS[variant]
    (reference,), _ = run(groups[1], tiny_llama_dir, algorithm, 2, micro=4)
    for micro in (1, 2):
        two, _ = run(groups[2], tiny_llama_dir, algorithm, 2, micro=micro)
        for rank in two:
            assert_same_metrics(rank, reference, rtol=METRIC_RTOL, atol=METRIC_ATOL)
    assert reference.clip_bias_scale < 1.0


@pytest.mark.parametrize("zero_stage", [0, 1, 2])
def test_param_bias_norm_on_two_ranks_at_every_stage_it_claims(groups, tiny_llama_dir, zero_stage):
    """``bias_norm = param`` (gradient vectors all-reduced before the norm) and the stages
    below 2 (gradients reduced inside ``step``; fp32 ZeRO-0's own finiteness check agreed
    across ranks) give one rank's result on two."""
    algorithm = STPPOConfig(tau=1e-3, off_policy="behavior", bias_norm="param")
    (one,), (one_export,) = run(groups[1], tiny_llama_dir, algorithm, zero_stage, micro=1)
    two, two_exports = run(groups[2], tiny_llama_dir, algorithm, zero_stage, micro=1)
    assert one.clip_bias_scale < 1.0 and one.optimizer_steps == 2 and one.skipped_steps == 0
    assert_same_metrics(two[1], two[0], rtol=0.0, atol=0.0)
    assert_same_metrics(two[0], one, rtol=METRIC_RTOL, atol=METRIC_ATOL)
    for name, tensor in one_export.state_dict.items():
        assert_same_weights(name, two_exports[0].state_dict[name], tensor)
