"""Forward inputs of a micro-batch, padded or packed, and where each response token's output is.

A :class:`learner.batch.TrainingBatch` is padded: B rows of L = P + T columns, prompts
left-padded to P and responses right-padded to T, so a micro-batch of uneven trajectories
computes ``B * L`` token slots for ``sum(n_b)`` real tokens (n_b = prompt + response of row
b). In the learner benchmark's 1.7B batch a quarter of the slots were padding.

Packed (sequence packing without padding): the trajectories are placed whole, first-fit
decreasing by length, into rows of width W = max(n_b), one after the other::

    row 0   [ seq 3 (longest) ......................... ]
    row 1   [ seq 0 ............. ][ seq 2 ....... ][pad]
    row 2   [ seq 1 ....................... ][pad ......]

with ``position_ids`` restarting at 0 at the start of each trajectory (and of each row's
tail of padding) and the block-diagonal causal mask (:func:`block_causal_mask`: a token
attends only to earlier tokens of its own trajectory) prepared as a 4D mask, which
transformers passes to every layer's attention as it is. Given no mask, transformers would
build the same one from the positions (``masking_utils.find_packed_sequence_indices``), but
its check for packed rows reads a GPU tensor on the host at every forward; here the
segments are known on the host, so the mask is built on the device without a wait. A token
sees exactly what it sees in the padded layout (its own trajectory's earlier tokens, the
same positions), so outputs agree to rounding (the test: ``tests/unit/learner/test_packing.py``,
losses within 1e-5 in float32). Rows are never wider than the
longest trajectory, so the attention work (rows * W^2 with a dense mask) never exceeds the
padded layout's (B * L^2), and the linear layers compute ``rows * W`` slots instead of
``B * L``.

The varlen layout (``learner.packed_attention = "varlen"``) puts every trajectory into one
row, longest first, with no tail, and gives the forward the trajectories' cumulative
lengths (``ModelInputs.cu_seq_lens``) for the variable-length attention of
:mod:`learner.attention`, which computes each trajectory's causal attention alone: no
dense mask, and ``sum(n_b^2) / 2`` scores instead of ``rows * W^2``.

Each layout answers where the output that predicts response token t of row b is:
``state_index[b, t]``, a flat index into the forward's ``[rows * width]`` outputs.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from learner.batch import TrainingBatch, to_device


@dataclass(frozen=True)
class ModelInputs:
    """One micro-batch as a forward of the policy, critic or reference takes it.

    Attributes:
        input_ids: int64 [R, W]: R rows of W columns (R = B padded; R <= B packed).
        attention_mask: int64 [R, W] (padded), or a prepared 4D mask transformers passes to
            the attention as it is (packed): bool [R, 1, W, W], the block-diagonal causal
            mask of :func:`block_causal_mask`; varlen: bool [1, 1, 0, 0], empty, since the
            varlen attention keeps the segments apart by ``cu_seq_lens`` (an attention that
            did read it would fail on its shape). Prepared here from the host-known
            layout, it spares transformers' search for packed sequences in the positions,
            whose ``.all()`` made the host wait for the GPU at every forward's start.
        position_ids: int64 [R, W]: each token's position in its own trajectory.
        state_index: int64 [B, T]: ``flat[state_index[b, t]]`` is the output (hidden state,
            logits) of the column that predicts response token t of row b, where ``flat`` is
            the forward's output reshaped to [R * W, ...]. Off the response (t >= the row's
            response length) it points at some column of the same trajectory: values there
            are meaningless and masked by the caller, as in the padded layout.
        cu_seq_lens: int32 [S + 1] (the varlen layout only, else None): cumulative lengths
            of the S trajectories of its one row, in row order, 0 first and W last; the
            varlen attention (:mod:`learner.attention`) keeps each to itself.
        max_length: the longest segment (varlen layout; 0 otherwise).
    """

    input_ids: Tensor
    attention_mask: Tensor
    position_ids: Tensor
    state_index: Tensor
    cu_seq_lens: Tensor | None = None
    max_length: int = 0

    @property
    def packed(self) -> bool:
        """Whether this is a packed layout (the mask is prepared, 4D)."""
        return self.attention_mask.dim() == 4

    @property
    def slots(self) -> int:
        """R * W, the token slots a forward computes (real tokens plus padding)."""
        return int(self.input_ids.numel())

    def forward_kwargs(self) -> dict[str, Any]:
        """``input_ids``, ``attention_mask`` and ``position_ids`` for an HF model call, and
        in the varlen layout the segments as transformers' flash-attention keyword
        arguments (``cu_seq_lens_q/k``, ``max_length_q/k``), which reach every layer's
        attention function."""
        kwargs: dict[str, Any] = {
            "input_ids": self.input_ids,
            "attention_mask": self.attention_mask,
            "position_ids": self.position_ids,
        }
        if self.cu_seq_lens is not None:
            kwargs.update(
                cu_seq_lens_q=self.cu_seq_lens,
                cu_seq_lens_k=self.cu_seq_lens,
                max_length_q=self.max_length,
                max_length_k=self.max_length,
            )
        return kwargs

    def states(self, outputs: Tensor, index: Tensor | None = None) -> Tensor:
        """The outputs that predict response tokens.

        Args:
            outputs: [R, W, ...] (a forward's hidden states or logits).
            index: optional int64 of any shape, entries of :attr:`state_index` to take
                (default: all of it).

        Returns:
            ``outputs`` at ``index``: [*index.shape, ...] ([B, T, ...] by default).
        """
        flat = outputs.reshape(-1, *outputs.shape[2:])
        return flat[self.state_index if index is None else index]


def padded_inputs(batch: TrainingBatch) -> ModelInputs:
    """The batch's own padded layout (module docstring of :mod:`learner.batch`)."""
    rows, width = batch.input_ids.shape
    num_response = batch.response_ids.shape[1]
    columns = torch.arange(num_response, device=batch.input_ids.device) + batch.prompt_width - 1
    state_index = torch.arange(rows, device=columns.device).unsqueeze(1) * width + columns
    return ModelInputs(batch.input_ids, batch.attention_mask, batch.position_ids, state_index)


def pack_rows(lengths: list[int], width: int | None = None) -> tuple[int, list[tuple[int, int]]]:
    """First-fit-decreasing placement of sequences into rows as wide as the longest one.

    Args:
        lengths: tokens of each sequence (>= 1 each).
        width: the row width instead of the longest length (>= it): ``sum(lengths)`` puts
            every sequence into one row, longest first.

    Returns:
        ``(width, places)``: the row width W = max(lengths) and, per sequence in input
        order, ``(row, start column)``. Sequences go longest first (ties: earlier first)
        into the first row with room; deterministic.

    Raises:
        ValueError: ``lengths`` empty or holding a length < 1.

    Example: lengths [3, 5, 2, 4] -> width 5, places [(2, 0), (0, 0), (2, 3), (1, 0)]
    (rows: [seq 1], [seq 3], [seq 0, seq 2]; 15 slots for 14 tokens, padded 4 * 5 = 20).
    """
    if not lengths or min(lengths) < 1:
        raise ValueError(f"lengths must be a non-empty list of positive ints, got {lengths}")
    if width is None:
        width = max(lengths)
    elif width < max(lengths):
        raise ValueError(f"width {width} is narrower than the longest sequence ({max(lengths)})")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    used: list[int] = []
    places: list[tuple[int, int]] = [(0, 0)] * len(lengths)
    for i in order:
        for row, filled in enumerate(used):
            if filled + lengths[i] <= width:
                places[i] = (row, filled)
                used[row] += lengths[i]
                break
        else:
            places[i] = (len(used), 0)
            used.append(lengths[i])
    return width, places


def packed_inputs(batch: TrainingBatch, varlen: bool = False) -> ModelInputs:
    """The batch's trajectories packed without padding (module docstring).

    Args:
        batch: a (micro-)batch in the padded layout; every row has >= 1 prompt token.
        varlen: the varlen layout: every trajectory in one row, longest first, no tail
            (the attention keeps them apart by ``cu_seq_lens``, not by a mask over rows).

    Returns:
        :class:`ModelInputs` with a prepared 4D ``attention_mask``, on the batch's
        device; with ``varlen`` one row, ``cu_seq_lens`` set and an empty mask.

    Raises:
        ValueError: a row without prompt tokens (no column predicts its first response token).
    """
    # the lengths are host fields (TrainingBatch.to keeps them on the CPU): reading them
    # does not wait for the GPU; the layout is built on the host and uploaded without a wait
    prompt_lengths, response_lengths = torch.stack(
        [batch.prompt_lengths, batch.response_lengths]
    ).tolist()
    if min(prompt_lengths) < 1:
        raise ValueError("every row needs at least one prompt token to be packed")
    lengths = [p + r for p, r in zip(prompt_lengths, response_lengths, strict=True)]
    width, places = pack_rows(lengths, sum(lengths) if varlen else None)
    num_rows = 1 + max(row for row, _ in places)
    # the flat column of the padded batch each packed slot takes its id from; -1 on the
    # rows' tails (their ids are never read: 0)
    source = torch.full((num_rows, width), -1, dtype=torch.long)
    # every column starts as "its own one-token sequence" at position 0; trajectories and
    # each row's tail then overwrite with counting positions
    position_ids = torch.zeros((num_rows, width), dtype=torch.long)
    num_response = batch.response_ids.shape[1]
    state_index = torch.zeros((batch.batch_size, num_response), dtype=torch.long)
    padded_width, prompt_width = batch.input_ids.shape[1], batch.prompt_width
    filled = [0] * num_rows
    t = torch.arange(num_response)
    for b, (row, start) in enumerate(places):
        p, n = prompt_lengths[b], lengths[b]
        first = b * padded_width + prompt_width - p
        source[row, start : start + n] = torch.arange(first, first + n)
        position_ids[row, start : start + n] = torch.arange(n)
        filled[row] = max(filled[row], start + n)
        # column start + p - 1 + t predicts response token t; past the response, the row's last
        column = start + p - 1 + torch.clamp(t, max=max(response_lengths[b] - 1, 0))
        state_index[b] = row * width + column
    for row, used in enumerate(filled):  # the tail of padding: one sequence of its own
        position_ids[row, used:] = torch.arange(width - used)
    device = batch.input_ids.device
    cu_seq_lens, max_length = None, 0
    if varlen:  # segments start where positions restart (built here, on the host)
        flat = position_ids.flatten()
        starts = [*(flat == 0).nonzero().flatten().tolist(), flat.numel()]
        max_length = max(b - a for a, b in itertools.pairwise(starts))
        cu_seq_lens = to_device(torch.tensor(starts, dtype=torch.int32), device)
        attention_mask = torch.empty((1, 1, 0, 0), dtype=torch.bool, device=device)
    else:  # a segment starts where positions restart (the rows' tails are segments too)
        segment_ids = (position_ids == 0).cumsum(dim=1)
        attention_mask = block_causal_mask(to_device(segment_ids, device))
    source = to_device(source, device)
    input_ids = batch.input_ids.flatten()[source.clamp(min=0)].masked_fill(source < 0, 0)
    return ModelInputs(
        input_ids,
        attention_mask,
        to_device(position_ids, device),
        to_device(state_index, device),
        cu_seq_lens,
        max_length,
    )


def block_causal_mask(segment_ids: Tensor) -> Tensor:
    """The attention mask of packed rows: each token attends to itself and the earlier
    tokens of its own segment.

    Args:
        segment_ids: int [R, W], each token's segment, equal within a segment; segments are
            contiguous (a segment id may recur in another row).

    Returns:
        bool [R, 1, W, W]: ``mask[r, 0, q, k]`` is True iff ``k <= q`` and tokens q and k
        of row r share a segment (what transformers builds from packed ``position_ids``,
        ``masking_utils.find_packed_sequence_indices`` and ``causal_mask_function``).
    """
    width = segment_ids.shape[1]
    causal = torch.ones((width, width), dtype=torch.bool, device=segment_ids.device).tril()
    return ((segment_ids.unsqueeze(2) == segment_ids.unsqueeze(1)) & causal).unsqueeze(1)


def model_inputs(batch: TrainingBatch, packed: bool, varlen: bool = False) -> ModelInputs:
    """:func:`packed_inputs` (``varlen``: its varlen layout) if ``packed`` else
    :func:`padded_inputs`, built once per batch and layout (:meth:`TrainingBatch.layout`), so
    every forward of one micro-batch (reference, old values, policy, critic) takes the same
    inputs (for a packed layout: one placement on the host, one upload, one mask)."""
    if packed:
        return batch.layout(("packed", varlen), lambda b: packed_inputs(b, varlen))
    return batch.layout("padded", padded_inputs)
