"""Configuration of the ST-PPO family and of the DeepSpeed learner.

These pydantic models are the learner's section of the run config (composed by
``services.config.RunConfig``). They import nothing heavy, so ``stppo --help`` and the
config loader stay fast. Every field has a docstring; every bound is a ``Field`` constraint
so a bad value fails at load time with the field's dotted path in the message.

The algorithm variant is a discriminated union on ``variant`` (see ``docs/algorithms.md``,
"The variants"): fields a variant does not use do not exist on it,
so ``algorithm.tau`` on a ``ppo`` config is an error, not a silently ignored value.
"""

from __future__ import annotations

from typing import Annotated, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, model_validator

from learner.constants import DEFAULT_TAU, LOG_RATIO_CLAMP

NULL = "null"
"""How a config file or override says ``None`` (TOML has no null): the string ``"null"`` for
a field whose type admits None and no string, e.g. ``algorithm.token_log_ratio_bound =
"null"`` (the bound off) or the override ``algorithm.clip_ratio_c=null``."""


def _nullable_non_string(annotation: object) -> bool:
    args = get_args(annotation)
    return type(None) in args and not any(
        a is str or get_origin(a) is Literal for a in args if a is not type(None)
    )


class StrictModel(BaseModel):
    """Base for every config section: unknown keys are errors, assignments are validated,
    and ``"null"`` sets an optional number to None (:data:`NULL`)."""

    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, use_attribute_docstrings=True
    )

    @model_validator(mode="before")
    @classmethod
    def _null_strings(cls, data: object) -> object:
        if not isinstance(data, dict):
            return data
        nulls = [
            name
            for name, value in data.items()
            if value == NULL
            and name in cls.model_fields
            and _nullable_non_string(cls.model_fields[name].annotation)
        ]
        return {**data, **dict.fromkeys(nulls)} if nulls else data


# --------------------------------------------------------------------------- algorithm

CorrectionLevel = Literal["none", "token", "turn", "sequence"]
SegmentStatistic = Literal["ratio", "geometric_mean"]

_BEHAVIOR_WEIGHT_MIGRATION = (
    "behavior_weight_cap / behavior_weight_mode / behavior_weight_level were folded into "
    "algorithm.rollout_correction, which acts only in the decoupled objective: set "
    'algorithm.off_policy = "decoupled" too (the default objective is "behavior", where a '
    "rollout_correction is refused at load). Cap C with mode 'truncate' -> is_level = "
    "'token' (or 'turn' with is_statistic = 'geometric_mean' for level 'turn'), is_cap = C; "
    "mode 'drop' -> the same plus mask_level = 'token' (or 'turn', mask_statistic = "
    "'geometric_mean'), mask_high = C"
)


class RolloutCorrectionConfig(StrictModel):
    """How the decoupled objective weighs each token for the gap between the proximal and
    the behaviour policy, ``w_t = pi_prox(y_t) / pi_b(y_t)`` (:mod:`learner.corrections`):
    truncated importance sampling (TIS), masked importance sampling / rejection (MIS,
    Geo-RS, IcePop), at token, turn or sequence level. Used only with ``off_policy =
    decoupled``. The defaults are token TIS with cap 2 (AReaL's decoupled PPO).

    Recipes: IcePop = ``is_level = "token"``, ``is_cap = 5``, ``mask_level = "token"``,
    ``mask_low = 0.5``, ``mask_high = 5``; sequence TIS = ``is_level = "sequence"``;
    Geo-RS = ``mask_level = "sequence"``, ``mask_statistic = "geometric_mean"`` with bounds.
    """

    is_level: CorrectionLevel = "token"
    """Importance weight per ``token``, per ``turn`` or per ``sequence`` (a statistic of
    the segment's token weights, ``is_statistic``), truncated at ``is_cap``; ``none``: no
    weight (the decoupled objective then ignores the behaviour policy)."""

    is_statistic: SegmentStatistic = "ratio"
    """Turn and sequence weights: the product of the token weights (``ratio``, the
    segment's likelihood ratio; verl's sequence IS) or their geometric mean."""

    is_cap: float = Field(2.0, gt=1.0, le=1e6)
    """Truncation of the importance weight (TIS): ``min(W, is_cap)`` (verl's default 2)."""

    mask_level: CorrectionLevel = "none"
    """Mask (weight 0) the tokens, turns or sequences whose statistic leaves
    ``[mask_low, mask_high]`` (MIS / rejection sampling); ``none``: no mask."""

    mask_statistic: SegmentStatistic = "geometric_mean"
    """Turn and sequence masks: bound the geometric mean of the token weights (Geo-RS) or
    their product (``ratio``)."""

    mask_low: float = Field(0.0, ge=0.0)
    """Lowest statistic kept (ratio space; 0: no lower bound)."""

    mask_high: float | None = Field(None, gt=0.0)
    """Highest statistic kept (ratio space); ``None``: no upper bound."""

    @model_validator(mode="after")
    def _check_mask_bounds(self) -> RolloutCorrectionConfig:
        if self.mask_high is not None and not self.mask_low < self.mask_high:
            raise ValueError(
                f"mask_low ({self.mask_low}) must be below mask_high ({self.mask_high})"
            )
        if self.mask_level != "none" and self.mask_low == 0.0 and self.mask_high is None:
            raise ValueError("mask_level is set but neither mask_low nor mask_high bounds it")
        return self


