"""The variant resolved once into what the learner step computes: a typed objective.

An :data:`learner.config.AlgorithmConfig` is what a user writes (one of the eight variants,
each with only its own fields). :meth:`Objective.from_config` resolves it, once per step,
into the parts of the step it changes, each ``None`` where the variant has no such part:

- ``loss``: the options of the policy loss (:func:`learner.losses.compute_policy_loss`):
  the ratio level (token, turn or sequence), the clip range, the stabilisers, the
  objective (PPO's clipped surrogate or CISPO);
- ``critic``: GAE over a value model (ppo, turn_ppo, s_ppo, st_ppo, gspo, cispo), or
  ``group``: group-relative advantages (grpo, so_grpo);
- ``clip_bias``: the clipping-bias scale of S-PPO / ST-PPO / SO-GRPO (spec section 3);
- ``decoupled``: the decoupled objective's proximal policy and behaviour correction (spec
  section 5), ``None`` when the ratio is taken against the behaviour policy;
- the KL to the reference and the entropy bonus, shared by every variant.

Source: the variant table of spec section 2 and ``docs/algorithms.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel

from learner.config import (
    GSPOConfig,
    RolloutCorrectionConfig,
    policy_objective,
    ratio_level,
    uses_bias_correction,
    uses_critic,
    uses_turn_ratio,
)


@dataclass(frozen=True)
class PolicyLoss:
    """The options of :func:`learner.losses.compute_policy_loss` a variant sets (the
    clipping-bias scale is applied by the learner, once per optimizer step)."""

    ratio_level: Literal["token", "turn", "sequence"]
    clip_eps_low: float
    clip_eps_high: float
    turn_advantage: Literal["token", "turn_mean"]
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean"]
    token_log_ratio_bound: float | None
    clip_ratio_c: float | None
    segment_gradient: Literal["token", "mean"]
    objective: Literal["clip", "cispo"]

    def kwargs(self) -> dict[str, Any]:
        """The keyword options, without the loss's checks of its inputs' values (a host
        read between a forward and its backward): every row comes from
        :func:`learner.batch.collate_trajectories`, which validated its trajectory and that
        it has a policy token."""
        return {**self.__dict__, "check_values": False}


@dataclass(frozen=True)
class Critic:
    """GAE over a value model (:func:`learner.advantages.compute_gae`) and its loss."""

    gamma: float
    lam: float
    whiten_advantages: bool
    value_clip: float | None
    value_loss_coef: float


@dataclass(frozen=True)
class Group:
    """Group-relative advantages (:func:`learner.advantages.group_relative_advantages`)."""

    std_normalize: bool
    eps: float


@dataclass(frozen=True)
class ClipBias:
    """The clipping-bias scale s (:func:`learner.losses.clip_bias_scale`)."""

    bias_norm: Literal["logprob", "param"]
    scale_target: Literal["update", "loss"]
    normalize_mode: Literal["triggered", "divide"]
    tau: float
    delta: float

    @property
    def needs_pre_pass(self) -> bool:
        """s must be known before the first backward (:mod:`learner.clip_bias`)."""
        return self.bias_norm == "param" or self.scale_target == "loss"


@dataclass(frozen=True)
class Decoupled:
    """The decoupled objective (:mod:`learner.off_policy`): the ratio against a proximal
    policy, recomputed by a forward or approximated log-linearly, and the behaviour
    correction's weights (the rollout correction, then M2PO's mask)."""

    proximal: Literal["recompute", "loglinear"]
    correction: RolloutCorrectionConfig
    m2po_threshold: float | None


@dataclass(frozen=True)
class Objective:
    """What one learner step optimises, resolved from a variant's config (module docstring).

    Attributes:
        variant: the variant's name (``st_ppo``, ...).
        loss: the policy loss's options.
        critic, group: how advantages are computed (exactly one is set).
        clip_bias: the clipping-bias scale, or None.
        decoupled: the decoupled objective, or None (the ratio against the behaviour policy).
        kl_mode, kl_coef, kl_estimator: the KL to the frozen reference: in the reward, in
            the loss, or not at all.
        entropy_coef: the entropy bonus's weight (0: none).
    """

    variant: str
    loss: PolicyLoss
    critic: Critic | None
    group: Group | None
    clip_bias: ClipBias | None
    decoupled: Decoupled | None
    kl_mode: Literal["in_reward", "loss", "none"]
    kl_coef: float
    kl_estimator: Literal["low_var_kl", "k1", "k3"]
    entropy_coef: float

    @classmethod
    def from_config(cls, a: BaseModel) -> Objective:
        """Resolve a validated :data:`learner.config.AlgorithmConfig`."""
        critic = group = clip_bias = decoupled = None
        if uses_critic(a):
            critic = Critic(a.gamma, a.lam, a.whiten_advantages, a.value_clip, a.value_loss_coef)
        else:
            group = Group(a.group_std_normalize, a.group_eps)
        if uses_bias_correction(a):
            clip_bias = ClipBias(a.bias_norm, a.scale_target, a.normalize_mode, a.tau, a.delta)
        if a.off_policy == "decoupled":
            decoupled = Decoupled(a.proximal, a.correction, a.m2po_threshold)
        loss = PolicyLoss(
            ratio_level=ratio_level(a),
            clip_eps_low=a.clip_eps_low,
            clip_eps_high=a.clip_eps_high,
            turn_advantage=a.turn_advantage if uses_turn_ratio(a) else "token",
            loss_agg_mode=a.loss_agg_mode,
            token_log_ratio_bound=a.token_log_ratio_bound,
            clip_ratio_c=a.clip_ratio_c,
            segment_gradient="token" if isinstance(a, GSPOConfig) else "mean",
            objective=policy_objective(a),
        )
        return cls(
            a.variant, loss, critic, group, clip_bias, decoupled,
            a.kl_mode, a.kl_coef, a.kl_estimator, a.entropy_coef,
        )  # fmt: skip
