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
        old_logprobs, ref_logprobs, old_values, advantages, returns: float32 [B, T] or
            None; filled by the learner before the optimisation epochs. ``old_logprobs``
            is the policy the clipped ratio is taken against (behaviour, or proximal for
            decoupled PPO).
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
    old_logprobs: Tensor | None = None
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


def token_budget_micro_batches(
    rows: Sequence[int],
    prompt_lengths: Sequence[int],
    response_lengths: Sequence[int],
    budget: int,
    *,
    packed: bool = False,
) -> list[list[int]]:
    """Cut ``rows`` into micro-batches whose padded size stays within ``budget`` tokens.

    A micro-batch of rows R, collated by :meth:`TrainingBatch.select`, holds
    ``len(R) * (max prompt + max response)`` token slots, padding included; packed
    (``packed``, :mod:`learner.packing`) it is counted as its real tokens, the sum of the
    rows' prompt + response (what a packed forward computes, up to its rows' tails). Rows go
    longest first (ties: earlier row first) into the current micro-batch while its padded
    size stays within ``budget``, else they start a new one; a row longer than ``budget``
    is a micro-batch of its own. Rows of similar length end up together, so little padding
    is computed, and a lone row has none (its attention is plain causal). Deterministic.

    Args:
        rows: row indices of a batch.
        prompt_lengths, response_lengths: real prompt / response tokens of each row of that
            batch (indexed by row index, e.g. ``TrainingBatch.prompt_lengths``).
        budget: token slots per micro-batch (>= 1).
        packed: count real tokens instead of padded slots.

    Returns:
        Micro-batches of row indices; together they hold every row once.

    Raises:
        ValueError: ``budget < 1``.

    Example: rows of 10 + 90, 10 + 80 and 10 + 20 tokens, budget 200: [[0, 1], [2]]
    (2 * (10 + 90) = 200 fits; adding row 2 would make 3 * 100 = 300).
    """
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    position = {row: i for i, row in enumerate(rows)}
    order = sorted(
        rows, key=lambda r: (-(int(prompt_lengths[r]) + int(response_lengths[r])), position[r])
    )
    groups: list[list[int]] = []
    max_prompt = max_response = real = 0
    for row in order:
        prompt, response = int(prompt_lengths[row]), int(response_lengths[row])
        if groups:
            width = max(max_prompt, prompt) + max(max_response, response)
            size = real + prompt + response if packed else (len(groups[-1]) + 1) * width
            if size <= budget:
                groups[-1].append(row)
                max_prompt, max_response = max(max_prompt, prompt), max(max_response, response)
                real += prompt + response
                continue
        groups.append([row])
        max_prompt, max_response, real = prompt, response, prompt + response
    return groups


CPU_AUTO_TOKEN_BUDGET = 4096
"""``micro_batch_tokens = -1`` on a CPU: memory is seldom what limits a CPU micro-batch."""


def activation_bytes_per_token(model_config, *, gradient_checkpointing: bool) -> int:
    """Estimated activation memory kept for backward per token of a forward, in bytes.

    Per decoder layer and token, a bf16 transformer with a memory-efficient attention kernel
    (no L x L scores kept) keeps about ``2 * (6 H + 4 I)`` bytes: the inputs of the four
    attention projections and of the three SwiGLU projections, the normalised inputs and the
    gate product (after Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
    Transformer Models", eq. 2 with its s^2 term gone and a SwiGLU MLP of width I). With
    gradient checkpointing every layer keeps its input and residual (4 H bytes) and the
    layer being recomputed its whole set, counted twice (its backward's temporaries): 0.55
    MB per token at the 3B shape, where an H200 measured 0.56 MB.

    Args:
        model_config: an HF config with ``hidden_size`` (H), ``intermediate_size`` (I) and
            ``num_hidden_layers``.
        gradient_checkpointing: whether activations are recomputed in backward.

    Returns:
        Bytes per token (an estimate: the measured peak is what benchmarks report).
    """
    hidden, inter = int(model_config.hidden_size), int(model_config.intermediate_size)
    layers = int(model_config.num_hidden_layers)
    per_layer = 2 * (6 * hidden + 4 * inter)
    if gradient_checkpointing:
        return layers * 4 * hidden + 2 * per_layer
    return layers * per_layer


OPTIMIZER_BYTES_PER_PARAMETER = 12
"""Memory a trainable parameter still claims after the engines are built and before the
first optimizer step: AdamW's two float32 moments (8 bytes, allocated at the first step)
and the float32 gradient partition DeepSpeed's step makes (4 bytes)."""


