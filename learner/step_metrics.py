"""What one learner step measured: :class:`StepMetrics` (spec section 4), the warm start's
:class:`SupervisedStepMetrics`, and how a step gathers them over micro-batches, optimizer
steps and ranks (:class:`StepAccumulator`, :func:`step_metrics`).

Token metrics (clip ratio, approx KL, entropy...) are masked means over policy tokens: each
micro-batch adds its mean times its token count, so the step's value is the mean over all
its tokens whatever the micro-batches and ranks were. Per-update metrics (the mini-batch
losses, ``||C||``, ``s``) have one value per optimizer step and are averaged over them.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from actors.trajectory import Trajectory, TurnSummary, per_turn_summary
from learner.batch import Selection, TrainingBatch
from learner.distributed import all_reduce_floats
from learner.objective import Objective

_PER_UPDATE_METRICS = ("pg_loss", "value_loss", "clip_bias_norm", "clip_bias_scale")
"""Metrics with one value per optimizer step (mini-batch losses, ||C||, s): averaged over
the step's optimizer steps rather than its micro-batches."""


@dataclass
class StepMetrics(Mapping):
    """What one learner step measured (names as in spec section 4, units in suffixes).

    Also a read-only ``Mapping`` of field name -> value (``dict(metrics)``,
    ``metrics.get("skipped_steps")``), which is how the driver logs and exports it.

    Loss-side values are averages over the step's micro-batches (``pg_loss`` and
    ``value_loss``: over mini-batches of the mini-batch loss); ``grad_norm`` is the mean
    pre-clip global norm of the applied policy optimizer steps (NaN if none applied).

    Attributes:
        policy_version: the version *after* this step.
        global_step: learner steps done, this one included.
        staleness: ``policy_version_before_step - policy_version_min`` per trained
            trajectory (the histogram the driver exports).
        train_logprob_gap: mean |behaviour - learner| log-prob over the policy tokens of
            staleness-0 trajectories (nats), the learner log-probs taken at the current
            version before any update of this step (the proximal log-probs of the whole
            batch with ``off_policy = decoupled``, else the first mini-batch): the
            inference/training mismatch alone. None without a staleness-0 trajectory.
        clip_ratio_dual: fraction of policy tokens the dual clip capped.
        token_bound_ratio: fraction of policy tokens the token log-ratio bound replaced.
        token_log_ratio_abs_max: largest |log pi_theta - log pi_old| of a policy token over
            the step's micro-batches (nats), bounded or not.
        behavior_weight_mean, behavior_weight_max, behavior_weight_capped: the decoupled
            objective's raw importance weights at ``rollout_correction.is_level`` (mean, max,
            fraction of policy tokens the cap truncated: TIS); NaN with ``off_policy =
            behavior``.
        behavior_masked: fraction of policy tokens the rollout-correction mask dropped
            (MIS, Geo-RS, IcePop); NaN with ``off_policy = behavior``.
        m2po_masked: fraction of policy tokens M2PO's second-moment mask dropped (NaN
            without ``m2po_threshold``).
        behavior_log_ratio_abs_mean: mean ``|log pi_prox - log pi_behaviour|`` per policy
            token (nats); NaN with ``off_policy = behavior``.
        proximal_approx_abs_error: mean ``|log pi_prox - approximation|`` over the policy
            tokens of every optimizer step (nats) of the log-linear proximal approximation
            (:func:`learner.corrections.loglinear_proximal_logprobs`), measured against the
            recomputed proximal log-probs; NaN where they are not recomputed.
        clip_bias_norm, clip_bias_scale: ||C|| and s, one per optimizer step, averaged.
        skipped_steps: policy optimizer steps skipped in this step (non-finite loss or
            gradient norm); ``critic_skipped_steps`` likewise; ``nonfinite_steps_total``:
            cumulative policy skips since construction.
        num_excluded_retrieval_failed, num_excluded_no_policy_tokens,
        num_excluded_singleton_group: trajectories dropped before training, by reason.
        value_loss, critic_grad_norm: 0.0 for variants without a critic.
        turn_advantages: per trajectory of the step's input, in input order, the advantage
            over each policy turn's tokens (:class:`actors.trajectory.TurnSummary`: mean,
            min, max, after whitening or group normalisation); None for a trajectory
            excluded from training. For the driver's ``samples.jsonl``; not a gauge.
    """

    policy_version: int
    global_step: int
    variant: str
    num_trajectories: int
    num_excluded_retrieval_failed: int
    num_excluded_no_policy_tokens: int
    num_excluded_singleton_group: int
    optimizer_steps: int
    skipped_steps: int
    critic_skipped_steps: int
    nonfinite_steps_total: int
    clip_ratio: float
    clip_ratio_turn: float
    approx_kl: float
    kl_ref: float
    entropy: float
    pg_loss: float
    value_loss: float
    grad_norm: float
    critic_grad_norm: float
    clip_bias_norm: float
    clip_bias_scale: float
    clip_ratio_dual: float
    token_bound_ratio: float
    token_log_ratio_abs_max: float
    behavior_weight_mean: float
    behavior_weight_max: float
    behavior_weight_capped: float
    behavior_masked: float
    m2po_masked: float
    behavior_log_ratio_abs_mean: float
    proximal_approx_abs_error: float
    reward_mean: float
    success_rate: float
    num_turns_mean: float
    response_tokens_mean: float
    advantage_mean: float
    advantage_std: float
    tokens_per_s: float
    step_s: float
    train_logprob_gap: float | None
    staleness: list[int] = field(default_factory=list)
    turn_advantages: list[list[TurnSummary] | None] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (JSONL log line)."""
        return dataclasses.asdict(self)

    def __getitem__(self, name: str) -> Any:
        if name not in self.__dataclass_fields__:
            raise KeyError(name)
        return getattr(self, name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.__dataclass_fields__)

    def __len__(self) -> int:
        return len(self.__dataclass_fields__)


@dataclass
class SupervisedStepMetrics:
    """One warm-start SFT optimizer step.

    Attributes:
        loss: token-mean cross-entropy over policy tokens (nats/token), before the update.
        grad_norm: pre-clip global gradient norm (inf/NaN when skipped).
        num_policy_tokens: tokens trained on.
        skipped: True when the non-finite guard skipped the update.
        policy_version: the version after this step.
        step_s, tokens_per_s: wall time and real (prompt + response) tokens per second.
    """

    loss: float
    grad_norm: float
    num_policy_tokens: int
    skipped: bool
    policy_version: int
    step_s: float
    tokens_per_s: float


def scalar(x: Tensor | float | None) -> float:
    """``float(x)`` of a one-element tensor or a number (reads a device tensor: a host sync);
    None is NaN."""
    if x is None:
        return float("nan")
    return float(x.item()) if isinstance(x, Tensor) else float(x)


def read_scalars(values: Sequence[Tensor | float | None]) -> list[float]:
    """``float(v)`` of each value (None: NaN), the tensors read in one transfer per device.

    Args:
        values: one-element tensors (any dtype, any device), Python numbers or None.

    Returns:
        The values as floats, in order; a tensor's float is ``float(t.item())`` exactly
        (read as float64, which holds every float32 and every integer below 2^53).
    """
    out = [math.nan if v is None else v for v in values]
    by_device: dict[torch.device, list[int]] = defaultdict(list)
    for i, v in enumerate(out):
        if isinstance(v, Tensor):
            by_device[v.device].append(i)
    for where in by_device.values():
        read = torch.stack([out[i].detach().reshape(()).to(torch.float64) for i in where])
        for i, x in zip(where, read.tolist(), strict=True):
            out[i] = x
    return [float(v) for v in out]


class Deferred:
    """Named scalars queued on :class:`DeferredReads`; :meth:`get` after its flush."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self._values: dict[str, float] | None = None

    def get(self) -> dict[str, float]:
        """The values as floats, by name.

        Raises:
            RuntimeError: the reads were not flushed yet.
        """
        if self._values is None:
            raise RuntimeError(f"deferred values {self.names} read before the flush")
        return self._values


