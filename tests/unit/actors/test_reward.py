"""Outcome reward: answer extraction, malformed reasons, exact match / option letter."""

from __future__ import annotations

import pytest

from actors.reward import MALFORMED_REASONS, compute_reward, count_malformed, extract_answer

QA = {"id": "q", "golden_answers": ["Lima", "Lima, Peru"], "data_source": "single_hop"}
MC = {
    "id": "m",
    "golden_answers": ["B"],
    "data_source": "medical_mc",
    "metadata": {
        "options": {"A": "Down syndrome", "B": "Marfan syndrome", "C": "Rett", "D": "Fragile X"}
    },
}


@pytest.mark.parametrize(
    ("text", "answer", "reason"),
    [
        ("<think>x</think><answer> Lima </answer>", "Lima", None),
        ("<answer>\nLima\n</answer>", "Lima", None),
        ("I think it is Lima.", None, "no_answer"),
        ("<answer> Lima", None, "unclosed_answer"),
        ("<answer>Lima</answer> <answer>Cusco</answer>", None, "multiple_answers"),
        ("<answer>   </answer>", None, "empty_answer"),
        # information text is not part of policy_text; a search alone has no answer
        ("<search>capital of peru</search>", None, "no_answer"),
    ],
)
def test_extract_answer(text, answer, reason):
    got = extract_answer(text)
    assert (got.answer, got.malformed_reason) == (answer, reason)


def test_exact_match_reward_uses_any_alias_after_normalisation():
    assert compute_reward("<answer>the lima!</answer>", QA).reward == 1.0  # "the" and "!" dropped
    assert compute_reward("<answer>lima, peru</answer>", QA).success is True
    wrong = compute_reward("<answer>Cusco</answer>", QA)
    assert (wrong.reward, wrong.success, wrong.answer, wrong.malformed_reason) == (
        0.0,
        False,
        "Cusco",
        None,
    )


def test_option_letter_reward():
    assert compute_reward("<answer> B </answer>", MC).reward == 1.0
    assert compute_reward("<answer>The answer is (b).</answer>", MC).reward == 1.0
    assert compute_reward("<answer>Marfan syndrome</answer>", MC).reward == 1.0  # option text
    assert compute_reward("<answer>A</answer>", MC).reward == 0.0


def test_malformed_scores_zero_even_if_the_text_contains_the_answer():
    result = compute_reward("Lima <answer>", QA)
    assert (result.reward, result.success, result.malformed_reason) == (
        0.0,
        False,
        "unclosed_answer",
    )


def test_broken_record_raises_instead_of_scoring_zero():
    # any data_source is scored (nq: exact match); a record with nothing to match raises
    with pytest.raises(ValueError, match="golden_answers is empty"):
        compute_reward("no answer here", {"id": "x", "golden_answers": [], "data_source": "nq"})
    with pytest.raises(ValueError, match="golden_answers"):
        compute_reward("no answer here", {"id": "x", "data_source": "nq"})


def test_count_malformed_lists_every_reason():
    counts = count_malformed(["no_answer", None, "no_answer", "empty_answer"])
    assert counts == {
        "no_answer": 2,
        "unclosed_answer": 0,
        "multiple_answers": 0,
        "empty_answer": 1,
    }
    assert set(counts) == set(MALFORMED_REASONS)