def memory_token_budget(
    free_bytes: int,
    model_config,
    *,
    gradient_checkpointing: bool,
    pending_bytes: int = 0,
    fraction: float = 0.6,
) -> int:
    """Micro-batch token budget that keeps a forward's activations within ``fraction`` of
    the memory still free once the optimizer states exist:
    ``fraction * (free_bytes - pending_bytes) / activation_bytes_per_token``, at least 256.

    Args:
        free_bytes: device memory free now (after the engines are built).
        pending_bytes: memory the training will still claim before its first forward ends
            (the optimizer states: :data:`OPTIMIZER_BYTES_PER_PARAMETER` per trainable
            parameter).
        model_config, gradient_checkpointing: as in :func:`activation_bytes_per_token`.
        fraction: share of the free memory for activations (the rest: the LM head's
            float32 chunks, allocator slack, the optimizer step's temporaries).

    Raises:
        ValueError: ``fraction`` outside (0, 1].
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    per_token = activation_bytes_per_token(
        model_config, gradient_checkpointing=gradient_checkpointing
    )
    return max(256, int(fraction * max(0, free_bytes - pending_bytes) / per_token))


@dataclass
class MemoryProbe:
    """What the first learner step held on the device, measured, to size the
    ``micro_batch_tokens = -1`` budget after it (``Learner._settle_token_budget``).

    The estimate of :func:`activation_bytes_per_token` leaves out what a forward and backward
    hold besides the layers' activations (the LM head's float32 chunks, the attention mask
    of packed rows, DeepSpeed's gradient buckets); at the 3B shape on an H200 a budget sized
    from it ran out of memory where 8,192 tokens had fitted. The probe replaces the estimate
    by what one step measured.

    The first micro-batch of a mini-batch also allocates the gradients its backward
    produces (a model's size in its gradient dtype: 3.4 GB at 1.7B in bf16), which spread
    over its tokens read as activation bytes; from the second on the gradients are held
    before the forward (``start``) and the peak above it is the micro-batch's own. So a
    model's bytes per token come from its accumulating micro-batches when it had any, and
    the gradients count once, in ``state_bytes``.

    An optimizer step runs after its mini-batch's last backward, when no micro-batch's
    activations are held, so its temporaries (DeepSpeed's float32 copy of the gradient
    partition: 6.8 GB at 1.7B) never meet a micro-batch's: they are kept apart
    (``optimizer_peak_bytes``), and what stays after the step (the AdamW states, created
    at the first) counts in ``state_bytes``.

    Attributes:
        state_bytes: the most memory allocated before a training micro-batch's forward or
            right after an applied optimizer step: what is held while a micro-batch runs
            (every weight, gradient and optimizer state), in bytes. A step not applied may
            not have created its states: its peak counts instead.
        optimizer_peak_bytes: the most allocated during an optimizer step (the states and
            the step's temporaries), in bytes.
        optimizer_steps: optimizer steps measured.
    """

    state_bytes: int = 0
    optimizer_peak_bytes: int = 0
    optimizer_steps: int = 0
    largest: dict[str, tuple[int, float]] = dataclasses.field(default_factory=dict)
    """Per model: the tokens of its largest measured micro-batch and its bytes per token."""
    largest_accumulating: dict[str, tuple[int, float]] = dataclasses.field(default_factory=dict)
    """The same over micro-batches that accumulated into gradients already held."""

    def micro_batch(
        self, model: str, start: int, peak: int, tokens: int, accumulating: bool = False
    ) -> None:
        """One training micro-batch of ``model`` ("policy", "critic"): bytes allocated
        before its forward (``start``), the peak until its backward ended, its tokens, and
        whether an earlier backward of its mini-batch already held the gradients."""
        self.state_bytes = max(self.state_bytes, start)
        if tokens <= 0:
            return
        # more tokens wins; of two as large, the one that held more per token
        measured = (tokens, max(0, peak - start) / tokens)
        kept = (self.largest, self.largest_accumulating) if accumulating else (self.largest,)
        for largest in kept:
            largest[model] = max(largest.get(model, (0, 0.0)), measured)

    @property
    def bytes_per_token(self) -> float:
        """The largest ``(peak - start) / tokens`` of a model's largest training
        micro-batch (its largest accumulating one where it had any): its forward and
        backward's peak above what was allocated before it, per token as the budget counts
        them, in bytes (0.0 before any). The fixed part (the LM head's chunks) is spread over
        that micro-batch's tokens, which only overstates it for larger budgets."""
        per_model = {**self.largest, **self.largest_accumulating}
        return max((per_token for _, per_token in per_model.values()), default=0.0)

    def optimizer_step(self, peak: int, after: int, applied: bool = True) -> None:
        """One optimizer step: its peak allocated bytes (every state and its temporaries),
        those allocated after it, and whether it was applied."""
        self.optimizer_steps += 1
        self.optimizer_peak_bytes = max(self.optimizer_peak_bytes, peak)
        self.state_bytes = max(self.state_bytes, after if applied else peak)


def settled_token_budget(
    available_bytes: int, bytes_per_token: float, fraction: float = 0.8
) -> int:
    """Micro-batch token budget from measured memory: ``fraction * available_bytes /
    bytes_per_token``, at least 256 (and 256 when nothing was measured).

    Args:
        available_bytes: the device's memory less what is not torch's (the CUDA context)
            and :attr:`MemoryProbe.state_bytes`.
        bytes_per_token: :attr:`MemoryProbe.bytes_per_token`.
        fraction: share of it for a micro-batch (the rest: allocator fragmentation, longer
            rows' larger attention masks).

    Raises:
        ValueError: ``fraction`` outside (0, 1].
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    if bytes_per_token <= 0.0:
        return 256
    return max(256, int(fraction * max(0, available_bytes) / bytes_per_token))
