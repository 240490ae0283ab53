"""Micro-batches: how a stage's rows are cut into forwards, and the token budget that sizes them.

Every stage of a learner step (the no-grad prepare, each mini-batch's backwards, the
clip-bias pre-pass, an SFT step) runs its rows through :meth:`MicroBatchPlanner.plan`:
the rows go to ranks by whole trajectories, balanced by token count
(:func:`learner.distributed.balanced_shards`), each rank's share is cut into micro-batches
by count (``micro_batch_size``) or by a token budget (``micro_batch_tokens``,
:func:`token_budget_micro_batches`), and a rank with fewer micro-batches than the busiest
runs padding ones (a real row, weight 0) so every rank runs the same forwards (ZeRO-3
gathers parameters in each).

``micro_batch_tokens = -1`` sizes the budget from memory: on CUDA first from an estimate
(:func:`memory_token_budget`, at most :data:`FIRST_STEP_TOKEN_BUDGET`), then from what the
first RL step held (:class:`MemoryProbe`, :meth:`MicroBatchPlanner.settle`); on a CPU
:data:`CPU_AUTO_TOKEN_BUDGET`. Ranks take the smallest budget: it cuts every rank's rows,
and their micro-batch counts must agree.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from learner.batch import TrainingBatch
from learner.config import LearnerConfig
from learner.distributed import all_reduce_floats, balanced_shards

logger = logging.getLogger(__name__)

FIRST_STEP_TOKEN_BUDGET = 8192
"""Cap of the ``micro_batch_tokens = -1`` budget before the first step on CUDA, while the
optimizer states' size is an estimate (:meth:`MicroBatchPlanner.initial_budget`)."""


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
    ``micro_batch_tokens = -1`` budget after it (:meth:`MicroBatchPlanner.settle`).

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


