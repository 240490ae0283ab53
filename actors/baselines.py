"""One-turn evaluation baselines of the search agent: closed-book and single-retrieval RAG.

The Search-R1 and ST-PPO papers compare the trained agent with a model that answers
directly (no retrieval) and with one that answers after a single retrieval for the raw
question. Both are one batched engine call here:

- ``closed_book``: prompt :data:`actors.prompts.CLOSED_BOOK_SYSTEM_PROMPT` + the question;
- ``rag``: ONE ``/retrieve`` request with every record's raw question (top-k from the
  client config, 3 by default), the passages put in the user message
  (:func:`actors.prompts.prompt_messages`), then the answer.

Generation stops at ``</answer>`` (only: a baseline has no tool), EOS, or
``max_new_tokens_per_turn``. The output is scored by the same reward code as the agent
(:func:`actors.reward.compute_reward`) and returned as validated one-turn
:class:`~actors.trajectory.Trajectory` objects, so the same aggregation applies. A RAG
retrieval that fails after retries marks every trajectory of the batch
``retrieval_failed`` (scored 0, counted), never an empty passage list.

Ray-free, like the rest of ``actors/``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import numpy as np

from actors.config import RolloutConfig
from actors.engines.protocol import GenerationEngine, GenerationResult, SamplingParams
from actors.prompts import prompt_ids
from actors.retrieval_client import Passage, RetrievalFailed
from actors.reward import compute_reward
from actors.rollout import Retriever, check_record
from actors.scoring import compared_forms
from actors.trajectory import Trajectory, Transcript, TurnTranscript

BASELINE_MODES: tuple[str, ...] = ("closed_book", "rag")
"""The one-turn prompt modes this module runs (``agent`` is :mod:`actors.rollout`)."""

_FINISH_REASONS = {"stop": "answer", "eos": "eos", "length": "max_tokens"}
"""Engine finish reason -> episode ``finish_reason`` (the only stop string is ``</answer>``)."""

BASELINE_STOP: tuple[str, ...] = ("</answer>",)
"""A baseline's only action terminator."""


def run_single_turn(
    engine: GenerationEngine,
    tokenizer,
    records: Sequence[Mapping],
    mode: str,
    cfg: RolloutConfig,
    client: Retriever | None = None,
) -> list[Trajectory]:
    """Answer every record in one greedy turn, in prompt ``mode`` (see the module docstring).

    Args:
        engine: The policy.
        tokenizer: Its chat tokenizer.
        records: QA records (``id``, ``question``, ``golden_answers``, ``data_source``).
        mode: ``closed_book`` or ``rag``.
        cfg: ``max_new_tokens_per_turn`` is the answer's token budget;
            ``answer_normalization`` scores the answers.
        client: The retriever; required for ``rag``, unused for ``closed_book``.

    Returns:
        One validated trajectory per record, in order: ``num_turns == 1``, ``num_searches``
        1 for ``rag`` (the harness's retrieval) and 0 for ``closed_book``, ``group_id`` =
        ``question_id``.

    Raises:
        ValueError: empty ``records``, a malformed record, an unknown ``mode``, or ``rag``
            without a ``client``.
    """
    if not records:
        raise ValueError("run_single_turn needs at least one record")
    if mode not in BASELINE_MODES:
        raise ValueError(f"unknown baseline mode {mode!r}; expected one of {BASELINE_MODES}")
    if mode == "rag" and client is None:
        raise ValueError("the rag baseline needs a retrieval client")
    for r in records:
        check_record(r)
    passages: list[list[Passage]] | list[None] = [None] * len(records)
    retrieval_s = 0.0
    if mode == "rag":
        t0 = time.perf_counter()
        try:
            passages = client.retrieve([str(r["question"]) for r in records])
        except RetrievalFailed as err:
            error = f"{err.reason}: {err}"
            return [_failed(tokenizer, r, error, engine.policy_version) for r in records]
        retrieval_s = (time.perf_counter() - t0) / len(records)
    prompts = [prompt_ids(tokenizer, r, mode, p) for r, p in zip(records, passages, strict=True)]
    params = SamplingParams(
        max_new_tokens=cfg.max_new_tokens_per_turn, temperature=0.0, stop=BASELINE_STOP
    )
    t0 = time.perf_counter()
    results = engine.generate(prompts, params)
    generation_s = (time.perf_counter() - t0) / len(records)
    if len(results) != len(records):
        raise RuntimeError(f"engine returned {len(results)} results for {len(records)} prompts")
    return [
        _answered(tokenizer, r, prompt, result, mode, generation_s, retrieval_s, cfg, p)
        for r, prompt, result, p in zip(records, prompts, results, passages, strict=True)
    ]


def _answered(
    tokenizer,
    record: Mapping,
    prompt: list[int],
    result: GenerationResult,
    mode: str,
    generation_s: float,
    retrieval_s: float,
    cfg: RolloutConfig,
    passages: list[Passage] | None,
) -> Trajectory:
    text = tokenizer.decode(result.token_ids, skip_special_tokens=False)
    reward = compute_reward(text, record, cfg.answer_normalization)
    forms = compared_forms(reward.answer, record, cfg.answer_normalization)
    # rag: the harness searched with the question; its passages were in the prompt
    turn = (
        TurnTranscript(text)
        if passages is None
        else TurnTranscript(text, str(record["question"]), tuple((p.id, p.title) for p in passages))
    )
    n = len(result.token_ids)
    return Trajectory(
        prompt_ids=np.asarray(prompt, dtype=np.int64),
        response_ids=np.asarray(result.token_ids, dtype=np.int64),
        loss_mask=np.ones(n, dtype=np.int8),
        turn_ids=np.zeros(n, dtype=np.int32),
        behavior_logprobs=np.asarray(result.logprobs, dtype=np.float32),
        reward=reward.reward,
        success=reward.success,
        num_searches=1 if mode == "rag" else 0,
        num_turns=1,
        policy_version_min=result.policy_version,
        policy_version_max=result.policy_version,
        group_id=str(record["id"]),
        question_id=str(record["id"]),
        data_source=str(record["data_source"]),
        finish_reason=_FINISH_REASONS[result.finish_reason],
        malformed_reason=reward.malformed_reason,
        generation_s=generation_s,
        retrieval_s=retrieval_s,
        answer=reward.answer,
        extra={"mode": mode},
        transcript=Transcript(
            question=str(record["question"]),
            golden_answers=tuple(str(g) for g in record["golden_answers"]),
            turns=(turn,),
            scoring_method=forms.method,
            compared_prediction=forms.prediction,
            compared_golden=forms.golden,
        ),
    ).validate()


def _failed(tokenizer, record: Mapping, error: str, policy_version: int) -> Trajectory:
    """A RAG trajectory whose retrieval failed: no generation, scored 0, flagged (its
    ``prompt_ids`` are the question without passages: there were none to show)."""
    empty = np.zeros(0)
    return Trajectory(
        prompt_ids=np.asarray(prompt_ids(tokenizer, record, "closed_book"), dtype=np.int64),
        response_ids=empty.astype(np.int64),
        loss_mask=empty.astype(np.int8),
        turn_ids=empty.astype(np.int32),
        behavior_logprobs=empty.astype(np.float32),
        reward=0.0,
        success=False,
        num_searches=1,
        num_turns=0,
        policy_version_min=policy_version,
        policy_version_max=policy_version,
        group_id=str(record["id"]),
        question_id=str(record["id"]),
        data_source=str(record["data_source"]),
        finish_reason="retrieval_failed",
        retrieval_failed=True,
        extra={"mode": "rag", "retrieval_error": error},
    ).validate()