class DeferredReads:
    """Scalars a learner step computes on the device, read by the host together, later.

    Reading a CUDA tensor on the host (``float``, ``.item()``, ``bool``) waits for every
    kernel queued before it. Read per metric and micro-batch, the host never runs ahead of
    the GPU, and the GPU idles while the host prepares each next micro-batch (slicing,
    packing, launching its forward). The learner instead queues each micro-batch's metrics
    here (:meth:`defer`) and reads them all in one transfer (:meth:`flush`) once per
    optimizer step, where it needs them (the finite-loss checks, the clipping-bias scale),
    so the host packs micro-batch k + 1 while the GPU runs micro-batch k's backward.
    """

    def __init__(self) -> None:
        self._queued: list[tuple[Deferred, list[Tensor | float | None], Callable | None]] = []

    def defer(
        self,
        values: Mapping[str, Tensor | float | None],
        then: Callable[[dict[str, float]], None] | None = None,
    ) -> Deferred:
        """Queue ``values`` (name -> one-element tensor, number or None); ``then``, if given,
        is called with them as floats at the flush, in the order queued."""
        deferred = Deferred(list(values))
        self._queued.append((deferred, list(values.values()), then))
        return deferred

    def flush(self) -> None:
        """Read every queued value (:func:`read_scalars`: one transfer per device), fill
        their :class:`Deferred` and run the callbacks in the order queued."""
        queued, self._queued = self._queued, []
        floats = iter(read_scalars([v for _, values, _ in queued for v in values]))
        for deferred, _, _ in queued:
            deferred._values = {name: next(floats) for name in deferred.names}
        for deferred, _, then in queued:
            if then is not None:
                then(dict(deferred.get()))


