"""The two answer normalisations: ``strict`` agrees with Search-R1's own ``normalize_answer``
(written out below as the reference), ``folded`` (the default) differs from it only on
non-ASCII text, and ``rollout.answer_normalization`` reaches the reward of rollouts and of
the one-turn baselines that evaluation runs."""

from __future__ import annotations

import re
import string

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError
from rollout_fakes import TableRetriever
from scripted_engine import ScriptedEngine

from actors.baselines import run_single_turn
from actors.config import RolloutConfig
from actors.reward import compute_reward
from actors.rollout import run_rollout
from actors.scoring import (
    ANSWER_NORMALIZATIONS,
    exact_match,
    normalize_answer,
    normalize_answer_strict,
    normalizer,
    score_answer,
)


def search_r1_normalize_answer(s: str) -> str:
    """Search-R1 ``search_r1/utils/reward_score/qa_em.py`` ``normalize_answer``, verbatim
    in substance (the SQuAD v1.1 evaluation script)."""

    def remove_articles(text):
        return re.sub(r"\b(a|an|the)\b", " ", text)

    def white_space_fix(text):
        return " ".join(text.split())

    def remove_punc(text):
        exclude = set(string.punctuation)
        return "".join(ch for ch in text if ch not in exclude)

    def lower(text):
        return text.lower()

    return white_space_fix(remove_articles(remove_punc(lower(s))))


def search_r1_em_check(prediction: str, golden_answers: list[str]) -> bool:
    """Search-R1 ``em_check``: any golden answer equal after normalisation."""
    pred = search_r1_normalize_answer(prediction)
    return any(search_r1_normalize_answer(g) == pred for g in golden_answers)


# (prediction, golden alias, strict verdict, folded verdict)
CASES = [
    ("Bogota", "Bogotá", False, True),  # diacritic: Search-R1 rejects, folding accepts
    ("Bogotá", "Bogotá", True, True),
    ("São Tomé", "Sao Tome", False, True),
    ("Zürich", "ZÜRICH", True, True),  # str.lower() handles non-ASCII letters in both
    ("“Hamlet”", "Hamlet", False, True),  # curly quotes are not in string.punctuation
    ('"Hamlet"', "Hamlet", True, True),  # straight quotes are
    ("1914–1918", "1914-1918", False, True),  # en dash kept by strict, ASCII hyphen dropped
    ("Côte d’Ivoire", "Cote d'Ivoire", False, True),  # curly apostrophe and ô
    ("«Les Misérables»", "Les Misérables", False, True),  # guillemets
    ("ﬁsh", "fish", False, True),  # ligature: only NFKD expands it
    ("The Eiffel  Tower!", "eiffel tower", True, True),  # ASCII: the two agree
    ("an apple", "Apple", True, True),
    ("Paris", "Lyon", False, False),
]


@pytest.mark.parametrize(("prediction", "golden", "strict", "folded"), CASES)
def test_strict_agrees_with_search_r1(prediction, golden, strict, folded) -> None:
    for text in (prediction, golden):
        assert normalize_answer_strict(text) == search_r1_normalize_answer(text)
    assert search_r1_em_check(prediction, [golden]) is strict
    assert exact_match(prediction, [golden], "strict") is strict
    assert exact_match(prediction, [golden], "folded") is folded
    assert exact_match(prediction, [golden]) is folded  # the default is folded


def test_strict_normalisation_by_hand() -> None:
    # lower -> drop ASCII punctuation -> drop articles -> collapse whitespace; nothing else
    assert normalize_answer_strict("  The Río-Grande!") == "ríogrande"
    assert normalize_answer_strict("Côte d’Ivoire") == "côte d’ivoire"
    assert normalize_answer_strict("A “tale” of two cities.") == "“tale” of two cities"
    with pytest.raises(TypeError, match="expects str"):
        normalize_answer_strict(None)  # type: ignore[arg-type]


@given(st.text(max_size=40))
def test_strict_equals_search_r1_on_any_text(text: str) -> None:
    assert normalize_answer_strict(text) == search_r1_normalize_answer(text)


@given(st.text(alphabet=st.characters(max_codepoint=127), max_size=40))
def test_folded_equals_strict_on_ascii(text: str) -> None:
    assert normalize_answer(text) == normalize_answer_strict(text)


def test_normalizer_names() -> None:
    assert ANSWER_NORMALIZATIONS == ("folded", "strict")
    assert normalizer("folded") is normalize_answer
    assert normalizer("strict") is normalize_answer_strict
    with pytest.raises(ValueError, match="unknown answer normalization 'ascii'"):
        normalizer("ascii")  # type: ignore[arg-type]
    mc = {"id": "m", "golden_answers": ["B"], "data_source": "medical_mc"}
    with pytest.raises(ValueError, match="unknown answer normalization"):
        score_answer("B", mc, "ascii")  # type: ignore[arg-type]


def test_reward_and_config_take_the_mode() -> None:
    qa = {"id": "q", "golden_answers": ["Bogotá"], "data_source": "single_hop"}
    assert compute_reward("<answer>Bogota</answer>", qa).reward == 1.0
    assert compute_reward("<answer>Bogota</answer>", qa, "strict").reward == 0.0
    assert compute_reward("<answer>Bogotá</answer>", qa, "strict").reward == 1.0
    # multiple choice is scored by letter in both modes
    mc = {"id": "m", "golden_answers": ["B"], "data_source": "medical_mc"}
    assert compute_reward("<answer>(b)</answer>", mc, "strict").reward == 1.0
    assert RolloutConfig().answer_normalization == "folded"
    with pytest.raises(ValidationError, match="answer_normalization"):
        RolloutConfig(answer_normalization="ascii")


BOGOTA_Q = {
    "id": "q-col",
    "question": "What is the capital of Colombia?",
    "golden_answers": ["Bogotá"],
    "data_source": "single_hop",
}


@pytest.mark.parametrize(("mode", "success"), [("folded", True), ("strict", False)])
def test_rollout_and_baseline_rewards_use_the_config(tok, mode, success) -> None:
    cfg = RolloutConfig(answer_normalization=mode, max_new_tokens_per_turn=32)
    engine = ScriptedEngine(tok, {BOGOTA_Q["question"]: ["<answer> Bogota </answer>"]})
    (traj,), _ = run_rollout(engine, tok, TableRetriever({}), [BOGOTA_Q], ["g"], cfg)
    assert (traj.answer, traj.success, traj.reward) == ("Bogota", success, float(success))
    engine = ScriptedEngine(tok, {BOGOTA_Q["question"]: ["<answer> Bogota </answer>"]})
    (base,) = run_single_turn(engine, tok, [BOGOTA_Q], "closed_book", cfg)
    assert (base.answer, base.success) == ("Bogota", success)
