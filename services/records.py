"""What the agent did, question by question: evaluation records and trained samples.

Two JSON Lines files in the run directory, one record per line:

- ``eval_samples.jsonl``: one record per question per evaluation (``stppo train`` writes
  the ``before_warm_start``, ``start`` and ``end`` evaluations; ``stppo eval`` writes
  ``eval_<split>_samples.jsonl`` beside its JSON report). Recounting ``correct`` and
  ``malformed`` over one evaluation's records gives the success and malformed rates of
  its ``eval.jsonl`` line (:func:`recount`).
- ``samples.jsonl``: ``run.samples_per_step`` trajectories of each learner step's batch,
  with what the learner saw: reward, staleness, the advantage and the behaviour log-prob
  per turn.

Fields of every record (:func:`trajectory_record`):

| field | meaning |
|---|---|
| ``kind`` | ``eval`` or ``train`` |
| ``tag``, ``learner_step``, ``mode`` | the evaluation (``eval``); ``step`` (``train``) |
| ``question_id``, ``data_source``, ``question``, ``golden_answers`` | the question |
| ``turns`` | per policy turn: ``text``, ``tokens``, ``search_query`` (``""``: an empty ``<search>``; null: no search), ``passages`` (``id``, ``title``) |
| ``answer`` | the extracted ``<answer>`` (null when malformed) |
| ``scoring`` | ``method`` (``exact_match`` / ``option_letter``), the compared ``prediction`` and ``golden`` forms |
| ``correct``, ``malformed``, ``malformed_reason`` | the verdict, and why an answer was malformed |
| ``finish_reason``, ``retrieval_failed``, ``retrieval_error`` | how the episode ended |
| ``num_searches``, ``num_turns``, ``tokens`` | ``tokens``: ``prompt``, ``response``, ``policy`` |
| ``policy_version_min``, ``policy_version_max`` | the weights that wrote it |
| ``text_cap_chars``, ``truncated`` | the per-text cap and the texts it cut (``question``, ``turns[1].text`` ...) |

``train`` records add ``trajectory_id``, ``group_id``, ``reward``, ``staleness``, and per
turn ``advantage`` and ``behavior_logprob`` (``mean``, ``min``, ``max`` over its tokens).

Size: every text (question, turn text, search query, answer, compared prediction) is cut
to ``run.record_text_chars`` characters; titles and ids are the corpus's own.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from actors.trajectory import per_turn_summary

EVAL_RECORDS = "eval_samples.jsonl"
"""Per-question evaluation records of a training run (in its run directory)."""

TRAIN_SAMPLES = "samples.jsonl"
"""Per-step samples of trained trajectories (in the run directory)."""


class _Capper:
    """Cuts texts to ``cap`` characters and remembers which field paths it cut."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.truncated: list[str] = []

    def __call__(self, text: str | None, path: str) -> str | None:
        if text is None or len(text) <= self.cap:
            return text
        self.truncated.append(path)
        return text[: self.cap]


def _finite(x: float) -> float | None:
    return float(x) if math.isfinite(float(x)) else None


def _summary(s: Any) -> dict[str, float | None]:
    """A :class:`actors.trajectory.TurnSummary` (or its dict form) with NaN as null."""
    get = s.get if isinstance(s, Mapping) else lambda k: getattr(s, k)
    return {k: _finite(get(k)) for k in ("mean", "min", "max")}