@dataclass
class StepAccumulator:
    """Per-step running sums of micro-batch metrics and optimizer outcomes (one per
    :meth:`learner.trainer.Learner.step`; :func:`step_metrics` turns it into the step's
    :class:`StepMetrics`)."""

    micro: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    mini: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    optimizer_steps: int = 0
    skipped: int = 0
    critic_skipped: int = 0
    grad_norms: list[float] = field(default_factory=list)
    critic_grad_norms: list[float] = field(default_factory=list)
    gap_sum: float = 0.0
    gap_count: float = 0.0
    gap_replicated: bool = False
    behavior: dict[str, float] = field(default_factory=dict)
    token_log_ratio_abs_max: float = 0.0
    token_means: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    """Optional token-weighted means, ``name -> [sum of value * tokens, tokens]`` (the
    behaviour weights of the log-linear proximal, measured per micro-batch; the proximal
    approximation's error); a name never added reads as NaN."""
    behavior_max: float = -math.inf
    reads: DeferredReads = field(default_factory=DeferredReads)
    """Device scalars queued for the host (:class:`DeferredReads`); flushed at the end of
    each optimizer step's micro-batches and by :meth:`reduce`."""
    updates_per_version: int = 1
    """Optimizer steps of this learner step (mini-batches x epochs): the log-linear
    proximal's time unit (:func:`learner.corrections.loglinear_proximal_alpha`)."""

    def add_token_mean(self, name: str, value: float, num_tokens: float) -> None:
        """Add one micro-batch's masked mean ``value`` over ``num_tokens`` tokens to the
        token-weighted mean ``name`` (:attr:`token_means`)."""
        sums = self.token_means[name]
        if not sums:
            sums.extend([0.0, 0.0])
        sums[0] += value * num_tokens
        sums[1] += num_tokens

    def token_mean(self, name: str) -> float:
        """The step's token-weighted mean of ``name``; NaN when never added."""
        sums = self.token_means.get(name)
        return sums[0] / sums[1] if sums and sums[1] > 0 else math.nan

    def add_micro(self, metrics: Mapping[str, float], num_tokens: float, num_turns: float) -> None:
        """Token-weighted sums of one micro-batch's masked-mean metrics (turn-weighted for
        ``clip_ratio_turn``): the step's value is the mean over all its tokens, whatever the
        micro-batches and ranks were."""
        for name in _TOKEN_METRICS:
            weight = num_turns if name == "clip_ratio_turn" else num_tokens
            self.micro[name].append(metrics[name] * weight)
        self.micro["_tokens"].append(num_tokens)
        self.micro["_turns"].append(num_turns)

    def add_mini_batch(
        self, queued: Sequence[tuple[bool, Deferred, Deferred | None]]
    ) -> tuple[dict[str, float], bool, bool, bool]:
        """Add one mini-batch's micro-batches, read (``(real, policy metrics, critic metrics
        or None)`` each; padding micro-batches only count for finiteness).

        Returns:
            ``(sums, policy_finite, critic_finite, any_clipped)``: the summed ``pg_loss``,
            ``value_loss`` and ``clip_bias_norm_sq`` of the real micro-batches, whether
            every policy and critic loss was finite, and whether any token was clipped.
        """
        sums: dict[str, float] = defaultdict(float)
        policy_finite, critic_finite, clipped = True, True, False
        for real, policy_read, critic_read in queued:
            metrics = dict(policy_read.get())
            policy_finite &= math.isfinite(metrics["loss"])
            if critic_read is not None:
                value_metrics = critic_read.get()
                critic_finite &= math.isfinite(value_metrics["loss"])
                if real:
                    sums["value_loss"] += value_metrics["value_loss"]
            if not real:
                continue
            sums["pg_loss"] += metrics.pop("pg_loss")
            sums["clip_bias_norm_sq"] += metrics.pop("clip_bias_norm_sq")
            clipped |= metrics["clip_ratio"] > 0.0
            self.token_log_ratio_abs_max = max(
                self.token_log_ratio_abs_max, metrics.pop("token_log_ratio_abs_max")
            )
            self.add_micro(metrics, metrics["num_tokens"], metrics["num_turns"])
        return sums, policy_finite, critic_finite, clipped

    def reduce(self, world_size: int) -> None:
        """All-reduce the rank-local sums (no-op on one rank): afterwards ``micro`` holds the
        global sums, ``mini`` the global per-optimizer-step losses, and the maxima and the
        log-prob gap are global. Every rank calls it once per step, in the same order.
        Reads what is still queued on :attr:`reads` first."""
        self.reads.flush()
        names = [*_TOKEN_METRICS, "_tokens", "_turns"]
        local = [sum(self.micro[n]) for n in names]
        local += [v for n in _SUMMED_UPDATE_METRICS for v in self.mini[n]]
        local += [0.0, 0.0] if self.gap_replicated else [self.gap_sum, self.gap_count]
        sums = all_reduce_floats(local, world_size, "sum")
        for i, n in enumerate(names):
            self.micro[n] = [sums[i]]
        i = len(names)
        for n in _SUMMED_UPDATE_METRICS:
            k = len(self.mini[n])
            self.mini[n] = sums[i : i + k]
            i += k
        if not self.gap_replicated:
            self.gap_sum, self.gap_count = sums[i], sums[i + 1]
        (self.token_log_ratio_abs_max, self.behavior_max) = all_reduce_floats(
            [self.token_log_ratio_abs_max, self.behavior_max], world_size, "max"
        )
        # every rank adds the same names (one config, one plan of optimizer steps)
        names = sorted(self.token_means)
        flat = all_reduce_floats([v for n in names for v in self.token_means[n]], world_size, "sum")
        for i, n in enumerate(names):
            self.token_means[n] = flat[2 * i : 2 * i + 2]

    def mean(self, name: str, default: float = 0.0) -> float:
        if name in _PER_UPDATE_METRICS:
            values = self.mini[name]
            return float(sum(values) / len(values)) if values else default
        weight = sum(self.micro["_turns" if name == "clip_ratio_turn" else "_tokens"])
        return float(sum(self.micro[name]) / weight) if weight > 0 else default