_DEFAULT_CORRECTION = RolloutCorrectionConfig()


def _decoupled_only_message(fields: list[str], objective_set: bool) -> str:
    """The load error for options of the decoupled objective set under ``behavior``:
    ``fields`` (those the user set), and whether ``off_policy`` was set or defaulted."""
    names = {
        "rollout_correction": "rollout_correction",
        "m2po_threshold": "m2po_threshold",
        "proximal": 'proximal = "loglinear"',
    }
    it, they = ("them", "they") if len(fields) > 1 else ("it", "it")
    objective = (
        'off_policy = "behavior" is set'
        if objective_set
        else 'off_policy is not set and defaults to "behavior" (earlier versions: "decoupled")'
    )
    return (
        f"{', '.join(names[f] for f in fields)}: only the decoupled objective uses {it}, "
        f"and {objective}, where {they} would do nothing. Set algorithm.off_policy = "
        f'"decoupled", or remove {it} (a live switch to "behavior" unsets a correction '
        'with rollout_correction = "null")'
    )


class _AlgorithmBase(StrictModel):
    clip_eps_low: float = Field(0.2, gt=0.0, lt=1.0)
    """Lower clip range: ratios below ``1 - clip_eps_low`` are clipped when A < 0 (paper: 0.2)."""

    clip_eps_high: float = Field(0.2, gt=0.0, le=10.0)
    """Upper clip range: ratios above ``1 + clip_eps_high`` are clipped when A > 0 (paper: 0.2)."""

    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean"] = "token-mean"
    """How per-token losses are averaged: over all masked tokens of the mini-batch, or per
    sequence first and then over sequences."""

    kl_mode: Literal["in_reward", "loss", "none"] = "in_reward"
    """Where the KL to the frozen reference enters: subtracted from the token reward
    (Search-R1's PPO recipe), added to the loss, or not at all."""

    kl_estimator: Literal["low_var_kl", "k1", "k3"] = "low_var_kl"
    """KL estimator against the reference policy, in the reward and in the loss (Schulman's
    k1 = log-ratio, k3 = unbiased and >= 0 but unbounded; ``low_var_kl`` = k3 clamped to
    [-10, 10] as in verl, the default: with k3 one token 12 nats from the reference gave
    1.6e5 and outweighed every reward of its batch)."""

    kl_coef: float = Field(0.001, ge=0.0, le=10.0)
    """Weight of the KL-to-reference term (spec: 0.001)."""

    entropy_coef: float = Field(0.0, ge=0.0, le=1.0)
    """Weight of the entropy bonus (spec: off by default, 0.001 when used)."""

    off_policy: Literal["decoupled", "behavior"] = "behavior"
    """RECONSTRUCTED (spec section 6). ``behavior`` (the default): the clipped ratio is
    pi_theta / pi_behaviour, the section 2 objective as written. ``decoupled`` (AReaL's
    decoupled PPO): the clipped ratio is taken against the proximal policy (log-probs
    recomputed at the start of the learner step, one extra policy forward per step) and the
    behaviour weight pi_prox / pi_behaviour of ``rollout_correction`` multiplies each token.
    Identical to PPO at staleness 0; at staleness k the trust region is centred on the
    current weights instead of weights k versions old. Why ``behavior`` is the default: on
    the synthetic task at staleness 8, ppo with ``decoupled`` (token TIS at 2) collapsed in
    4 of 10 seeds and ended 0.155 below on-policy, with ``behavior`` in none and within a
    question of on-policy; in the off-policy arena (staleness 1, 4 and 16, ten seeds per
    cell) none of its 80 runs ended low (docs/results.md, "The off-policy arena")."""

    rollout_correction: RolloutCorrectionConfig | None = None
    """Decoupled objective: the weight of each token for pi_prox / pi_behaviour (TIS, MIS,
    IcePop; :class:`RolloutCorrectionConfig`). Unset: the decoupled objective's default,
    token TIS with cap 2. Setting any of it needs ``off_policy = "decoupled"``: under
    ``behavior`` it would do nothing, so it is refused at load."""

    m2po_threshold: float | None = Field(None, gt=0.0, le=100.0)
    """M2PO (Zheng et al. 2025, arXiv 2510.01161): mask the policy tokens of the batch with
    the largest squared log behaviour weight ``(log pi_prox - log pi_b)^2`` until the rest's
    mean is below this bound (the paper: 0.04). ``None``: off. Decoupled objective with
    ``proximal = recompute`` only."""

    proximal: Literal["recompute", "loglinear"] = "recompute"
    """Decoupled objective: the proximal log-probs are recomputed (one policy forward over
    the batch per learner step), or approximated log-linearly between the behaviour and the
    current log-probs by policy version (AReaL's ``loglinear``,
    :func:`learner.corrections.loglinear_proximal_logprobs`), which skips that forward.
    With ``recompute`` the approximation's error is measured every step
    (``proximal_approx_abs_error``)."""

    token_log_ratio_bound: float | None = Field(0.4, gt=0.0, le=LOG_RATIO_CLAMP)
    """RECONSTRUCTED (spec section 6, GMPO's log-space clip 0.4). Bound (nats) on each
    token's log-ratio in the direction its advantage pushes it, applied before the turn
    mean: a token beyond it carries no gradient. ``None`` = off (section 2 bit for bit).
    Measured (``python -m benchmarks.stabilisers``, 30 AdamW steps on one batch, lr 0.05):
    turn ratios without it left 24% of tokens more than 1 nat from the behaviour policy
    (token PPO: 0.6%); with 0.4, 1.7% (1.0: 4.5%, 0.2: 1.1%). Token-ratio variants ignore
    it: the PPO clip bounds each of their tokens already."""

    clip_ratio_c: float | None = Field(3.0, gt=1.0, le=1000.0)
    """Dual clip for A < 0 (Ye et al. 2020; verl's ``clip_ratio_c``, default 3): the token
    loss is capped at ``-c A``, so a ratio above c carries no gradient. ``None`` = off.
    Must exceed ``1 + clip_eps_high``."""

    @model_validator(mode="before")
    @classmethod
    def _renamed_fields(cls, data: object) -> object:
        if isinstance(data, dict) and any(k.startswith("behavior_weight_") for k in data):
            raise ValueError(_BEHAVIOR_WEIGHT_MIGRATION)
        if isinstance(data, dict) and "old_logprob_source" in data:
            raise ValueError(
                "old_logprob_source was removed: 'recompute' silently dropped the "
                "behaviour-policy correction. Use off_policy = 'decoupled' (ratio against "
                "recomputed proximal log-probs, times the truncated behaviour weight) or "
                "'behavior' (ratio against the behaviour log-probs)"
            )
        return data

    @model_validator(mode="after")
    def _check_dual_clip(self) -> _AlgorithmBase:
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1.0 + self.clip_eps_high:
            raise ValueError(
                f"clip_ratio_c ({self.clip_ratio_c}) must be > 1 + clip_eps_high "
                f"({1.0 + self.clip_eps_high})"
            )
        return self

    @property
    def correction(self) -> RolloutCorrectionConfig:
        """The rollout correction the decoupled objective applies: ``rollout_correction``,
        or its default (token TIS, cap 2) where unset."""
        return self.rollout_correction or _DEFAULT_CORRECTION

    @model_validator(mode="after")
    def _check_off_policy_options(self) -> _AlgorithmBase:
        if self.off_policy == "behavior":
            # what the user set (pydantic's model_fields_set) and that would act; an
            # explicit null, or proximal = "recompute", does nothing and is accepted
            active = {
                "rollout_correction": self.rollout_correction is not None,
                "m2po_threshold": self.m2po_threshold is not None,
                "proximal": self.proximal == "loglinear",
            }
            named = [f for f, on in active.items() if on and f in self.model_fields_set]
            if named:
                raise ValueError(
                    _decoupled_only_message(named, "off_policy" in self.model_fields_set)
                )
        if self.m2po_threshold is not None and self.proximal != "recompute":
            raise ValueError(
                "m2po_threshold masks by the recomputed proximal/behaviour log-ratio: it "
                "needs proximal = 'recompute'"
            )
        return self