class MicroBatchPlanner:
    """This rank's micro-batches of every stage, and the memory-sized token budget.

    Args:
        config: returns the learner section in force (``micro_batch_size``,
            ``micro_batch_tokens``, ``pack_sequences``, ``gpu_memory_fraction``,
            ``gradient_checkpointing``).
        rank, world_size: this learner rank and the number of ranks.
        device: the engines' device (CUDA sizes the ``-1`` budget from memory).

    Attributes:
        auto_micro_batch_tokens: the budget ``micro_batch_tokens = -1`` stands for now.
        budget_settled: False on CUDA until the first RL step has measured the memory.
        memory_probe: what that step held (:class:`MemoryProbe`).
    """

    def __init__(
        self, config: Callable[[], LearnerConfig], rank: int, world_size: int, device: Any
    ) -> None:
        self.config = config
        self.rank, self.world_size, self.device = rank, world_size, device
        self.auto_micro_batch_tokens = CPU_AUTO_TOKEN_BUDGET
        self.budget_settled = device.type != "cuda"
        self.memory_probe = MemoryProbe()

    def plan(self, batch: TrainingBatch, rows: Sequence[int]) -> list[tuple[list[int], bool]]:
        """This rank's micro-batches over ``rows`` of ``batch``: ``(rows, real)`` pairs.

        ``rows`` go to ranks by :func:`balanced_shards` (token counts = real tokens per
        row), each shard is cut in micro-batches (:meth:`chunks`: by count or by
        token budget), and a rank with fewer chunks than the busiest rank gets padding chunks (``real = False``: ``rows[:1]``,
        to be run with weight 0), so every rank runs the same number of forwards.
        """
        rows = [int(r) for r in rows]
        if self.world_size == 1:
            return [(chunk, True) for chunk in self.chunks(batch, rows)]
        tokens = batch.attention_mask.sum(dim=1)
        shards = balanced_shards(rows, [int(tokens[r]) for r in rows], self.world_size)
        chunks = [self.chunks(batch, shard) for shard in shards]
        count = max(len(c) for c in chunks)
        plan = [(chunk, True) for chunk in chunks[self.rank]]
        return plan + [(rows[:1], False)] * (count - len(plan))

    def chunks(self, batch: TrainingBatch, rows: list[int]) -> list[list[int]]:
        """``rows`` cut into micro-batches: by token budget (``micro_batch_tokens > 0``, or
        -1: the budget sized from memory, :meth:`initial_budget`), else
        ``micro_batch_size`` at a time in order. Empty ``rows``: no micro-batch."""
        if not rows:
            return []
        config = self.config()
        budget = config.micro_batch_tokens
        if budget == -1:
            budget = self.auto_micro_batch_tokens
        if budget > 0:
            return token_budget_micro_batches(
                rows,
                batch.prompt_lengths,
                batch.response_lengths,
                budget,
                packed=config.pack_sequences,
            )
        size = config.micro_batch_size
        return [rows[s : s + size] for s in range(0, len(rows), size)]

    def initial_budget(self, engines: Sequence[Any]) -> int:
        """The token budget ``micro_batch_tokens = -1`` stands for at start-up (CPU: 4,096),
        from the memory left by the trained ``engines`` (policy first, whose model config
        sizes the activations; their AdamW states are still to come).

        On CUDA it is sized twice, within ``gpu_memory_fraction`` of the device. At
        start-up, from the memory free (at most that share less what the learner reserved)
        less the AdamW states still to come
        (:data:`OPTIMIZER_BYTES_PER_PARAMETER` per trainable parameter) and
        the estimate of :func:`memory_token_budget`, at most
        :data:`FIRST_STEP_TOKEN_BUDGET`; after the first RL learner step
        (:meth:`settle`) from what that step measured. Ranks take the
        smallest of their budgets: each one cuts every rank's micro-batches
        (:meth:`plan`), and their counts must agree."""
        if self.device.type != "cuda":
            return CPU_AUTO_TOKEN_BUDGET
        free, total = torch.cuda.mem_get_info(self.device)
        # within the learner's share of the device, less what it holds (its weights)
        share = self.config().gpu_memory_fraction * total
        free = min(free, int(share) - torch.cuda.memory_reserved(self.device))
        trainable = sum(
            p.numel() for engine in engines for p in engine.module.parameters() if p.requires_grad
        )
        pending = trainable * OPTIMIZER_BYTES_PER_PARAMETER
        budget = memory_token_budget(
            free,
            engines[0].module.config,
            gradient_checkpointing=self.config().gradient_checkpointing,
            pending_bytes=pending,
        )
        logger.info(
            "first-step micro-batch token budget from %.1f GiB free, %.1f GiB of optimizer "
            "states to come: %d tokens (at most %d)",
            free / 2**30,
            pending / 2**30,
            budget,
            FIRST_STEP_TOKEN_BUDGET,
        )
        return self._smallest_over_ranks(min(budget, FIRST_STEP_TOKEN_BUDGET))

    def _smallest_over_ranks(self, budget: int) -> int:
        """The smallest of every rank's ``budget`` (a collective; itself on one rank)."""
        (largest_negated,) = all_reduce_floats([-float(budget)], self.world_size, "max")
        return int(-largest_negated)

    def settle(self) -> None:
        """After the first RL learner step on CUDA: the ``micro_batch_tokens = -1`` budget
        from what that step measured (:class:`MemoryProbe`), once. The memory
        held while its micro-batches ran (``state_bytes``: weights, gradients, optimizer
        states; not an optimizer step's temporaries) comes off the device's total
        less what is not torch's (the CUDA contexts, other processes), or off
        ``gpu_memory_fraction`` of the total where that is less; what is left, divided by
        the bytes a training micro-batch held per token, gives
        :func:`settled_token_budget`.
        SFT steps do not settle it: the critic's optimizer states do not exist yet then.
        Every rank settles at the same step and all take the smallest budget."""
        if self.budget_settled:
            return
        self.budget_settled = True
        probe = self.memory_probe
        measured = probe.optimizer_steps > 0 and probe.bytes_per_token > 0.0
        budget = self.auto_micro_batch_tokens  # nothing measured (fp32 ZeRO-0): it stays
        if measured:
            free, total = torch.cuda.mem_get_info(self.device)
            not_torch = total - free - torch.cuda.memory_reserved(self.device)
            device = min(total - not_torch, int(self.config().gpu_memory_fraction * total))
            available = device - probe.state_bytes
            budget = settled_token_budget(available, probe.bytes_per_token)
        self.auto_micro_batch_tokens = self._smallest_over_ranks(budget)
        if measured:
            logger.info(
                "micro-batch token budget from the first step: %.1f GiB left by its states, "
                "%.0f KiB per token held by a micro-batch: %d tokens "
                "(the smallest over ranks)",
                available / 2**30,
                probe.bytes_per_token / 2**10,
                self.auto_micro_batch_tokens,
            )

    @contextlib.contextmanager
    def probed(self, model: str, micro: TrainingBatch, accumulating: bool) -> Iterator[None]:
        """Measures a training micro-batch's forward and backward for the memory probe while
        the token budget is not settled (on CUDA, the first RL step); else nothing.
        ``accumulating``: not the first micro-batch of its mini-batch (the model's gradients
        are held before its forward)."""
        if self.budget_settled:
            yield
            return
        mask = micro.attention_mask  # the budget counts real tokens packed, slots padded
        tokens = int(mask.sum()) if self.config().pack_sequences else mask.numel()
        start = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        yield
        peak = torch.cuda.max_memory_allocated(self.device)
        self.memory_probe.micro_batch(model, start, peak, tokens, accumulating)

    def step(self, engine: Any) -> None:
        """``engine.step()``; while the budget is not settled (CUDA, the first RL step) its
        peak memory goes to the probe."""
        if self.budget_settled:
            engine.step()
            return
        torch.cuda.reset_peak_memory_stats(self.device)
        engine.step()
        self.memory_probe.optimizer_step(
            torch.cuda.max_memory_allocated(self.device),
            torch.cuda.memory_allocated(self.device),
            applied=bool(engine.was_step_applied()),
        )