def trajectory_record(trajectory: Any, text_cap_chars: int) -> dict[str, Any]:
    """The record fields of one trajectory (module docstring), texts capped.

    Args:
        trajectory: an :class:`actors.trajectory.Trajectory`; without a transcript (a
            ``rag`` trajectory whose retrieval failed) the question fields are null and
            ``turns`` is empty.
        text_cap_chars: the most characters kept of each text.

    Returns:
        A JSON-able dict.
    """
    t = trajectory
    cap = _Capper(text_cap_chars)
    tr = t.transcript
    question = cap(tr.question, "question") if tr is not None else None
    policy = t.turn_ids[t.turn_ids >= 0]
    tokens_per_turn = np.bincount(policy, minlength=t.num_turns).tolist() if t.num_turns else []
    turns = []
    for k, turn in enumerate(tr.turns if tr is not None else ()):
        turns.append(
            {
                "text": cap(turn.text, f"turns[{k}].text"),
                "tokens": int(tokens_per_turn[k]) if k < len(tokens_per_turn) else 0,
                "search_query": cap(turn.search_query, f"turns[{k}].search_query"),
                "passages": [{"id": pid, "title": title} for pid, title in turn.passages],
            }
        )
    record = {
        "question_id": t.question_id,
        "data_source": t.data_source,
        "question": question,
        "golden_answers": list(tr.golden_answers) if tr is not None else None,
        "turns": turns,
        "answer": cap(t.answer, "answer"),
        "scoring": None
        if tr is None
        else {
            "method": tr.scoring_method,
            "prediction": cap(tr.compared_prediction, "scoring.prediction"),
            "golden": list(tr.compared_golden),
        },
        "correct": bool(t.success),
        "malformed": t.malformed_reason is not None,
        "malformed_reason": t.malformed_reason,
        "finish_reason": t.finish_reason,
        "retrieval_failed": bool(t.retrieval_failed),
        "retrieval_error": t.extra.get("retrieval_error"),
        "num_searches": int(t.num_searches),
        "num_turns": int(t.num_turns),
        "tokens": {
            "prompt": int(t.prompt_ids.shape[0]),
            "response": t.num_response_tokens,
            "policy": t.num_policy_tokens,
        },
        "policy_version_min": int(t.policy_version_min),
        "policy_version_max": int(t.policy_version_max),
        "text_cap_chars": text_cap_chars,
    }
    record["truncated"] = cap.truncated
    return record


def eval_records(
    trajectories: Sequence[Any],
    tag: str,
    learner_step: int,
    text_cap_chars: int,
    mode: str = "agent",
) -> list[dict[str, Any]]:
    """One ``eval`` record per evaluated trajectory (one per question), in order.

    Args:
        trajectories: one greedy trajectory per question.
        tag: the evaluation (``start``, ``step_<N>``, ``end`` ... or ``eval_<split>`` for
            ``stppo eval``).
        learner_step: learner steps done when it ran.
        text_cap_chars: see :func:`trajectory_record`.
        mode: ``agent``, ``closed_book`` or ``rag``.
    """
    head = {"kind": "eval", "tag": tag, "learner_step": int(learner_step), "mode": mode}
    return [head | trajectory_record(t, text_cap_chars) for t in trajectories]


def choose_samples(num: int, k: int, seed: int, step: int) -> list[int]:
    """``min(k, num)`` distinct indices of ``range(num)``, sorted, drawn with a generator
    seeded by ``(seed, step)`` so that a rerun picks the same ones."""
    return sorted(random.Random(seed * 1_000_003 + step).sample(range(num), min(k, num)))


