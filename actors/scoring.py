"""Answer scoring for rewards and evaluation (Search-R1 conventions).

- Free-text answers (any ``data_source``: ``single_hop``, ``nq``, ``hotpotqa`` ...): exact match
  of the normalised answer against ANY of the golden aliases, with one of two normalisations
  (:data:`ANSWER_NORMALIZATIONS`, config ``rollout.answer_normalization``):

  - ``folded`` (the default): NFKD-fold diacritics, lower case, drop ASCII and Unicode
    punctuation, drop the articles a/an/the, collapse whitespace. "Bogotá" == "Bogota" and
    "Côte d’Ivoire" == "Cote d'Ivoire": a right answer is not scored 0 for an accent or a
    typographic apostrophe that the golden alias and the model spell differently.
  - ``strict``: Search-R1's own ``normalize_answer`` (the SQuAD v1.1 evaluation script, as
    reused by Search-R1 ``search_r1/utils/reward_score/qa_em.py``): lower case, drop
    ``string.punctuation`` (ASCII only), drop the articles, collapse whitespace. No folding:
    "Bogotá" != "Bogota", and "’" or "–" stay in the text. Success rates in this mode are
    comparable with published Search-R1 numbers; ``folded`` ones are not strictly (the two
    modes agree whenever answer and alias are ASCII).

- Multiple choice (records with ``metadata["options"]``, and ``medical_mc``): the option letter is extracted from the answer text
  ("B", "(B)", "B. text", "The answer is B", "b)", or the text of one option) and compared
  with the golden letter. Option texts are always compared ``folded``.

Example::

    >>> exact_match("The Eiffel  Tower!", ["Eiffel Tower"])
    True
    >>> exact_match("Bogota", ["Bogotá"]), exact_match("Bogota", ["Bogotá"], "strict")
    (True, False)
    >>> extract_option_letter("The answer is (c).")
    'C'
"""

from __future__ import annotations

import functools
import re
import string
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

DATA_SOURCES_EXACT_MATCH = ("single_hop", "multi_hop")
DATA_SOURCES_MULTIPLE_CHOICE = ("medical_mc",)
OPTION_LETTERS = ("A", "B", "C", "D")

AnswerNormalization = Literal["folded", "strict"]
"""How free-text answers are normalised before exact match (see the module docstring)."""

ANSWER_NORMALIZATIONS: tuple[str, ...] = get_args(AnswerNormalization)
"""Every :data:`AnswerNormalization` value: ``("folded", "strict")``."""

_ARTICLES = re.compile(r"\b(a|an|the)\b")
# ASCII punctuation. The folded normalisation also drops Unicode punctuation (category P*:
# "–", "’", "«"); the strict one, like Search-R1, only this set.
_PUNCT = frozenset(string.punctuation)
_PHRASE = r"(?:answer|option|choice)\s*(?:is|:|=|-)?\s*(?:option\s+|choice\s+)?"


@functools.lru_cache(maxsize=32)
def _letter_patterns(last: str) -> tuple[re.Pattern[str], ...]:
    """The four letter patterns for options ``A``..``last`` (upper case), in precedence order."""
    upper = f"A-{last}"
    letters = f"{upper}{upper.lower()}"
    return (
        # The whole answer is one letter, optionally bracketed/punctuated: "B", "(b)", "[C].".
        re.compile(rf"^\W*([{letters}])\W*$"),
        # Leading letter with a delimiter, then the option text: "B. Marfan", "(c) x", "d: x".
        re.compile(rf"^\s*(?:\(([{letters}])\)|\[([{letters}])\]|([{letters}])\s*[.):])(?:\s|$)"),
        # "The answer is B", "answer: (b)", "Option C", "correct choice is d."
        # Upper-case letter: a word boundary suffices. Lower-case letter: must be bracketed or
        # followed by punctuation/end, so "the answer is a disease" does not read as option A.
        re.compile(rf"(?i:{_PHRASE})\(?([{upper}])\b"),
        re.compile(rf"(?i:{_PHRASE})(?:\(([{letters}])\)|([{letters}])(?=\s*[.)!,;:]|\s*$))"),
    )