class _GAEFields(StrictModel):
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    """GAE discount over masked (policy) tokens."""

    lam: float = Field(1.0, ge=0.0, le=1.0)
    """GAE lambda."""

    value_clip: float = Field(0.5, gt=0.0)
    """Clip range of the value loss around the old values (spec: 0.5)."""

    value_loss_coef: float = Field(1.0, gt=0.0)
    """Weight of the critic loss (the critic has its own optimizer; this scales its loss)."""

    whiten_advantages: bool = True
    """Normalise GAE advantages to zero mean, unit variance over masked tokens of the batch."""


class _TurnFields(StrictModel):
    turn_advantage: Literal["token", "turn_mean"] = "token"
    """RECONSTRUCTED. Advantage multiplying a turn ratio: each token's own A_t, or the mean
    advantage of the turn broadcast to its tokens."""


class _BiasCorrectionFields(StrictModel):
    bias_norm: Literal["logprob", "param"] = "logprob"
    """RECONSTRUCTED. How ||C|| is measured: gradient of the clipped-token surrogate w.r.t.
    token log-probs (cheap, no extra backward) or w.r.t. parameters (exact, one extra
    backward; ZeRO stage <= 2 only)."""

    normalize_mode: Literal["triggered", "divide"] = "triggered"
    """RECONSTRUCTED. ``triggered``: s = 1 / max(1, ||C|| / tau). ``divide``: s = 1 / (||C|| +
    delta) whenever some token is clipped, else 1."""

    tau: float = Field(DEFAULT_TAU, gt=0.0)
    """Threshold on ||C|| (one norm per optimizer step, over all its micro-batches) above
    which the triggered scale starts shrinking the step."""

    scale_target: Literal["update", "loss"] = "update"
    """RECONSTRUCTED (spec section 6). Where the scale s acts: ``update`` multiplies that
    optimizer step's learning rate (so the parameter update shrinks by s under AdamW);
    ``loss`` multiplies the loss (spec section 2 as written; AdamW and gradient clipping
    cancel most of it)."""

    delta: float = Field(1e-8, gt=0.0)
    """Stabiliser of the ``divide`` mode."""

    @model_validator(mode="after")
    def _check_param_norm_needs_proximal(self) -> _BiasCorrectionFields:
        if self.bias_norm == "param" and getattr(self, "proximal", "recompute") != "recompute":
            raise ValueError(
                "bias_norm = 'param' takes its extra backward against recomputed proximal "
                "log-probs: use proximal = 'recompute' or bias_norm = 'logprob'"
            )
        return self


