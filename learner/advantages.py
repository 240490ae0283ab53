"""Advantage estimators of the ST-PPO family as pure functions over tensors.

- :func:`compute_gae`: generalised advantage estimation (Schulman et al., "High-Dimensional
  Continuous Control Using Generalized Advantage Estimation", 2016, eq. 16) over the policy
  tokens of a multi-turn response. Environment tokens (the retrieval ``<information>``
  block) are not agent steps: the recursion skips them, and the value of the next policy
  token bootstraps across the block (spec ``st-ppo.md`` section 3; Search-R1's PPO recipe).
- :func:`group_relative_advantages`: GRPO outcome advantages (Shao et al., "DeepSeekMath",
  2024, section 4.1.2): reward minus the group mean, optionally over the group std.
- :func:`whiten`: zero-mean / unit-variance normalisation over masked tokens.
- :func:`turn_ids_from_mask`: turns as maximal runs of ones of ``loss_mask``.

All functions run under ``no_grad`` and return detached tensors (a ``with`` block, not the
decorator: mutation testing, ``make mutation``, skips decorated functions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from learner.losses import kl_penalty

if TYPE_CHECKING:
    from learner.batch import TrainingBatch
    from learner.objective import Objective


@dataclass
class GAEOutput:
    """Result of :func:`compute_gae`.

    Attributes:
        advantages: float [B, T]. GAE advantages on policy tokens, 0 elsewhere.
        returns: float [B, T]. ``advantages + values`` on policy tokens (the critic's
            regression target), 0 elsewhere.
    """

    advantages: Tensor
    returns: Tensor


def _check_same_shape(reference_name: str, reference: Tensor, **others: Tensor) -> None:
    for name, tensor in others.items():
        if tensor.shape != reference.shape:
            raise ValueError(
                f"{name} shape {tuple(tensor.shape)} != {reference_name} shape "
                f"{tuple(reference.shape)}"
            )


def compute_gae(
    token_rewards: Tensor,
    values: Tensor,
    loss_mask: Tensor,
    *,
    gamma: float,
    lam: float,
) -> GAEOutput:
    """GAE over the masked (policy) tokens of each sequence, skipping environment tokens.

    Let t' be the next policy token after t in the same sequence (none after the last one,
    where V = 0: the episode ends). Then, on policy tokens only,

        delta_t = r_t + gamma * V_{t'} - V_t
        A_t     = delta_t + gamma * lam * A_{t'}
        R_t     = A_t + V_t

    With gamma = lam = 1 (the spec default) and a terminal reward R, ``A_t = R - V_t``.

    The recursion is a reverse loop over the T positions, vectorised over the batch (the
    masked "next" state is carried in [B] tensors); there is no loop over sequences.

    Args:
        token_rewards: float [B, T]. Per-token rewards (outcome reward on the last policy
            token, KL penalty when ``kl_mode = in_reward``). Must be 0 off the mask: a reward
            on an environment token would be silently dropped.
        values: float [B, T]. Critic values; only masked entries are read.
        loss_mask: [B, T]. 1 on policy tokens.
        gamma: discount in [0, 1] per policy token. lam: GAE lambda in [0, 1].

    Returns:
        :class:`GAEOutput` (float32, or float64 for float64 inputs).

    Raises:
        ValueError: non-2-D or mismatched shapes, gamma/lam outside [0, 1], a nonzero reward
            off the mask.

    Example: rewards ``[[0, 0, 1]]``, values ``[[.5, 9, .8]]``, mask ``[[1, 0, 1]]``,
    gamma = lam = 1 gives advantages ``[[.5, 0, .2]]`` and returns ``[[1, 0, 1]]``.
    """
    with torch.no_grad():
        if token_rewards.dim() != 2:
            raise ValueError(
                f"token_rewards must be [B, T], got shape {tuple(token_rewards.shape)}"
            )
        _check_same_shape("token_rewards", token_rewards, values=values, loss_mask=loss_mask)
        if not 0.0 <= gamma <= 1.0:
            raise ValueError(f"gamma must be in [0, 1], got {gamma}")
        if not 0.0 <= lam <= 1.0:
            raise ValueError(f"lam must be in [0, 1], got {lam}")
        policy = loss_mask != 0
        if (token_rewards.ne(0) & ~policy).any():
            raise ValueError("token_rewards must be 0 where loss_mask is 0 (environment tokens)")
        dtype = torch.float64 if values.dtype == torch.float64 else torch.float32
        rewards = token_rewards.to(dtype)
        vals = torch.where(policy, values.to(dtype), torch.zeros((), dtype=dtype))
        batch, seq_len = rewards.shape
        next_value = rewards.new_zeros(batch)
        next_adv = rewards.new_zeros(batch)
        advantages = torch.zeros_like(rewards)
        for t in range(seq_len - 1, -1, -1):
            on = policy[:, t]
            delta = rewards[:, t] + gamma * next_value - vals[:, t]
            adv_t = delta + gamma * lam * next_adv
            advantages[:, t] = torch.where(on, adv_t, torch.zeros_like(adv_t))
            next_value = torch.where(on, vals[:, t], next_value)
            next_adv = torch.where(on, adv_t, next_adv)
        returns = torch.where(policy, advantages + vals, torch.zeros_like(advantages))
        return GAEOutput(advantages=advantages, returns=returns)


def group_relative_advantages(
    rewards: Tensor, group_ids: Tensor, *, std_normalize: bool, eps: float
) -> Tensor:
    """GRPO outcome advantages: ``(R_i - mean_g) / (std_g + eps)`` (or ``R_i - mean_g``).

    Groups are the rollouts of one question (same ``group_id``); ids are arbitrary int64
    values, not necessarily contiguous. The std is the unbiased (Bessel, n - 1) sample std,
    as in DeepSeekMath/TRL/verl. A group with one member has no baseline and is an error.
    Broadcast the result to tokens with :func:`broadcast_sequence_advantages`.

    Args:
        rewards: float [B]. Scalar outcome reward per trajectory.
        group_ids: int64 [B]. Group of each trajectory.
        std_normalize: divide by the group std (GRPO) or not (Dr. GRPO).
        eps: > 0, added to the std before dividing.

    Returns:
        float [B] (float32, or float64 for float64 rewards).

    Raises:
        ValueError: non-1-D or mismatched inputs, non-integer group ids, eps <= 0, or a group
            of size 1.

    Example: rewards ``[1, 0, 1, 1]`` in one group: mean .75, std .5 -> ``[.5, -1.5, .5, .5]``.
    """
    with torch.no_grad():
        if rewards.dim() != 1:
            raise ValueError(f"rewards must be [B], got shape {tuple(rewards.shape)}")
        _check_same_shape("rewards", rewards, group_ids=group_ids)
        if group_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"group_ids must be int64, got {group_ids.dtype}")
        if eps <= 0.0:
            raise ValueError(f"eps must be > 0, got {eps}")
        dtype = torch.float64 if rewards.dtype == torch.float64 else torch.float32
        r = rewards.to(dtype)
        _, group_index = torch.unique(group_ids, return_inverse=True)
        num_groups = int(group_index.max()) + 1
        counts = r.new_zeros(num_groups).scatter_add(0, group_index, torch.ones_like(r))
        if (counts < 2).any():
            singles = torch.unique(group_ids[(counts < 2)[group_index]]).tolist()
            raise ValueError(f"groups of size 1 have no baseline (group_ids {singles})")
        mean = r.new_zeros(num_groups).scatter_add(0, group_index, r) / counts
        centered = r - mean[group_index]
        if not std_normalize:
            return centered
        sq = r.new_zeros(num_groups).scatter_add(0, group_index, centered.square())
        std = (sq / (counts - 1)).sqrt()
        return centered / (std[group_index] + eps)


def broadcast_sequence_advantages(advantages: Tensor, loss_mask: Tensor) -> Tensor:
    """Per-trajectory advantages [B] copied onto the policy tokens: float [B, T], 0 elsewhere.

    Raises:
        ValueError: ``advantages`` not [B] with B = ``loss_mask.shape[0]``.
    """
    with torch.no_grad():
        if (
            advantages.dim() != 1
            or loss_mask.dim() != 2
            or advantages.shape[0] != loss_mask.shape[0]
        ):
            raise ValueError(
                f"advantages must be [B] and loss_mask [B, T], got {tuple(advantages.shape)} "
                f"and {tuple(loss_mask.shape)}"
            )
        return advantages.unsqueeze(1) * (loss_mask != 0).to(advantages.dtype)


def whiten(values: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Normalise ``values`` to unit variance over masked entries (and zero mean by default).

    ``(x - mean) / sqrt(var + eps)`` with mean and unbiased variance over masked entries;
    with ``shift_mean=False`` the mean is added back (scale only, the sign of every
    advantage relative to the batch mean is kept). Unmasked entries are set to 0.

    Args:
        values: float [B, T] (any shape). mask: same shape, 1 on entries to use.
        shift_mean: subtract the mean (True) or only rescale (False).
        eps: > 0, variance stabiliser.

    Returns:
        float tensor of ``values``' shape.

    Raises:
        ValueError: mismatched shapes or fewer than 2 masked entries (variance undefined).

    Example: values ``[1, 2, 3, 100]``, mask ``[1, 1, 1, 0]``: mean 2, var 1 -> ``[-1, 0, 1, 0]``.
    """
    with torch.no_grad():
        _check_same_shape("values", values, mask=mask)
        m = (mask != 0).to(values.dtype)
        count = m.sum()
        if count < 2:
            raise ValueError(f"whiten needs at least 2 masked entries, got {int(count)}")
        x = torch.where(m > 0, values, torch.zeros_like(values))
        mean = x.sum() / count
        var = ((x - mean).square() * m).sum() / (count - 1)
        out = (x - mean) * torch.rsqrt(var + eps)
        if not shift_mean:
            out = out + mean
        return out * m


def turn_ids_from_mask(loss_mask: Tensor) -> Tensor:
    """Turn index of every token: turn k = the k-th maximal run of ones in a row of the mask.

    Args:
        loss_mask: [B, T] (bool/int/float), 1 on policy tokens.

    Returns:
        int64 [B, T]: 0, 1, ... on policy tokens, -1 elsewhere.

    Raises:
        ValueError: if ``loss_mask`` is not 2-D.

    Example: ``[[1, 1, 0, 0, 1, 0, 1]]`` -> ``[[0, 0, -1, -1, 1, -1, 2]]``.
    """
    with torch.no_grad():
        if loss_mask.dim() != 2:
            raise ValueError(f"loss_mask must be [B, T], got shape {tuple(loss_mask.shape)}")
        on = loss_mask != 0
        previous = torch.nn.functional.pad(on[:, :-1], (1, 0), value=False)
        starts = on & ~previous
        turn = starts.long().cumsum(dim=1) - 1
        return torch.where(on, turn, torch.full_like(turn, -1))


def compute_advantages(batch: TrainingBatch, objective: Objective) -> None:
    """Token rewards and advantages (and returns for critic variants) of ``batch``, in place.

    The outcome reward sits on each trajectory's last policy token; with ``kl_mode =
    in_reward`` the KL to the reference (against the proximal log-probs, or the behaviour
    ones where the log-linear proximal has none yet) is subtracted per token (critic
    variants) or summed over the trajectory (group variants). Then GAE over the critic's
    old values, optionally whitened (spec section 2; Schulman et al. 2016), or
    group-relative advantages broadcast to the policy tokens (GRPO, Shao et al. 2024).

    Sets ``batch.advantages`` [B, T] (and ``batch.returns`` [B, T] with a critic), float32.
    Needs ``batch.ref_logprobs`` and, with a critic, ``batch.old_values``.
    """
    mask = batch.loss_mask
    kl = torch.zeros_like(mask)
    if objective.kl_mode == "in_reward" and objective.kl_coef > 0.0:
        # the log-linear proximal has no log-probs here: the behaviour policy's stand in
        old = (
            batch.behavior_logprobs if batch.proximal_logprobs is None else batch.proximal_logprobs
        )
        kl = kl_penalty(old, batch.ref_logprobs, objective.kl_estimator)
        kl = kl * mask
    critic, group = objective.critic, objective.group
    if critic is not None:
        token_rewards = torch.zeros_like(mask)
        rows = torch.arange(batch.batch_size)
        token_rewards[rows, batch.last_policy_index] = batch.rewards
        token_rewards = token_rewards - objective.kl_coef * kl
        gae = compute_gae(token_rewards, batch.old_values, mask, gamma=critic.gamma, lam=critic.lam)
        advantages = gae.advantages
        if critic.whiten_advantages:
            advantages = whiten(advantages, mask)
        batch.advantages, batch.returns = advantages.float(), gae.returns.float()
        return
    assert group is not None
    # group-relative: KL-in-reward lowers the scalar reward by the trajectory's total KL
    rewards = batch.rewards - objective.kl_coef * kl.sum(dim=1)
    per_sequence = group_relative_advantages(
        rewards,
        batch.group_ids,
        std_normalize=group.std_normalize,
        eps=group.eps,
    )
    batch.advantages = broadcast_sequence_advantages(per_sequence, mask).float()