_TOKEN_METRICS = (
    "clip_ratio", "clip_ratio_turn", "approx_kl", "kl_ref", "entropy", "clip_ratio_dual",
    "token_bound_ratio",
)  # fmt: skip
"""Exported micro-batch metrics that are masked means over policy tokens (turns for
``clip_ratio_turn``); summed with token weights, so their step value is partition-free."""

_SUMMED_UPDATE_METRICS = ("pg_loss", "value_loss")
"""Per-optimizer-step losses whose micro-batch terms (global denominators) add up across
micro-batches and ranks."""


def turn_advantages(
    trajectories: Sequence[Trajectory], kept: Sequence[Trajectory], batch: TrainingBatch
) -> list[list[TurnSummary] | None]:
    """Per input trajectory, :func:`actors.trajectory.per_turn_summary` of its row of
    ``batch.advantages`` [B, T] (row i is ``kept[i]``); None for one not kept."""
    rows = {id(t): i for i, t in enumerate(kept)}
    out: list[list[TurnSummary] | None] = []
    for t in trajectories:
        i = rows.get(id(t))
        if i is None:
            out.append(None)
            continue
        advantages = batch.advantages[i, : t.num_response_tokens].detach().cpu().numpy()
        out.append(per_turn_summary(advantages, t.turn_ids))
    return out


