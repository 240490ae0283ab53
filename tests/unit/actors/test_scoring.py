"""Scorers: normalisation, exact match over aliases, option-letter extraction, dispatch."""

from __future__ import annotations

import pytest

from actors.scoring import (
    compared_forms,
    exact_match,
    extract_option_letter,
    normalize_answer,
    option_letter_match,
    score_answer,
)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("Paris", "paris"),
        ("  The  Eiffel   Tower. ", "eiffel tower"),  # article, spaces, full stop
        ("an apple a day", "apple day"),  # both articles go
        ("Theatre", "theatre"),  # "the" inside a word stays
        ("Bogotá", "bogota"),  # NFKD: á -> a + combining acute, acute dropped
        ("São Tomé and Príncipe", "sao tome and principe"),
        ("Zürich", "zurich"),
        ("Côte d’Ivoire", "cote divoire"),  # typographic apostrophe is punctuation
        ("U.S.A.", "usa"),
        ("rock–paper", "rockpaper"),  # en dash (Unicode Pd) removed like "-"
        ("ﬁsh", "fish"),  # NFKD expands the fi ligature
        ("1,234", "1234"),
        ("the", ""),
    ],
)
def test_normalize_answer(raw: str, expected: str) -> None:
    assert normalize_answer(raw) == expected


def test_normalize_answer_rejects_non_string() -> None:
    with pytest.raises(TypeError, match="expects str"):
        normalize_answer(None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("prediction", "golden", "expected"),
    [
        ("paris", ["Paris"], True),
        ("The capital is Paris", ["Paris"], False),  # exact, not containment
        ("Bogota", ["Bogotá"], True),
        ("Ivory Coast", ["Côte d'Ivoire", "Ivory Coast"], True),  # any alias
        ("cote d'ivoire", ["Côte d’Ivoire"], True),  # straight vs curly apostrophe
        ("Mount Everest!", ["mount everest"], True),
        ("Everest", ["Mount Everest"], False),
        ("", ["Paris"], False),
        ("the", ["The"], False),  # normalises to empty: never a match
        (None, ["Paris"], False),  # no <answer> at all
        ("1,234", ["1234"], True),
    ],
)
def test_exact_match(prediction: str | None, golden: list[str], expected: bool) -> None:
    assert exact_match(prediction, golden) is expected


def test_exact_match_rejects_bare_string_and_empty_golden() -> None:
    # A bare string would otherwise be iterated char by char and "P" would match "Paris"[0].
    with pytest.raises(TypeError, match="list of strings"):
        exact_match("P", "Paris")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="empty"):
        exact_match("Paris", [])


OPTIONS = {
    "A": "Down syndrome",
    "B": "Marfan syndrome",
    "C": "C. difficile infection",
    "D": "Autosomal dominant",
}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("B", "B"),
        ("b", "B"),
        ("(B)", "B"),
        ("(b)", "B"),
        ("[D].", "D"),
        (" C. ", "C"),
        ("B. Marfan syndrome", "B"),
        ("b) marfan syndrome", "B"),
        ("(d) autosomal dominant", "D"),
        ("A: Down syndrome", "A"),
        ("The answer is B", "B"),
        ("The answer is B because of lens dislocation.", "B"),
        ("the answer is (c).", "C"),
        ("Answer: d", "D"),
        ("The correct option is A.", "A"),
        ("answer is a", "A"),  # lowercase letter at the end is a choice
        ("the answer is a rare disease", None),  # lowercase article, not option A
        ("B12 deficiency", None),  # letter inside a word
        ("I am not sure", None),
        ("E", None),  # only A-D exist
        ("", None),
        (None, None),
    ],
)
def test_extract_option_letter_without_options(text: str | None, expected: str | None) -> None:
    assert extract_option_letter(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("marfan syndrome", "B"),  # option text, case-insensitive
        ("Marfan Syndrome.", "B"),
        ("It is most likely Marfan syndrome", "B"),  # the only option text it contains
        ("C. difficile infection", "C"),  # option text that starts like "C."
        ("Down syndrome or Marfan syndrome", None),  # two options: ambiguous
        ("Ehlers-Danlos syndrome", None),  # not an option
        ("B", "B"),  # letters still work with options given
    ],
)
def test_extract_option_letter_from_option_text(text: str, expected: str | None) -> None:
    assert extract_option_letter(text, OPTIONS) == expected


