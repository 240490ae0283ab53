"""Collation of rollout trajectories into padded training tensors.

Layout (one row per trajectory; P = longest prompt, T = longest response, L = P + T)::

    column        0 ........ P-1 | P ............. P+T-1
    input_ids     [pad][prompt ]  | [response ][pad]
    attention     [ 0 ][  1    ]  | [   1     ][ 0 ]

Prompts are left-padded and responses right-padded, so every row's response starts at the
same column P. Position ids count only real tokens (``cumsum(attention_mask) - 1``), so a
left-padded row sees the same positions as the unpadded sequence.

Per-token training tensors are [B, T] and indexed by *response token*: column t is
response token t. In a causal LM the logits at sequence column ``P + t - 1`` predict the
token at column ``P + t``, so the [B, T] predictions are the logits of columns
``P-1 .. P+T-2`` (see :func:`learner.modeling.response_logits`). ``loss_mask``,
``turn_ids`` and ``behavior_logprobs`` are copied unshifted from the
:class:`actors.trajectory.Trajectory` (which aligns them with ``response_ids``), so position
t of every [B, T] tensor refers to the same token.

Padding values: ``loss_mask`` 0, ``turn_ids`` -1, ``behavior_logprobs`` 0.0,
``response_ids`` ``pad_token_id`` (never trained: masked).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
from torch import Tensor

from actors.trajectory import Trajectory

_L = TypeVar("_L")

_SEQUENCE_FIELDS = ("input_ids", "attention_mask", "position_ids")
"""[B, L] fields (prompt + response columns)."""

HOST_FIELDS = ("prompt_lengths", "response_lengths")
"""Layout bookkeeping the host reads (:meth:`TrainingBatch.select`, the packed layout of
:mod:`learner.packing`): :meth:`TrainingBatch.to` leaves them on the CPU, so reading them
never waits for the GPU."""


def to_device(tensor: Tensor, device: torch.device | str) -> Tensor:
    """``tensor`` on ``device`` without making the host wait for the GPU.

    A blocking copy between the host and a CUDA device synchronises the stream: PyTorch's
    copy waits for every kernel queued before it, so the GPU idles while the host then
    prepares and launches what comes next. A host tensor therefore goes to CUDA through
    page-locked memory with ``non_blocking=True`` (the copy is queued in stream order; the
    pinned buffer is the caching host allocator's, kept until the copy has run). Elsewhere
    (the CPU, or a tensor already there) it is ``tensor.to(device, non_blocking=True)``,
    which is the plain ``to``.

    Args:
        tensor: any tensor.
        device: the target device.

    Returns:
        The tensor on ``device`` (``tensor`` itself when already there).
    """
    device = torch.device(device)
    if device.type == "cuda" and tensor.device.type == "cpu":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


@dataclass
class TrainingBatch:
    """Padded tensors for a list of trajectories (layout in the module docstring).

    Attributes:
        input_ids: int64 [B, L]. Prompt (left-padded) then response (right-padded).
        attention_mask: int64 [B, L]. 1 on real tokens.
        position_ids: int64 [B, L]. Position of each real token in its own sequence.
        response_ids: int64 [B, T]. ``input_ids[:, P:]``.
        response_mask: float32 [B, T]. 1 on real response tokens (policy and environment).
        loss_mask: float32 [B, T]. 1 on policy-generated tokens (the trained ones).
        turn_ids: int64 [B, T]. Turn index on policy tokens, -1 elsewhere (environment, pad).
        behavior_logprobs: float32 [B, T]. Behaviour-policy log-probs, 0 off the mask.
        last_policy_index: int64 [B]. Column of each row's last policy token (where the
            outcome reward is placed).
        prompt_lengths: int64 [B]. Real prompt tokens per row.
        response_lengths: int64 [B]. Real response tokens per row.
        rewards: float32 [B]. Outcome reward per trajectory.
        success: float32 [B]. 1.0 where the answer was correct.
        num_turns: float32 [B]. Policy turns per trajectory.
        group_ids: int64 [B]. GRPO group index (first-seen order of ``Trajectory.group_id``).
        policy_version_min: int64 [B]. Oldest weight version behind each trajectory.
        token_versions: int64 [B, T]. Version that sampled each policy token, -1 elsewhere
            (environment, pad); see :meth:`actors.trajectory.Trajectory.policy_token_versions`.
        proximal_logprobs, ref_logprobs, old_values, advantages, returns: float32 [B, T] or
            None; filled by the learner before the optimisation epochs.
            ``proximal_logprobs`` are the policy the clipped ratio is taken against: the
            proximal policy of decoupled PPO (recomputed; None with the log-linear proximal,
            which is approximated per micro-batch), or under ``off_policy = behavior`` the
            behaviour policy, which is the proximal one there.
        behavior_weights: float32 [B, T] or None; decoupled PPO's truncated
            pi_prox / pi_behaviour (:func:`learner.losses.behavior_importance_weights`).
        policy_positions: ``(rows, columns)`` of the policy tokens, int64 [N] each, or None;
            set by :meth:`to` (read them through :meth:`policy_token_positions`).

    A batch also keeps the forward inputs built from it, by layout (:meth:`layout`), so that
    the reference, critic and policy forwards of one micro-batch share one; a batch made by
    :meth:`select` or :meth:`to` starts with none. The fields a layout is built from (ids,
    masks, positions, lengths) are never reassigned.
    """

    input_ids: Tensor
    attention_mask: Tensor
    position_ids: Tensor
    response_ids: Tensor
    response_mask: Tensor
    loss_mask: Tensor
    turn_ids: Tensor
    behavior_logprobs: Tensor
    last_policy_index: Tensor
    prompt_lengths: Tensor
    response_lengths: Tensor
    rewards: Tensor
    success: Tensor
    num_turns: Tensor
    group_ids: Tensor
    policy_version_min: Tensor
    token_versions: Tensor | None = None
    proximal_logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None
    old_values: Tensor | None = None
    advantages: Tensor | None = None
    returns: Tensor | None = None
    behavior_weights: Tensor | None = None
    policy_positions: tuple[Tensor, Tensor] | None = dataclasses.field(default=None, repr=False)
    _layouts: dict[Hashable, Any] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def layout(self, key: Hashable, build: Callable[[TrainingBatch], _L]) -> _L:
        """The forward inputs of this batch for ``key`` (a layout), ``build(self)`` the first
        time and the same object after (:func:`learner.packing.model_inputs`)."""
        if key not in self._layouts:
            self._layouts[key] = build(self)
        return self._layouts[key]

    @property
    def batch_size(self) -> int:
        """B, the number of trajectories."""
        return int(self.input_ids.shape[0])

    @property
    def prompt_width(self) -> int:
        """P, the column where every response starts."""
        return int(self.input_ids.shape[1] - self.response_ids.shape[1])

    @property
    def num_policy_tokens(self) -> int:
        """Sum of ``loss_mask`` (tokens the policy loss trains on)."""
        return int(self.loss_mask.sum().item())

    @property
    def num_tokens(self) -> int:
        """Real (non-pad) tokens, prompt and response, i.e. what a forward pass processes."""
        return int(self.attention_mask.sum().item())

    def policy_token_positions(self) -> tuple[Tensor, Tensor]:
        """``(rows, columns)`` of the policy tokens (``loss_mask != 0``), int64 [N] each in
        row-major order, N the number of policy tokens: where the chunked LM head computes
        (:func:`learner.logprobs.masked_token_stats`).

        A batch moved by :meth:`to` carries them, found on the host before the move; others
        compute them here, which on a GPU makes the host wait (``nonzero``'s size is data).
        """
        if self.policy_positions is not None:
            return self.policy_positions
        return (self.loss_mask != 0).nonzero(as_tuple=True)

    def to(self, device: torch.device | str) -> TrainingBatch:
        """The same batch with its tensors on ``device`` (no copy when already there), but
        :data:`HOST_FIELDS`, which stay where they are; copied by :func:`to_device`, so a
        host batch reaches a GPU without the host waiting for the GPU's queued work. The
        copy carries :meth:`policy_token_positions`, computed where the batch was (on the
        host: no wait)."""
        changes: dict[str, Tensor | None] = {}
        for name, value in self._row_fields():
            if value is not None and name not in HOST_FIELDS:
                value = to_device(value, device)
            changes[name] = value
        rows, columns = (to_device(t, device) for t in self.policy_token_positions())
        return TrainingBatch(**changes, policy_positions=(rows, columns))

    def _row_fields(self) -> list[tuple[str, Tensor | None]]:
        """``(name, value)`` of the per-row fields: every field but the derived ones,
        ``policy_positions`` and the layouts (not indexed by row)."""
        return [
            (f.name, getattr(self, f.name))
            for f in dataclasses.fields(self)
            if f.name not in ("policy_positions", "_layouts")
        ]

    def select(self, indices: Sequence[int] | Tensor) -> TrainingBatch:
        """Rows ``indices`` as a new batch, with padding columns no row needs trimmed away.

        Trimming keeps the layout invariant (responses start at the new P), so micro-batches
        of short trajectories do not pay for the longest one in the full batch.

        Raises:
            ValueError: if ``indices`` is empty.
        """
        index = torch.as_tensor(indices, dtype=torch.long)
        if index.numel() == 0:
            raise ValueError("select() needs at least one row index")
        old_prompt_width = self.prompt_width
        new_prompt_width = int(self.prompt_lengths[index].max().item())
        new_response_width = int(self.response_lengths[index].max().item())
        start = old_prompt_width - new_prompt_width
        stop = old_prompt_width + new_response_width
        num_response_columns = self.response_ids.shape[1]
        changes: dict[str, Tensor | None] = {}
        for name, value in self._row_fields():
            if value is None:
                changes[name] = None
                continue
            rows = value[index]
            if name in _SEQUENCE_FIELDS:
                rows = rows[:, start:stop]
            elif rows.dim() == 2 and value.shape[1] == num_response_columns:
                rows = rows[:, :new_response_width]
            changes[name] = rows.contiguous()
        return TrainingBatch(**changes)


def _group_indices(group_ids: Sequence[str]) -> list[int]:
    """Map string group ids to 0, 1, ... in order of first appearance."""
    mapping: dict[str, int] = {}
    return [mapping.setdefault(g, len(mapping)) for g in group_ids]


def collate_trajectories(trajectories: Sequence[Trajectory], pad_token_id: int) -> TrainingBatch:
    """Stack trajectories into a :class:`TrainingBatch` (layout in the module docstring).

    Args:
        trajectories: at least one; each must pass :meth:`Trajectory.validate` and have at
            least one policy token.
        pad_token_id: id written into padding columns (never attended to or trained on).

    Returns:
        The padded batch, tensors on CPU.

    Raises:
        ValueError: empty input, a trajectory that fails validation, or one with no policy
            token (nothing to train on: filter those out first).

    Example: prompts [5, 6] and [7]; responses [8, 9, 10] (mask 1 1 0) and [11] (mask 1)
    give P = 2, T = 3 and ``input_ids = [[5, 6, 8, 9, 10], [pad, 7, 11, pad, pad]]``.
    """
    if not trajectories:
        raise ValueError("collate_trajectories needs at least one trajectory")
    for i, traj in enumerate(trajectories):
        try:
            traj.validate()
        except ValueError as err:
            raise ValueError(f"trajectory {i} ({traj.question_id}): {err}") from err
        if traj.num_policy_tokens == 0:
            raise ValueError(f"trajectory {i} ({traj.question_id}) has no policy tokens")
    batch_size = len(trajectories)
    prompt_width = max(int(t.prompt_ids.shape[0]) for t in trajectories)
    response_width = max(t.num_response_tokens for t in trajectories)
    total = prompt_width + response_width

    input_ids = np.full((batch_size, total), pad_token_id, dtype=np.int64)
    attention_mask = np.zeros((batch_size, total), dtype=np.int64)
    loss_mask = np.zeros((batch_size, response_width), dtype=np.float32)
    turn_ids = np.full((batch_size, response_width), -1, dtype=np.int64)
    behavior_logprobs = np.zeros((batch_size, response_width), dtype=np.float32)
    token_versions = np.full((batch_size, response_width), -1, dtype=np.int64)
    last_policy_index = np.zeros(batch_size, dtype=np.int64)
    for b, traj in enumerate(trajectories):
        p, r = int(traj.prompt_ids.shape[0]), traj.num_response_tokens
        input_ids[b, prompt_width - p : prompt_width] = traj.prompt_ids
        input_ids[b, prompt_width : prompt_width + r] = traj.response_ids
        attention_mask[b, prompt_width - p : prompt_width + r] = 1
        loss_mask[b, :r] = traj.loss_mask
        turn_ids[b, :r] = traj.turn_ids
        behavior_logprobs[b, :r] = traj.behavior_logprobs
        token_versions[b, :r] = traj.policy_token_versions()
        last_policy_index[b] = int(np.flatnonzero(traj.loss_mask)[-1])

    attention = torch.from_numpy(attention_mask)
    position_ids = (attention.cumsum(dim=1) - 1).clamp_min(0)
    response_lengths = torch.tensor([t.num_response_tokens for t in trajectories])
    response_mask = (
        torch.arange(response_width).unsqueeze(0) < response_lengths.unsqueeze(1)
    ).float()
    ids = torch.from_numpy(input_ids)
    return TrainingBatch(
        input_ids=ids,
        attention_mask=attention,
        position_ids=position_ids,
        response_ids=ids[:, prompt_width:].clone(),
        response_mask=response_mask,
        loss_mask=torch.from_numpy(loss_mask),
        turn_ids=torch.from_numpy(turn_ids),
        behavior_logprobs=torch.from_numpy(behavior_logprobs),
        last_policy_index=torch.from_numpy(last_policy_index),
        prompt_lengths=torch.tensor([int(t.prompt_ids.shape[0]) for t in trajectories]),
        response_lengths=response_lengths,
        rewards=torch.tensor([float(t.reward) for t in trajectories], dtype=torch.float32),
        success=torch.tensor([float(t.success) for t in trajectories], dtype=torch.float32),
        num_turns=torch.tensor([float(t.num_turns) for t in trajectories], dtype=torch.float32),
        group_ids=torch.tensor(_group_indices([t.group_id for t in trajectories])),
        policy_version_min=torch.tensor([int(t.policy_version_min) for t in trajectories]),
        token_versions=torch.from_numpy(token_versions),
    )


class EmptyBatchError(ValueError):
    """No trajectory of a step is trainable (all excluded); the message says why."""


@dataclass
class Selection:
    """The trajectories a step trains on and how many it excluded, by reason."""

    kept: list[Trajectory]
    retrieval_failed: int
    no_policy_tokens: int
    singleton_group: int


def select_trainable(trajectories: Sequence[Trajectory], group_relative: bool) -> Selection:
    """The trajectories a learner step trains on: not those whose search failed after
    retries (no valid reward), nor those without a policy token, nor, with
    ``group_relative`` advantages, those alone in their group (a group-relative advantage
    needs two). Each exclusion is counted.

    Raises:
        EmptyBatchError: nothing is left; the message gives the counts.
    """
    kept = [t for t in trajectories if not t.retrieval_failed]
    retrieval_failed = len(trajectories) - len(kept)
    with_tokens = [t for t in kept if t.num_policy_tokens > 0]
    no_tokens = len(kept) - len(with_tokens)
    singleton = 0
    if group_relative:
        sizes: dict[str, int] = defaultdict(int)
        for t in with_tokens:
            sizes[t.group_id] += 1
        grouped = [t for t in with_tokens if sizes[t.group_id] >= 2]
        singleton = len(with_tokens) - len(grouped)
        with_tokens = grouped
    if not with_tokens:
        raise EmptyBatchError(
            f"no trainable trajectory among {len(trajectories)}: {retrieval_failed} "
            f"retrieval failed, {no_tokens} without policy tokens, {singleton} alone "
            "in their group (group-relative advantages need >= 2 per group)"
        )
    return Selection(with_tokens, retrieval_failed, no_tokens, singleton)
