"""Shared builders for learner tests (importable because pytest puts ``tests/`` on sys.path
for the root conftest)."""

from __future__ import annotations

import numpy as np
import torch

from actors.trajectory import Trajectory
from learner.batch import collate_trajectories
from learner.modeling import response_logits, token_logprobs


def make_trajectory(
    prompt: list[int],
    response: list[int],
    loss_mask: list[int],
    behavior_logprobs: list[float] | None = None,
    *,
    reward: float = 1.0,
    group_id: str = "g0",
) -> Trajectory:
    """A valid Trajectory; turn ids derived from the mask (k-th run of ones = turn k)."""
    mask = np.asarray(loss_mask, dtype=np.int8)
    turn_ids = np.full(len(mask), -1, dtype=np.int32)
    turn, previous = -1, 0
    for t, m in enumerate(mask):
        if m and not previous:
            turn += 1
        if m:
            turn_ids[t] = turn
        previous = m
    if behavior_logprobs is None:
        behavior_logprobs = [-0.5 * m for m in loss_mask]
    return Trajectory(
        prompt_ids=np.asarray(prompt, dtype=np.int64),
        response_ids=np.asarray(response, dtype=np.int64),
        loss_mask=mask,
        turn_ids=turn_ids,
        behavior_logprobs=np.asarray(behavior_logprobs, dtype=np.float32),
        reward=reward,
        success=reward > 0,
        num_searches=int(turn_ids.max()),
        num_turns=int(turn_ids.max()) + 1,
        policy_version_min=3,
        policy_version_max=3,
        group_id=group_id,
        question_id=f"q/{group_id}",
        data_source="single_hop",
        finish_reason="answer",
    ).validate()


def _grouped_batch(
    rng: np.random.Generator, shapes: list[tuple[int, list[int]]], low: float, high: float
) -> list[Trajectory]:
    """One trajectory per ``(prompt length, loss mask)`` of ``shapes``: random token ids,
    behaviour log-probs uniform in [-high, -low] on policy tokens, groups of 2 with rewards
    1, 0, 1, 0, ..."""
    out = []
    for i, (prompt_length, mask) in enumerate(shapes):
        out.append(
            make_trajectory(
                rng.integers(10, 1000, prompt_length).tolist(),
                rng.integers(10, 1000, len(mask)).tolist(),
                mask,
                [-float(rng.uniform(low, high)) * m for m in mask],
                reward=float(i % 2 == 0),
                group_id=f"g{i // 2}",
            )
        )
    return out


def make_uneven_batch(seed: int = 0, num: int = 6) -> list[Trajectory]:
    """Trajectories of 2..12 prompt and 2..40 response tokens (2 turns), groups of 2, so
    short ones share packed rows (rows are as wide as the longest trajectory)."""
    rng = np.random.default_rng(seed)
    shapes = []
    for _ in range(num):
        prompt_length = int(rng.integers(2, 13))
        first, env = int(rng.integers(1, 16)), int(rng.integers(0, 12))
        second = int(rng.integers(1, 12))
        shapes.append((prompt_length, [1] * first + [0] * env + [1] * second))
    return _grouped_batch(rng, shapes, 6.0, 12.0)


def make_batch(seed: int, num: int = 4) -> list[Trajectory]:
    """``num`` two-turn trajectories in groups of 2, rewards 1, 0, 1, 0, ...; behaviour
    log-probs drawn far from the random model's (about -10.8 = -log 49152), so tokens clip."""
    rng = np.random.default_rng(seed)
    mask = [1] * 4 + [0] * 3 + [1] * 3
    return _grouped_batch(rng, [(5 + i, mask) for i in range(num)], 8.0, 13.0)


def make_tiny_learner(path, algorithm, **overrides):
    """A :class:`learner.trainer.Learner` on the model folder ``path`` in float32, ZeRO 0,
    4 trajectories per step and per mini-batch, micro-batches of 2, actor lr 1e-3;
    ``overrides`` replace any :class:`learner.config.LearnerConfig` field."""
    from learner.config import LearnerConfig
    from learner.trainer import Learner

    base = dict(
        dtype="fp32",
        zero_stage=0,
        train_batch_size=4,
        mini_batch_size=4,
        micro_batch_size=2,
        actor_lr=1e-3,
    )
    return Learner(path, LearnerConfig(**{**base, **overrides}), algorithm, seed=0)


def capture_gradients(learner) -> dict[str, dict[str, torch.Tensor]]:
    """The accumulated gradients at the first optimizer step of the policy and the critic in
    ``learner``'s next steps: ``{"policy": {name: grad}, "critic": {...}}``, filled as the
    step runs. Needs fp32 ZeRO-0 (:func:`make_tiny_learner`), where ``p.grad`` holds them."""
    captured: dict[str, dict[str, torch.Tensor]] = {}
    original = learner._optimizer_step
    names = {id(learner.policy_engine): "policy", id(learner.critic_engine): "critic"}

    def capture(engine, finite):
        name = names.get(id(engine))
        if name is not None and name not in captured:
            captured[name] = {
                n: p.grad.detach().clone() for n, p in engine.module.named_parameters()
            }
        return original(engine, finite)

    learner._optimizer_step = capture
    return captured


def expected_sft_loss(model: torch.nn.Module, trajectories: list[Trajectory], pad_id: int) -> float:
    """Token-mean cross-entropy over policy tokens, computed by hand on a plain HF model:
    what ``Learner.supervised_step`` must report for the same weights and batch."""
    batch = collate_trajectories(trajectories, pad_id)
    with torch.no_grad():
        logp = token_logprobs(response_logits(model, batch), batch.response_ids)
    return float(-(logp * batch.loss_mask).sum() / batch.loss_mask.sum())
