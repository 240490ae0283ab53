"""The decoupled objective's off-policy inputs: proximal log-probs and behaviour weights.

With ``off_policy = decoupled`` (spec section 5) the PPO ratio is taken against a proximal
policy and each token is weighted by a behaviour correction (the rollout correction: TIS,
MIS or IcePop, :func:`learner.corrections.rollout_correction`; then M2PO's mask). The
learner computes them for the whole step in its prepare pass (``proximal = recompute``),
or per micro-batch from the current log-probs (``proximal = loglinear``,
:func:`learner.corrections.loglinear_proximal_logprobs`). Under ``behavior`` the ratio is
taken against the behaviour log-probs and there are no weights. Also here: the
inference/training log-prob gap the step reports (``train_logprob_gap``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from learner import corrections, losses
from learner.batch import TrainingBatch
from learner.objective import Decoupled
from learner.step_metrics import StepAccumulator


def behavior_correction(
    batch: TrainingBatch, proximal_logprobs: Tensor, decoupled: Decoupled
) -> tuple[Tensor, dict[str, Tensor]]:
    """The decoupled objective's per-token weights [b, T] for ``batch`` (all of a
    step's rows, or one micro-batch with the log-linear proximal) and their metrics:
    the rollout correction (TIS / MIS / IcePop), then M2PO's mask."""
    rc = decoupled.correction
    out = corrections.rollout_correction(
        proximal_logprobs,
        batch.behavior_logprobs,
        batch.loss_mask,
        batch.turn_ids,
        is_level=rc.is_level,
        is_statistic=rc.is_statistic,
        is_cap=rc.is_cap,
        mask_level=rc.mask_level,
        mask_statistic=rc.mask_statistic,
        mask_low=rc.mask_low,
        mask_high=float("inf") if rc.mask_high is None else rc.mask_high,
    )
    weights, metrics = out.weights, dict(out.metrics)
    if decoupled.m2po_threshold is not None:
        keep = corrections.m2po_keep_mask(
            proximal_logprobs,
            batch.behavior_logprobs,
            batch.loss_mask,
            threshold=decoupled.m2po_threshold,
        )
        weights = weights * keep.to(weights.dtype)
        policy = batch.loss_mask != 0
        metrics["m2po_masked"] = losses.masked_mean(
            (policy & ~keep).to(weights.dtype), policy.to(weights.dtype)
        )
    return weights, metrics


def proximal_alpha(micro: TrainingBatch, policy_version: int, acc: StepAccumulator) -> Tensor:
    """:func:`corrections.loglinear_proximal_alpha` of ``micro``'s tokens at this point
    of the step (``acc.optimizer_steps`` updates done), the learner at ``policy_version``."""
    versions = micro.token_versions
    if versions is None:  # one version per trajectory
        versions = micro.policy_version_min.unsqueeze(1).expand_as(micro.loss_mask)
    return corrections.loglinear_proximal_alpha(
        versions.to(micro.loss_mask.device),
        policy_version,
        updates_done=acc.optimizer_steps,
        updates_per_version=acc.updates_per_version,
    )


def micro_off_policy_inputs(
    micro: TrainingBatch,
    current_logprobs: Tensor,
    decoupled: Decoupled | None,
    acc: StepAccumulator,
    policy_version: int,
    *,
    record: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """(the log-probs the ratio is taken against, the behaviour weights) of ``micro``.

    Precomputed for the whole step except with ``proximal = loglinear``, where the
    proximal log-probs are approximated from ``current_logprobs`` (detached) and the
    weights computed on this micro-batch. With recomputed proximal log-probs the
    approximation is computed anyway and its error recorded. ``record``: add the
    metrics to ``acc`` (False for a pre-pass or a padding micro-batch).
    """
    if micro.proximal_logprobs is not None:
        if record and decoupled is not None:
            approx = corrections.loglinear_proximal_logprobs(
                micro.behavior_logprobs,
                current_logprobs,
                proximal_alpha(micro, policy_version, acc),
            )
            error = losses.masked_mean((micro.proximal_logprobs - approx).abs(), micro.loss_mask)
            acc.reads.defer(
                {"error": error, "tokens": micro.loss_mask.sum()},
                lambda v: acc.add_token_mean("proximal_approx_abs_error", v["error"], v["tokens"]),
            )
        return micro.proximal_logprobs, micro.behavior_weights
    proximal = corrections.loglinear_proximal_logprobs(
        micro.behavior_logprobs, current_logprobs, proximal_alpha(micro, policy_version, acc)
    )
    assert decoupled is not None  # no precomputed log-probs: the log-linear proximal
    weights, metrics = behavior_correction(micro, proximal, decoupled)
    if not record:
        return proximal, weights

    def add(values: dict[str, float]) -> None:
        tokens = values.pop("_tokens")
        for name, value in values.items():
            if name == "behavior_weight_max":
                acc.behavior_max = max(acc.behavior_max, value)
            else:
                acc.add_token_mean(name, value, tokens)

    acc.reads.defer({**metrics, "_tokens": micro.loss_mask.sum()}, add)
    return proximal, weights


def record_logprob_gap(
    batch: TrainingBatch, learner_logprobs: Tensor, acc: StepAccumulator, policy_version: int
) -> None:
    """Inference/training mismatch: mean |behaviour - learner| log-prob (nats) over the
    staleness-0 policy tokens only (sampled by the weights the learner holds now,
    ``policy_version``: per token, so a trajectory whose later tokens came after a
    mid-rollout update counts those), so staleness does not leak into it. Adds 0 tokens
    without such a token. Read at the next flush of ``acc.reads``."""
    if batch.token_versions is not None:
        fresh = batch.token_versions == policy_version
    else:
        fresh = (batch.policy_version_min == policy_version).unsqueeze(1)
    mask = batch.loss_mask * fresh.to(batch.loss_mask.dtype)
    gap = (batch.behavior_logprobs - learner_logprobs).abs()

    def add(values: dict[str, float]) -> None:
        acc.gap_sum += values["sum"]
        acc.gap_count += values["count"]

    # where, not gap * mask: a NaN log-prob off the counted tokens stays out of the sum
    total = torch.where(mask != 0, gap * mask, 0.0).sum()
    acc.reads.defer({"sum": total, "count": mask.sum()}, add)