def sample_records(
    trajectories: Sequence[Any],
    staleness: Sequence[int],
    turn_advantages: Sequence[Sequence[Any] | None],
    step: int,
    k: int,
    seed: int,
    text_cap_chars: int,
) -> list[dict[str, Any]]:
    """``train`` records of up to ``k`` trajectories the learner trained on at ``step``.

    Args:
        trajectories: the step's batch, as taken from the buffer.
        staleness: learner steps of staleness per trajectory, same order.
        turn_advantages: per trajectory, the per-turn advantage summaries the learner
            returned (``StepMetrics.turn_advantages``); None for one it excluded (never
            sampled). Empty = not reported: every trajectory may be sampled, without
            advantages.
        step: the learner step (after it: ``1`` for the first).
        k: how many to sample (``run.samples_per_step``).
        seed: the run's seed (:func:`choose_samples`).
        text_cap_chars: see :func:`trajectory_record`.

    Raises:
        ValueError: ``staleness`` or a non-empty ``turn_advantages`` does not match the batch.
    """
    n = len(trajectories)
    if len(staleness) != n or (turn_advantages and len(turn_advantages) != n):
        raise ValueError(
            f"{n} trajectories, {len(staleness)} staleness values, "
            f"{len(turn_advantages)} advantage lists"
        )
    trained = [i for i in range(n) if not turn_advantages or turn_advantages[i] is not None]
    out = []
    for j in choose_samples(len(trained), k, seed, step):
        i = trained[j]
        t = trajectories[i]
        record = {"kind": "train", "step": int(step)}
        record |= trajectory_record(t, text_cap_chars)
        record.update(
            trajectory_id=t.extra.get("trajectory_id"),
            group_id=t.group_id,
            reward=float(t.reward),
            staleness=int(staleness[i]),
        )
        logprobs = per_turn_summary(t.behavior_logprobs, t.turn_ids)
        advantages = turn_advantages[i] if turn_advantages else None
        for turn_index, turn in enumerate(record["turns"]):
            turn["behavior_logprob"] = _summary(logprobs[turn_index])
            turn["advantage"] = _summary(advantages[turn_index]) if advantages else None
        out.append(record)
    return out


def append_records(path: Path, records: Iterable[Mapping[str, Any]]) -> int:
    """Append ``records`` to the JSON Lines file ``path``; returns how many."""
    lines = [json.dumps(r, ensure_ascii=False, allow_nan=False) + "\n" for r in records]
    with path.open("a", encoding="utf-8") as f:
        f.writelines(lines)
    return len(lines)


def read_records(path: Path) -> list[dict[str, Any]]:
    """Every record of a JSON Lines file.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: a line is not JSON (names the file and line).
    """
    out = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not a JSON record ({e})") from e
    return out


def evaluation_key(record: Mapping[str, Any]) -> tuple[Any, ...]:
    """What identifies one evaluation: ``(tag, learner_step)`` (``train``: ``step``)."""
    if record.get("kind") == "train":
        return ("train", record.get("step"))
    return (record.get("tag"), record.get("learner_step"))


def latest_evaluation(records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The records of the last evaluation in the file (those sharing the last record's
    :func:`evaluation_key`), in file order; empty for no records."""
    if not records:
        return []
    key = evaluation_key(records[-1])
    return [r for r in records if evaluation_key(r) == key]


def recount(records: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Success and malformed rates recounted from records, overall and per data source:
    ``success_rate``, ``malformed_rate``, ``num_questions``, ``success_rate/<source>``
    (the keys of :func:`services.evaluate.summarize_eval`).

    Raises:
        ValueError: no records.
    """
    if not records:
        raise ValueError("no records to recount")
    n = len(records)
    out: dict[str, float] = {
        "num_questions": n,
        "success_rate": sum(bool(r["correct"]) for r in records) / n,
        "malformed_rate": sum(bool(r["malformed"]) for r in records) / n,
        "searches_mean": sum(r["num_searches"] for r in records) / n,
    }
    for source in sorted({r["data_source"] for r in records}):
        group = [r for r in records if r["data_source"] == source]
        out[f"success_rate/{source}"] = sum(bool(r["correct"]) for r in group) / len(group)
    return out


def summary_row(record: Mapping[str, Any]) -> dict[str, str | int | float | bool]:
    """The one-line view of a record (tracker tables, ``stppo show``), with fixed types:
    strings (empty for null), ints, floats and bools."""

    def text(value: Any) -> str:
        if value is None:
            return ""
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)

    row: dict[str, str | int | float | bool] = {
        "question_id": text(record.get("question_id")),
        "data_source": text(record.get("data_source")),
        "correct": bool(record.get("correct")),
        "malformed_reason": text(record.get("malformed_reason")),
        "num_searches": int(record.get("num_searches") or 0),
        "answer": text(record.get("answer")),
        "golden_answers": text(record.get("golden_answers")),
        "question": text(record.get("question")),
    }
    if record.get("kind") == "train":
        row["reward"] = float(record.get("reward") or 0.0)
        row["staleness"] = int(record.get("staleness") or 0)
    return row