class _GroupFields(StrictModel):
    group_std_normalize: bool = True
    """Divide group-relative advantages by the group's reward std (GRPO); off = Dr. GRPO."""

    group_eps: float = Field(1e-6, gt=0.0)
    """Added to the group std before dividing."""


class PPOConfig(_AlgorithmBase, _GAEFields):
    """Token-level PPO with a critic and GAE (the baseline)."""

    variant: Literal["ppo"] = "ppo"
    """Selects this variant (``ppo``)."""


class TurnPPOConfig(_AlgorithmBase, _GAEFields, _TurnFields):
    """Turn-PPO: turn-level (geometric-mean) importance ratios, GAE advantages."""

    variant: Literal["turn_ppo"] = "turn_ppo"
    """Selects this variant (``turn_ppo``)."""


class SPPOConfig(_AlgorithmBase, _GAEFields, _BiasCorrectionFields):
    """S-PPO: token ratios with clipping-bias normalisation."""

    variant: Literal["s_ppo"] = "s_ppo"
    """Selects this variant (``s_ppo``)."""


class STPPOConfig(_AlgorithmBase, _GAEFields, _TurnFields, _BiasCorrectionFields):
    """ST-PPO (= SO-PPO): turn ratios with clipping-bias normalisation."""

    variant: Literal["st_ppo"] = "st_ppo"
    """Selects this variant (``st_ppo``)."""