def test_c_dot_without_options_reads_as_letter_c() -> None:
    # Without the options there is no way to know "C. difficile" is option text.
    assert extract_option_letter("C. difficile infection") == "C"


def test_option_letter_match() -> None:
    assert option_letter_match("(b)", ["B"])
    assert option_letter_match("The answer is B", ["b"])
    assert not option_letter_match("A", ["B"])
    assert not option_letter_match(None, ["B"])
    assert option_letter_match("marfan syndrome", ["B"], OPTIONS)
    assert not option_letter_match("marfan syndrome", ["B"])  # text needs the options


def _record(source: str, golden: list[str], **metadata: object) -> dict:
    return {
        "id": "q1",
        "question": "?",
        "golden_answers": golden,
        "data_source": source,
        "metadata": metadata,
    }


def test_score_answer_dispatches_by_data_source() -> None:
    assert score_answer("Bogota", _record("single_hop", ["Bogotá"]))
    assert score_answer("the Andes", _record("multi_hop", ["Andes"]))
    # "B" is an exact-match failure for free text ...
    assert not score_answer("B", _record("single_hop", ["Marfan syndrome"]))
    # ... and a letter match for multiple choice, also via the option text.
    mc = _record("medical_mc", ["B"], options=OPTIONS, answer_letter="B")
    assert score_answer("B", mc)
    assert score_answer("Marfan syndrome", mc)
    assert not score_answer("Down syndrome", mc)


def test_score_answer_any_data_source() -> None:
    # Search-R1's own sets, and any other name: exact match on golden_answers
    assert score_answer("the Eiffel tower", _record("nq", ["Eiffel Tower"]))
    assert not score_answer("Louvre", _record("hotpotqa", ["Eiffel Tower"]))
    assert score_answer("Bogota", _record("trivia", ["Bogotá"]))
    # options make any set multiple choice, with letters beyond D
    five = {"A": "one", "B": "two", "C": "three", "D": "four", "E": "five"}
    mc = _record("medqa", ["E"], options=five, answer_letter="E")
    assert score_answer("E", mc)
    assert score_answer("The answer is (e).", mc)
    assert score_answer("five", mc)
    assert not score_answer("D", mc)
    # without options, F is free text: an exact-match failure
    assert not score_answer("F", _record("medqa", ["E"]))


def test_score_answer_rejects_bad_records() -> None:
    with pytest.raises(ValueError, match="no 'golden_answers'"):
        score_answer("x", {"id": "q9", "data_source": "single_hop"})


@pytest.mark.parametrize(
    ("prediction", "record", "method", "compared"),
    [
        ("The Eiffel  Tower!", _record("nq", ["Eiffel tower", "la tour"]), "exact_match",
         ("eiffel tower", ("eiffel tower", "la tour"))),
        ("Louvre", _record("nq", ["Eiffel Tower"]), "exact_match", ("louvre", ("eiffel tower",))),
        (None, _record("nq", ["Paris"]), "exact_match", (None, ("paris",))),
        ("the", _record("nq", ["Paris"]), "exact_match", ("", ("paris",))),
        ("Marfan syndrome", _record("medical_mc", ["b"], options=OPTIONS), "option_letter",
         ("B", ("B",))),
        ("The answer is (c).", _record("medical_mc", ["B"], options=OPTIONS), "option_letter",
         ("C", ("B",))),
        ("no idea", _record("medical_mc", ["B"], options=OPTIONS), "option_letter",
         (None, ("B",))),
    ],
)  # fmt: skip
def test_compared_forms_are_what_score_answer_compares(prediction, record, method, compared):
    forms = compared_forms(prediction, record)
    assert (forms.method, (forms.prediction, forms.golden)) == (method, compared)
    # the identity the records rely on: correct iff the compared prediction is a golden form
    assert score_answer(prediction, record) == bool(forms.prediction in forms.golden and
                                                    forms.prediction)  # fmt: skip
