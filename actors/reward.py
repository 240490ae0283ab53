"""Outcome reward of a finished episode (Search-R1 / ST-PPO: exact match, 0 if malformed).

The answer is the content of the single ``<answer>...</answer>`` pair in the policy's own
text (information blocks are not searched). Scoring uses :mod:`actors.scoring`: exact match
of the normalised answer against any golden alias (``single_hop``, ``multi_hop``; ``folded``
or Search-R1's ``strict`` normalisation, ``rollout.answer_normalization``), option letter
(``medical_mc``). A malformed output scores 0 and names its reason:

- ``no_answer``: no ``<answer>`` tag at all (ran out of turns or tokens, or stopped);
- ``unclosed_answer``: ``<answer>`` opened but never closed (token budget hit);
- ``multiple_answers``: more than one ``<answer>...</answer>`` pair;
- ``empty_answer``: the pair holds only whitespace.

Example::

    >>> compute_reward("<think>..</think><answer> Paris </answer>",
    ...                {"golden_answers": ["Paris"], "data_source": "single_hop"}).reward
    1.0
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from actors.scoring import AnswerNormalization, score_answer

MALFORMED_REASONS = ("no_answer", "unclosed_answer", "multiple_answers", "empty_answer")
"""Every value :func:`extract_answer` may give as ``malformed_reason``."""

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


@dataclass(frozen=True)
class ExtractedAnswer:
    """Result of parsing the policy text.

    Attributes:
        answer: Stripped content of the single answer pair, or None when malformed.
        malformed_reason: One of :data:`MALFORMED_REASONS`, or None when well-formed.
    """

    answer: str | None
    malformed_reason: str | None


@dataclass(frozen=True)
class RewardResult:
    """Reward of one episode.

    Attributes:
        reward: 1.0 when correct, else 0.0 (also 0.0 when malformed).
        success: The answer was correct.
        answer: The extracted answer (None when malformed).
        malformed_reason: As :class:`ExtractedAnswer`.
    """

    reward: float
    success: bool
    answer: str | None
    malformed_reason: str | None


def extract_answer(policy_text: str) -> ExtractedAnswer:
    """Parse the answer out of the policy-generated text (all turns, joined)."""
    matches = _ANSWER.findall(policy_text)
    if not matches:
        reason = "unclosed_answer" if "<answer>" in policy_text else "no_answer"
        return ExtractedAnswer(None, reason)
    if len(matches) > 1:
        return ExtractedAnswer(None, "multiple_answers")
    answer = matches[0].strip()
    if not answer:
        return ExtractedAnswer(None, "empty_answer")
    return ExtractedAnswer(answer, None)


def compute_reward(
    policy_text: str, record: Mapping, normalization: AnswerNormalization = "folded"
) -> RewardResult:
    """Score an episode's policy text against its QA record.

    Args:
        policy_text: Decoded policy turns (no information blocks).
        record: QA record with ``golden_answers`` and ``data_source`` (and, for
            ``medical_mc``, ``metadata.options``).
        normalization: Free-text answer normalisation, ``folded`` (default) or ``strict``
            (Search-R1's); see :mod:`actors.scoring`.

    Raises:
        ValueError: the record lacks ``golden_answers``, or an unknown ``normalization``
            (from :func:`actors.scoring.score_answer`).
    """
    parsed = extract_answer(policy_text)
    if parsed.answer is None:
        # still validate the record so a broken record is not silently scored 0
        score_answer(None, record, normalization)
        return RewardResult(0.0, False, None, parsed.malformed_reason)
    success = score_answer(parsed.answer, record, normalization)
    return RewardResult(1.0 if success else 0.0, success, parsed.answer, None)


def count_malformed(reasons: Iterable[str | None]) -> dict[str, int]:
    """Count malformed reasons (None = well-formed, skipped); every known reason is present.

    Example: ``count_malformed(["no_answer", None, "no_answer"])["no_answer"] == 2``.
    """
    counts = Counter(r for r in reasons if r is not None)
    return {reason: counts.get(reason, 0) for reason in MALFORMED_REASONS} | dict(counts)