class GSPOConfig(_AlgorithmBase, _GAEFields):
    """GSPO (Zheng et al. 2025, arXiv 2507.18071): one ratio per sequence, the geometric mean
    of its token ratios, with GSPO-token's per-token gradient (eq. 13, verl's
    ``compute_policy_loss_gspo``), GAE advantages. Turn-PPO with one turn per sequence."""

    variant: Literal["gspo"] = "gspo"
    """Selects this variant (``gspo``)."""

    clip_eps_low: float = Field(3e-4, gt=0.0, lt=1.0)
    """Lower clip range of the sequence ratio (the paper: 3e-4; a length-normalised ratio
    moves far less than a token's)."""

    clip_eps_high: float = Field(4e-4, gt=0.0, le=10.0)
    """Upper clip range of the sequence ratio (the paper: 4e-4)."""

    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean"] = "seq-mean-token-mean"
    """Per-sequence mean first, then over sequences (the paper's sequence-level objective;
    verl forces it for GSPO)."""

    token_log_ratio_bound: float | None = Field(None, gt=0.0, le=LOG_RATIO_CLAMP)
    """GMPO's token bound before the sequence mean; off in GSPO (the paper has none)."""

    clip_ratio_c: float | None = Field(None, gt=1.0, le=1000.0)
    """Dual clip for A < 0; off in GSPO (verl's GSPO loss has none)."""


class CISPOConfig(_AlgorithmBase, _GAEFields):
    """CISPO (MiniMax-M1, Chen et al. 2025, arXiv 2506.13585, eq. 4): the importance weight
    is clipped and detached, ``-sg(clip(r_t, 1 - eps_low, 1 + eps_high)) A_t log pi(y_t)``,
    so every token keeps its gradient; token ratios, GAE advantages."""

    variant: Literal["cispo"] = "cispo"
    """Selects this variant (``cispo``)."""

    clip_eps_low: float = Field(1.0, gt=0.0, le=1.0)
    """Lower truncation of the weight at ``1 - clip_eps_low``; 1 = none (the paper sets no
    lower bound; verl's CISPO example likewise)."""

    clip_eps_high: float = Field(0.2, gt=0.0, le=10.0)
    """Upper truncation of the weight at ``1 + clip_eps_high`` (verl's CISPO example: 0.2;
    the paper tunes it and gives no value)."""

    clip_ratio_c: None = None
    """The dual clip does not apply to CISPO (no token loses its gradient)."""


class GRPOConfig(_AlgorithmBase, _GroupFields):
    """GRPO: token ratios, group-relative outcome advantages, no critic."""

    variant: Literal["grpo"] = "grpo"
    """Selects this variant (``grpo``)."""


class SOGRPOConfig(_AlgorithmBase, _GroupFields, _TurnFields, _BiasCorrectionFields):
    """SO-GRPO: turn ratios, group-relative advantages, clipping-bias normalisation."""

    variant: Literal["so_grpo"] = "so_grpo"
    """Selects this variant (``so_grpo``)."""


AlgorithmConfig = Annotated[
    PPOConfig
    | TurnPPOConfig
    | SPPOConfig
    | STPPOConfig
    | GSPOConfig
    | CISPOConfig
    | GRPOConfig
    | SOGRPOConfig,
    Field(discriminator="variant"),
]
"""One of the eight variants, chosen by ``variant`` (default ``st_ppo`` in RunConfig)."""

VARIANT_CONFIGS: dict[str, type[StrictModel]] = {
    "ppo": PPOConfig,
    "turn_ppo": TurnPPOConfig,
    "s_ppo": SPPOConfig,
    "st_ppo": STPPOConfig,
    "gspo": GSPOConfig,
    "cispo": CISPOConfig,
    "grpo": GRPOConfig,
    "so_grpo": SOGRPOConfig,
}
"""Variant name -> its config class."""


def uses_critic(algorithm: BaseModel) -> bool:
    """True for variants whose advantages come from GAE over a critic."""
    return isinstance(algorithm, _GAEFields)


def uses_turn_ratio(algorithm: BaseModel) -> bool:
    """True for variants that use turn-level (geometric-mean) importance ratios."""
    return isinstance(algorithm, _TurnFields)