def normalize_answer(s: str) -> str:
    """Normalise an answer for exact match (the ``folded`` normalisation, the default).

    Steps: NFKD decomposition dropping combining marks (diacritics), lower case, remove
    punctuation (ASCII and Unicode category P*), remove the articles a/an/the, collapse
    whitespace.

    Args:
        s: answer text.

    Returns:
        The normalised string (may be empty if ``s`` was only punctuation/articles).

    Raises:
        TypeError: ``s`` is not a ``str``.

    Example::

        >>> normalize_answer("  The Río-Grande!")
        'riogrande'
    """
    if not isinstance(s, str):
        raise TypeError(f"normalize_answer expects str, got {type(s).__name__}")
    folded = "".join(
        c for c in unicodedata.normalize("NFKD", s) if not unicodedata.combining(c)
    ).lower()
    no_punct = "".join(
        c for c in folded if c not in _PUNCT and not unicodedata.category(c).startswith("P")
    )
    return " ".join(_ARTICLES.sub(" ", no_punct).split())


def normalize_answer_strict(s: str) -> str:
    """Normalise an answer exactly as Search-R1 does (the ``strict`` normalisation).

    Steps, in Search-R1's order: lower case, remove ``string.punctuation`` (ASCII only),
    remove the articles a/an/the, collapse whitespace. Diacritics and Unicode punctuation
    are kept. Source: ``normalize_answer`` in Search-R1
    ``search_r1/utils/reward_score/qa_em.py`` (the SQuAD v1.1 evaluation script).

    Args:
        s: answer text.

    Returns:
        The normalised string (may be empty).

    Raises:
        TypeError: ``s`` is not a ``str``.

    Example::

        >>> normalize_answer_strict("  The Río-Grande!")
        'ríogrande'
        >>> normalize_answer_strict("Côte d’Ivoire")
        'côte d’ivoire'
    """
    if not isinstance(s, str):
        raise TypeError(f"normalize_answer_strict expects str, got {type(s).__name__}")
    no_punct = "".join(c for c in s.lower() if c not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", no_punct).split())


def normalizer(normalization: AnswerNormalization = "folded") -> Callable[[str], str]:
    """The normalising function of ``normalization``: :func:`normalize_answer` (``folded``)
    or :func:`normalize_answer_strict` (``strict``).

    Raises:
        ValueError: ``normalization`` is not one of :data:`ANSWER_NORMALIZATIONS`.
    """
    if normalization == "folded":
        return normalize_answer
    if normalization == "strict":
        return normalize_answer_strict
    raise ValueError(
        f"unknown answer normalization {normalization!r}; expected one of {ANSWER_NORMALIZATIONS}"
    )


def _check_golden(golden_answers: Sequence[str]) -> None:
    if isinstance(golden_answers, str):
        raise TypeError(
            f"golden_answers must be a list of strings, got the string {golden_answers!r}"
        )
    if len(golden_answers) == 0:
        raise ValueError("golden_answers is empty: nothing to match against")


def exact_match(
    prediction: str | None,
    golden_answers: Sequence[str],
    normalization: AnswerNormalization = "folded",
) -> bool:
    """True when the normalised prediction equals the normalised form of any alias.

    A prediction that normalises to the empty string never matches (Search-R1's ``em_check``
    would match it with an alias that also normalises to empty, such as "The").

    Args:
        prediction: the model's answer text (content of ``<answer>``); ``None`` (no answer)
            scores False.
        golden_answers: accepted aliases (non-empty list of strings).
        normalization: ``folded`` (:func:`normalize_answer`) or ``strict`` (Search-R1's,
            :func:`normalize_answer_strict`).

    Raises:
        TypeError: ``golden_answers`` is a bare string (a common bug: it would match chars).
        ValueError: ``golden_answers`` is empty, or an unknown ``normalization``.

    Example::

        >>> exact_match("paris", ["Paris", "Paris, France"])
        True
    """
    _check_golden(golden_answers)
    normalize = normalizer(normalization)
    if prediction is None:
        return False
    pred = normalize(prediction)
    if not pred:
        return False
    return any(pred == normalize(g) for g in golden_answers)


def _first_group(match: re.Match[str] | None) -> str | None:
    if match is None:
        return None
    return next(g for g in match.groups() if g is not None).upper()


def _normalized_options(options: Mapping[str, str]) -> dict[str, str]:
    return {letter.strip().upper(): normalize_answer(opt) for letter, opt in options.items()}


def _letter_equal_option_text(text: str, options: Mapping[str, str]) -> str | None:
    """The single letter whose normalised option text equals the normalised answer."""
    pred = normalize_answer(text)
    equal = [k for k, opt in _normalized_options(options).items() if pred and opt == pred]
    return equal[0] if len(equal) == 1 else None


def _letter_containing_option_text(text: str, options: Mapping[str, str]) -> str | None:
    """The letter of the only option whose normalised text occurs (as whole words) in the
    answer; ``None`` when zero or several do."""
    pred = f" {normalize_answer(text)} "
    found = [k for k, opt in _normalized_options(options).items() if opt and f" {opt} " in pred]
    return found[0] if len(found) == 1 else None


def extract_option_letter(text: str | None, options: Mapping[str, str] | None = None) -> str | None:
    """Extract the chosen option letter (A-D, or up to the last letter of ``options``).

    Accepted forms, in order of precedence: the bare letter ("B", "(b)", "C."); a leading
    letter with a delimiter ("B. Marfan syndrome", "(c) ...", "d) ..."); a phrase ("The
    answer is B", "answer: (b)", "option C"); the text of exactly one option (needs
    ``options``). A lower-case letter is only read when bracketed or punctuated, so "the
    answer is a rare disease" does not become option A.

    Args:
        text: answer text; ``None`` gives ``None``.
        options: letter -> option text, to recognise an answer given as the option text.

    Returns:
        An upper-case letter (``OPTION_LETTERS``, or one of the keys of ``options``), or
        ``None`` when no unambiguous choice is found.

    Example::

        >>> extract_option_letter("The answer is B because ...")
        'B'
        >>> extract_option_letter("marfan syndrome", {"A": "Down syndrome", "B": "Marfan syndrome"})
        'B'
    """
    if text is None:
        return None
    last = "D"
    if options:
        keys = [k.strip().upper() for k in options]
        if all(len(k) == 1 and k in string.ascii_uppercase for k in keys):
            last = max(keys)
    only_letter, leading_letter, phrase_upper, phrase_any = _letter_patterns(last)
    letter = _first_group(only_letter.match(text))
    if letter is None and options:
        # Before the letter patterns: an option text such as "C. difficile infection"
        # starts like "C." but is option text, not the letter C.
        letter = _letter_equal_option_text(text, options)
    if letter is None:
        letter = _first_group(leading_letter.match(text))
    if letter is None:
        letter = _first_group(phrase_upper.search(text)) or _first_group(phrase_any.search(text))
    if letter is None and options:
        letter = _letter_containing_option_text(text, options)
    return letter


def option_letter_match(
    prediction: str | None,
    golden_answers: Sequence[str],
    options: Mapping[str, str] | None = None,
) -> bool:
    """True when the option letter extracted from ``prediction`` is a golden letter.

    Args:
        prediction: the model's answer text; ``None`` scores False.
        golden_answers: golden letters, e.g. ``["B"]`` (case-insensitive).
        options: letter -> option text (lets an answer given as option text score).

    Raises:
        TypeError / ValueError: as :func:`exact_match` for bad ``golden_answers``.
    """
    _check_golden(golden_answers)
    letter = extract_option_letter(prediction, options)
    return letter is not None and letter in {g.strip().upper() for g in golden_answers}


def is_multiple_choice(record: Mapping) -> bool:
    """True when ``record`` is scored by option letter: it has ``metadata["options"]``, or
    its ``data_source`` is a built-in multiple-choice set (``medical_mc``)."""
    return (
        bool((record.get("metadata") or {}).get("options"))
        or record.get("data_source") in DATA_SOURCES_MULTIPLE_CHOICE
    )


def score_answer(
    prediction: str | None, record: Mapping, normalization: AnswerNormalization = "folded"
) -> bool:
    """Score an answer against a QA record, for any ``data_source``.

    Multiple choice (:func:`is_multiple_choice`: options present, or ``medical_mc``): the
    option letter of the answer must be a golden letter (:func:`option_letter_match`).
    Anything else (``nq``, ``hotpotqa``, ``single_hop``, your own set): normalised exact
    match against any golden answer (:func:`exact_match` with ``normalization``).

    Args:
        prediction: the model's final answer (content of ``<answer>``), or ``None``.
        record: a QA record ``{"golden_answers": [...], "data_source": ..., "metadata":
            {...}}``; ``metadata["options"]`` (letter -> text) when multiple choice.
        normalization: free-text normalisation, ``folded`` or ``strict`` (module docstring);
            unused for multiple choice.

    Returns:
        True when correct.

    Raises:
        ValueError: missing or empty ``golden_answers`` (names the key), or an unknown
            ``normalization``.
        TypeError: ``golden_answers`` is a bare string.
    """
    normalizer(normalization)  # an unknown mode fails for multiple-choice records too
    if "golden_answers" not in record:
        raise ValueError(f"QA record {record.get('id')!r} has no 'golden_answers'")
    golden = record["golden_answers"]
    if is_multiple_choice(record):
        options = (record.get("metadata") or {}).get("options")
        return option_letter_match(prediction, golden, options)
    return exact_match(prediction, golden, normalization)


@dataclass(frozen=True)
class ComparedForms:
    """What :func:`score_answer` compared, so a record can say why an answer scored as it did.

    Attributes:
        method: ``exact_match`` (normalised text) or ``option_letter``.
        prediction: The normalised answer, or the option letter extracted from it; None
            for no answer (or no unambiguous letter).
        golden: The normalised golden answers, or the golden letters (upper case).
    """

    method: str
    prediction: str | None
    golden: tuple[str, ...]


def compared_forms(
    prediction: str | None, record: Mapping, normalization: AnswerNormalization = "folded"
) -> ComparedForms:
    """The forms :func:`score_answer` compares for ``prediction`` against ``record``.

    ``score_answer(p, r, n)`` is True exactly when ``compared_forms(p, r, n).prediction``
    is a non-empty member of ``.golden`` (the test suite checks this identity);
    ``normalization`` is the free-text one, ``folded`` or ``strict``.

    Raises:
        ValueError / TypeError: as :func:`score_answer` for bad ``golden_answers``.

    Example::

        >>> compared_forms("The Eiffel Tower!", {"golden_answers": ["Eiffel tower"]})
        ComparedForms(method='exact_match', prediction='eiffel tower', golden=('eiffel tower',))
    """
    if "golden_answers" not in record:
        raise ValueError(f"QA record {record.get('id')!r} has no 'golden_answers'")
    golden = record["golden_answers"]
    _check_golden(golden)
    if is_multiple_choice(record):
        options = (record.get("metadata") or {}).get("options")
        letters = tuple(g.strip().upper() for g in golden)
        return ComparedForms("option_letter", extract_option_letter(prediction, options), letters)
    normalize = normalizer(normalization)
    pred = None if prediction is None else normalize(prediction)
    return ComparedForms("exact_match", pred, tuple(normalize(g) for g in golden))