def step_metrics(
    batch: TrainingBatch,
    objective: Objective,
    selection: Selection,
    acc: StepAccumulator,
    staleness: list[int],
    step_s: float,
    *,
    policy_version: int,
    global_step: int,
    nonfinite_steps_total: int,
    ppo_epochs: int,
) -> StepMetrics:
    """The :class:`StepMetrics` of one learner step from its batch (advantages filled),
    its objective, what it excluded and its reduced :class:`StepAccumulator`.

    ``staleness``: the trained trajectories' staleness; ``step_s``: the step's wall
    seconds; the keyword counters are the learner's after the step."""
    mask = batch.loss_mask
    advantages = batch.advantages[mask.bool()]

    def mean_or_nan(values: list[float]) -> float:
        return float(sum(values) / len(values)) if values else float("nan")

    def behavior(name: str) -> float:
        """Measured once over the batch (recomputed proximal) or per micro-batch (log-linear)."""
        return acc.behavior.get(name, acc.token_mean(name))

    return StepMetrics(
        policy_version=policy_version,
        global_step=global_step,
        variant=objective.variant,
        num_trajectories=batch.batch_size,
        num_excluded_retrieval_failed=selection.retrieval_failed,
        num_excluded_no_policy_tokens=selection.no_policy_tokens,
        num_excluded_singleton_group=selection.singleton_group,
        optimizer_steps=acc.optimizer_steps,
        skipped_steps=acc.skipped,
        critic_skipped_steps=acc.critic_skipped,
        nonfinite_steps_total=nonfinite_steps_total,
        clip_ratio=acc.mean("clip_ratio"),
        clip_ratio_turn=acc.mean("clip_ratio_turn"),
        approx_kl=acc.mean("approx_kl"),
        kl_ref=acc.mean("kl_ref"),
        entropy=acc.mean("entropy"),
        pg_loss=acc.mean("pg_loss"),
        value_loss=acc.mean("value_loss"),
        grad_norm=mean_or_nan(acc.grad_norms),
        critic_grad_norm=mean_or_nan(acc.critic_grad_norms) if objective.critic else 0.0,
        clip_bias_norm=acc.mean("clip_bias_norm"),
        clip_bias_scale=acc.mean("clip_bias_scale", default=1.0),
        clip_ratio_dual=acc.mean("clip_ratio_dual"),
        token_bound_ratio=acc.mean("token_bound_ratio"),
        token_log_ratio_abs_max=acc.token_log_ratio_abs_max,
        behavior_weight_mean=behavior("behavior_weight_mean"),
        behavior_weight_max=acc.behavior.get(
            "behavior_weight_max", acc.behavior_max if acc.behavior_max > -math.inf else math.nan
        ),
        behavior_weight_capped=behavior("behavior_weight_capped"),
        behavior_masked=behavior("behavior_masked"),
        m2po_masked=behavior("m2po_masked"),
        behavior_log_ratio_abs_mean=behavior("behavior_log_ratio_abs_mean"),
        proximal_approx_abs_error=acc.token_mean("proximal_approx_abs_error"),
        reward_mean=float(batch.rewards.mean()),
        success_rate=float(batch.success.mean()),
        num_turns_mean=float(batch.num_turns.mean()),
        response_tokens_mean=float(batch.response_lengths.float().mean()),
        advantage_mean=float(advantages.mean()),
        advantage_std=float(advantages.std()) if advantages.numel() > 1 else 0.0,
        tokens_per_s=batch.num_tokens * ppo_epochs / step_s,
        step_s=step_s,
        train_logprob_gap=acc.gap_sum / acc.gap_count if acc.gap_count > 0 else None,
        staleness=staleness,
    )