def ratio_level(algorithm: BaseModel) -> Literal["token", "turn", "sequence"]:
    """The importance-ratio level of a variant: ``sequence`` (gspo), ``turn`` (turn_ppo,
    st_ppo, so_grpo) or ``token`` (the rest)."""
    if isinstance(algorithm, GSPOConfig):
        return "sequence"
    return "turn" if uses_turn_ratio(algorithm) else "token"


def policy_objective(algorithm: BaseModel) -> Literal["clip", "cispo"]:
    """``cispo`` for the CISPO variant, else PPO's clipped surrogate (``clip``)."""
    return "cispo" if isinstance(algorithm, CISPOConfig) else "clip"


def uses_bias_correction(algorithm: BaseModel) -> bool:
    """True for variants that scale the loss by the clipping-bias norm."""
    return isinstance(algorithm, _BiasCorrectionFields)


# --------------------------------------------------------------------------- learner


class LearnerConfig(StrictModel):
    """The DeepSpeed learner: engines, optimisation, the off-policy inner loop."""

    zero_stage: Literal[0, 1, 2, 3] = 2
    """DeepSpeed ZeRO stage for policy and critic (``bias_norm=param`` needs <= 2). At 3 the
    frozen reference is sharded too; below 3 every rank holds a full replica of it."""

    num_ranks: int = Field(1, ge=1, le=1024)
    """Data-parallel learner ranks (Ray actors in one placement group, one
    ``torch.distributed`` group: gloo on CPU, nccl on CUDA). Each optimizer step's
    trajectories are split across ranks by token count; ``micro_batch_size`` counts
    trajectories per forward on one rank. Results match one rank (see README, "Learner on N
    ranks"); a checkpoint resumes only with the same ``num_ranks`` and ``zero_stage``."""

    dtype: Literal["auto", "bf16", "fp32"] = "auto"
    """Training precision: ``auto`` is bf16 on CUDA and on CPUs that multiply bf16 natively
    (avx512_bf16 / AMX), fp32 on other CPUs, where bf16 is emulated and tens of times
    slower (:mod:`actors.hardware`; the choice and its reason go to the log). fp16 is not
    supported by DeepSpeed on CPU."""

    actor_lr: float = Field(1e-6, gt=0.0, le=1.0)
    """Policy learning rate (spec: 1e-6 at 7B; small models need larger)."""

    critic_lr: float = Field(1e-5, gt=0.0, le=1.0)
    """Critic learning rate (spec: 1e-5 at 7B)."""

    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay."""

    max_grad_norm: float = Field(1.0, gt=0.0)
    """Gradient clipping by global L2 norm (spec: 1.0)."""

    train_batch_size: int = Field(8, ge=1, le=4096)
    """Trajectories consumed per learner step."""

    mini_batch_size: int = Field(4, ge=1, le=4096)
    """Trajectories per optimizer step inside a learner step (the off-policy inner loop)."""

    micro_batch_size: int = Field(2, ge=1, le=4096)
    """Trajectories per forward/backward (gradient accumulation up to a mini-batch)."""

    micro_batch_tokens: int = Field(0, ge=-1, le=16_777_216)
    """Micro-batches by token budget instead of by count when > 0: each stage's rows (on
    each rank) go longest first into micro-batches of at most this many padded token slots
    (:func:`learner.micro_batches.token_budget_micro_batches`; a longer row goes alone), so rows of
    similar length share a forward and little padding is computed. The gradient is the
    same (global denominators), up to float summation order. 0: ``micro_batch_size`` rows
    per forward, in the mini-batch's shuffled order. With ``pack_sequences`` the budget
    counts real tokens (what a packed forward computes, up to its rows' tails). -1: a
    budget sized from the GPU memory: until the first RL step ends, 0.6 of the memory free
    at start-up less the AdamW states to come over an estimate of the activation bytes per
    token (:func:`learner.micro_batches.memory_token_budget`), at most 8,192 tokens; then 0.8 of
    the memory left by what that step held while its micro-batches ran (weights, gradients,
    optimizer states) over the bytes per token they held (:class:`learner.micro_batches.MemoryProbe`);
    CPU: 4,096. Within
    ``gpu_memory_fraction`` of the device."""

    gpu_memory_fraction: float = Field(1.0, gt=0.0, le=1.0)
    """The share of its GPU's memory the ``micro_batch_tokens = -1`` budget plans for: the
    learner's memory is at most this share of the device, less what it already holds (1.0:
    the whole device less what other processes hold at the time). Set it below 1 where the
    learner shares its GPU with a process that grows later (the one-GPU job's rollout
    engine: ``ray.learner_gpus``), or to compare steps at a memory ceiling. No effect on
    the CPU or with a fixed budget."""

    pack_sequences: bool = False
    """Run every forward of the policy, critic and reference on the micro-batch's
    trajectories packed without padding (:mod:`learner.packing`): whole trajectories placed
    first-fit into rows as wide as the longest, positions restarting at each trajectory,
    the block-diagonal causal mask built on the device from the layout. Same values
    to rounding (losses within 1e-5 in float32), fewer token slots computed. Applies where
    the LM head is chunked (``logprob_chunk_tokens > 0`` and a plain head); the
    full-vocabulary path and ``bias_norm = "param"``'s extra forward stay padded."""

    packed_attention: Literal["mask", "varlen"] = "mask"
    """How a packed forward keeps its trajectories apart (``pack_sequences`` only). ``mask``:
    rows as wide as the longest trajectory and transformers' ``sdpa`` attention with the
    dense block-diagonal causal mask (every row computes W x W scores). ``varlen``: every
    trajectory of the micro-batch in one row, no row tails, and variable-length attention
    over their cumulative lengths (:mod:`learner.attention`:
    torch's FlashAttention varlen kernel on CUDA, one ``scaled_dot_product_attention`` per
    trajectory elsewhere), each trajectory's causal scores alone. Same values to rounding
    (losses within 1e-5 in float32)."""

    lr_warmup_steps: int = Field(0, ge=0, le=1_000_000)
    """Linear warm-up of the actor and critic learning rates over this many learner steps
    (``lr * min(1, (step + 1) / lr_warmup_steps)``; verl's ``lr_warmup_steps``). A fresh
    AdamW's first updates move every parameter by about ``lr`` whatever its gradient (the
    second-moment estimate is one sample), which a small model's policy does not survive
    at rates that learn (the synthetic task: training success 0.66 -> 0.23 after one step
    at 1e-3). 0: no warm-up. The warm start's SFT is not affected."""

    ppo_epochs: int = Field(1, ge=1, le=64)
    """Passes over the step's batch; each pass after the first is further off-policy."""

    fused_adamw: bool | None = None
    """AdamW as one fused kernel per parameter group (``torch.optim.AdamW(fused=True)``,
    built by the learner and handed to DeepSpeed) instead of DeepSpeed's ``torch_adam``
    (torch's multi-tensor ``foreach`` AdamW). Same update to rounding. None: fused on
    CUDA, ``foreach`` on CPU."""

    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory."""

    offload_optimizer: bool = False
    """Keep the policy's and critic's optimizer states (fp32 master weights and the two
    AdamW moments, 12 bytes per parameter) in host memory and run the optimizer step there
    (DeepSpeed ZeRO-Offload: ``zero_optimization.offload_optimizer.device = "cpu"``). Needs
    ``zero_stage`` >= 1. The step is torch's ``foreach`` AdamW on the host (DeepSpeed's
    ``torch_adam``; ``fused_adamw`` must not be true), which needs no compiled extension;
    it costs host memory (``stppo plan`` states it) and a host round trip of the gradients
    every optimizer step."""

    offload_params: bool = False
    """ZeRO-3 only: keep the partitioned parameters in host memory between uses, gathered
    to the device layer by layer (DeepSpeed ``zero_optimization.offload_param.device =
    "cpu"``; the frozen reference too). For a model whose partition does not fit beside
    the activations; every forward and backward then copies each layer to the device."""

    compile_layers: bool = False
    """``torch.compile`` each decoder layer's attention, MLP and norms in the policy, critic
    and reference (regional compilation: every layer shares the graphs; dynamic shapes;
    :class:`learner.modeling.LayerCompiler`): TorchInductor fuses the normalisations, the
    rotary embedding and the SwiGLU product between the matmuls. Same values to rounding.
    The first step pays the compile, about a minute on a GPU machine (Triton) and several on
    a 2-core CPU (a C++ compiler is needed there); compiled code is cached under
    ``.cache/torchinductor``. Switchable between steps. ZeRO stages 0-2 only (ZeRO-3 gathers
    each layer's parameters in hooks inside the layer)."""

    logprob_chunk_tokens: int = Field(512, ge=0, le=1_048_576)
    """Tokens per chunk of the LM head when log-probs and entropy are computed from the
    last hidden states (:mod:`learner.logprobs`): only policy tokens go through the head,
    float32 logits exist for one chunk at a time (memory ~ 3 x chunk x vocab x 4 bytes) and
    backward recomputes them. 0: the full-vocabulary logits of every response column (the
    path ZeRO-3 and models with soft-capped or scaled logits always take)."""

    @model_validator(mode="after")
    def _check_batch_divisibility(self) -> LearnerConfig:
        if self.train_batch_size % self.mini_batch_size:
            raise ValueError(
                f"train_batch_size ({self.train_batch_size}) must be a multiple of "
                f"mini_batch_size ({self.mini_batch_size})"
            )
        if self.mini_batch_size % self.micro_batch_size:
            raise ValueError(
                f"mini_batch_size ({self.mini_batch_size}) must be a multiple of "
                f"micro_batch_size ({self.micro_batch_size})"
            )
        return self

    @model_validator(mode="after")
    def _check_packed_attention(self) -> LearnerConfig:
        if self.packed_attention == "varlen" and not self.pack_sequences:
            raise ValueError(
                "packed_attention = 'varlen' needs pack_sequences = true (it is the attention "
                "of the packed layout)"
            )
        return self

    @model_validator(mode="after")
    def _check_offload(self) -> LearnerConfig:
        if self.offload_optimizer and self.zero_stage == 0:
            raise ValueError("offload_optimizer needs zero_stage >= 1 (ZeRO-Offload)")
        if self.offload_params and self.zero_stage != 3:
            raise ValueError(f"offload_params needs zero_stage = 3, got {self.zero_stage}")
        if self.offload_optimizer and self.fused_adamw:
            raise ValueError(
                "fused_adamw = true with offload_optimizer: the offloaded step runs on the "
                "host with torch's foreach AdamW; leave fused_adamw unset"
            )
        return self

    @model_validator(mode="after")
    def _check_compile_stage(self) -> LearnerConfig:
        if self.compile_layers and self.zero_stage == 3:
            raise ValueError(
                "compile_layers needs zero_stage <= 2 (ZeRO-3 gathers each layer's parameters "
                "in hooks inside the layer, which the compiled graph would trace)"
            )
        return self


class SFTConfig(StrictModel):
    """Warm-start supervised step on demonstration trajectories (teaches the tool format)."""

    enabled: bool = True
    """Run the warm start before RL (skipped on resume)."""

    num_demonstrations: int = Field(256, ge=0, le=1_000_000)
    """Demonstrations built from the training split and the real retrieval server."""

    epochs: int = Field(2, ge=1, le=100)
    """Passes over the demonstrations."""

    lr: float = Field(5e-5, gt=0.0, le=1.0)
    """Learning rate of the warm start."""

    batch_size: int = Field(8, ge=1, le=1024)
    """Demonstrations per optimizer step."""

    early_answer_share: float = Field(0.0, ge=0.0, lt=1.0)
    """Probability that a demonstration of a question needing more than one search stops
    after its first search and answers what that search returned (the record's
    ``metadata.partial_answer``), as a demonstrator that missed that the question asks about
    a linked record would (:func:`actors.demonstrations.build_demonstrations`, seeded by
    ``run.seed``). The warm-started policy then answers early about this often, which is
    wrong: RL has a decision to learn (search again or answer now) that the warm start
    left open (the synthetic stability regime,
    ``deploy/configs/experiments/stability_regime_early.toml``). 0: every demonstration
    searches for every entity it needs."""

    cache: bool = False
    """Keep the finished warm start (the learner's state after SFT, under
    ``.cache/warm_start/``) and load it in a later run whose model, data, retrieval corpus,
    SFT and learner settings and code are the same, instead of training it again
    (:mod:`services.loop.warm_start_cache`; a learner checkpoint, about 4 GB for
    SmolLM2-135M; the two newest are kept)."""

    reference_from_warm_start: bool = True
    """After the warm start, the frozen reference (the KL anchor, ``kl_ref``) becomes the
    warm-started policy, as the SFT model is the reference in InstructGPT (Ouyang et al.,
    2022, eq. 2) and in verl/OpenRLHF. False keeps the base model as the reference."""
