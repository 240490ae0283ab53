"""Prompt and environment text of the search agent (Search-R1 tool format).

The policy sees a chat prompt (system message with the tool format, user message with the
question) and writes ``<think>..</think>`` (optional), then either ``<search>query</search>``
or ``<answer>..</answer>``. A search is answered by the environment with an information
block appended to the response (Search-R1 ``_passages2string`` layout)::

    \\n\\n<information>Doc 1 (Title: Paris) Paris is the capital ...
    Doc 2 (Title: ...) ...</information>\\n\\n

Environment blocks are tokenized on their own and appended as token ids, so what the
engine sees is exactly ``prompt_ids + response_ids`` (no re-tokenization of the whole
text, which could merge tokens across the policy/environment boundary).

Two one-turn baselines share the user message and the answer format (prompt modes,
:data:`PROMPT_MODES`), as in the baselines of the Search-R1 and ST-PPO papers:

- ``closed_book``: no retrieval; the system message asks for the answer directly inside
  ``<answer></answer>``;
- ``rag``: the top-k passages retrieved for the raw question are put in the user message
  (``Doc i (Title: t) text`` lines, the same layout as an information block), then the
  model answers in one turn.

Source: Jin et al., "Search-R1" (2025), ``search_r1/llm_agent/generation.py`` and the
training prompt of ``scripts/data_process/nq_search.py``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Literal

from actors.retrieval_client import Passage
from actors.scoring import is_multiple_choice

SYSTEM_PROMPT = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> "
    "first every time you get new information. After reasoning, if you find you lack some "
    "knowledge, you can call a search engine by <search> query </search> and it will return "
    "the top searched results between <information> and </information>. You can search as "
    "many times as you want. If you find no further external knowledge needed, you can "
    "directly provide the answer inside <answer> and </answer>, without detailed "
    "illustrations. For example, <answer> Beijing </answer>."
)
"""Search-R1's instruction, as the system message."""

CLOSED_BOOK_SYSTEM_PROMPT = (
    "Answer the given question directly, without searching and without detailed "
    "illustrations. Provide the answer inside <answer> and </answer>. "
    "For example, <answer> Beijing </answer>."
)
"""System message of the closed-book baseline (no retrieval, one turn)."""

RAG_SYSTEM_PROMPT = (
    "Answer the given question using the documents provided with it. Provide the answer "
    "inside <answer> and </answer>, without detailed illustrations. "
    "For example, <answer> Beijing </answer>."
)
"""System message of the single-retrieval RAG baseline (passages in the prompt, one turn)."""

RAG_DOCUMENTS_HEADER = "Documents:\n"
"""Starts the RAG user message; the passages follow as ``Doc i (Title: t) text`` lines."""

PromptMode = Literal["agent", "closed_book", "rag"]
"""How the question is put to the model: the search agent, or one of the two baselines."""

PROMPT_MODES: tuple[str, ...] = ("agent", "closed_book", "rag")
"""Every :data:`PromptMode`, in report order."""

_SYSTEM_PROMPTS = {
    "agent": SYSTEM_PROMPT,
    "closed_book": CLOSED_BOOK_SYSTEM_PROMPT,
    "rag": RAG_SYSTEM_PROMPT,
}

MULTIPLE_CHOICE_SUFFIX = (
    "\nAnswer with the letter of the correct option, e.g. <answer> B </answer>."
)
"""Appended to multiple-choice questions (:func:`actors.scoring.is_multiple_choice`; their
text lists the options: built into ``medical_mc``, appended by :mod:`services.qa_data`)."""

INVALID_SEARCH_MESSAGE = (
    "\nMy previous action is invalid. If I want to search, I should put the query between "
    "<search> and </search>. If I want to give the final answer, I should put the answer "
    "between <answer> and </answer>. Let's try again.\n"
)
"""Environment reply to ``<search></search>`` with an empty query (Search-R1 wording)."""

INFORMATION_PREFIX = "\n\n<information>"
INFORMATION_SUFFIX = "</information>\n\n"
NO_RESULTS_TEXT = "No passage matched the query."
"""Inner text when the retriever found nothing (a real answer, not a failure)."""

_SEARCH = re.compile(r"<search>(.*?)</search>", re.DOTALL)


def user_message(record: Mapping) -> str:
    """The user turn for a QA record: ``Question: ...`` (+ the letter instruction for
    multiple choice).

    Raises:
        ValueError: the record has no non-empty ``question``.
    """
    question = record.get("question")
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"QA record {record.get('id')!r} has no question text")
    text = f"Question: {question.strip()}"
    if is_multiple_choice(record):
        text += MULTIPLE_CHOICE_SUFFIX
    return text


def prompt_messages(
    record: Mapping,
    mode: PromptMode = "agent",
    passages: Sequence[Passage] | None = None,
    system_prompt: str | None = None,
) -> list[dict[str, str]]:
    """The chat messages (system + user) of ``record`` in prompt ``mode``.

    ``agent`` and ``closed_book``: the user message is :func:`user_message`. ``rag``: it is
    :data:`RAG_DOCUMENTS_HEADER` + :func:`passages_text` of ``passages`` + a blank line +
    :func:`user_message` (an empty ``passages`` list gives :data:`NO_RESULTS_TEXT`).

    ``system_prompt`` replaces the agent's system message (``rollout.system_prompt``; None =
    :data:`SYSTEM_PROMPT`); the baselines keep theirs.

    Example: ``prompt_messages(r, "rag", [p])[1]["content"] ==
    "Documents:\\nDoc 1 (Title: Lima) Lima is ...\\n\\nQuestion: What is the capital of Peru?"``.

    Raises:
        ValueError: unknown ``mode``; ``rag`` without ``passages``; ``passages`` given to
            another mode; ``system_prompt`` given to a baseline mode; no question text.
    """
    if mode not in _SYSTEM_PROMPTS:
        raise ValueError(f"unknown prompt mode {mode!r}; expected one of {PROMPT_MODES}")
    if mode == "rag" and passages is None:
        raise ValueError("prompt mode 'rag' needs the retrieved passages")
    if mode != "rag" and passages is not None:
        raise ValueError(f"prompt mode {mode!r} takes no passages (only 'rag' does)")
    if system_prompt is not None and mode != "agent":
        raise ValueError(
            f"prompt mode {mode!r} keeps its own system message (only 'agent' takes one)"
        )
    user = user_message(record)
    if mode == "rag":
        user = f"{RAG_DOCUMENTS_HEADER}{passages_text(passages)}\n\n{user}"
    return [
        {
            "role": "system",
            "content": _SYSTEM_PROMPTS[mode] if system_prompt is None else system_prompt,
        },
        {"role": "user", "content": user},
    ]


def prompt_ids(
    tokenizer,
    record: Mapping,
    mode: PromptMode = "agent",
    passages: Sequence[Passage] | None = None,
    system_prompt: str | None = None,
) -> list[int]:
    """Chat-formatted prompt token ids (system + user, generation prompt appended).

    Uses the tokenizer's chat template (SmolLM2: ChatML); special tokens come from the
    template, so ``add_special_tokens=False`` when encoding. ``mode`` and ``passages`` as
    :func:`prompt_messages`; the default is the search agent's prompt, ``system_prompt``
    replaces its system message.

    Raises:
        ValueError: no question text, the tokenizer has no chat template, or a bad
            ``mode`` / ``passages`` combination (see :func:`prompt_messages`).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template; the agent prompt needs one")
    messages = prompt_messages(record, mode, passages, system_prompt)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def extract_search_query(turn_text: str) -> str | None:
    """The query of the last ``<search>...</search>`` in a turn, stripped; None if absent.

    Example: ``extract_search_query("<think>x</think><search> capital of Peru </search>")
    == "capital of Peru"``. An empty pair gives ``""`` (an invalid search).
    """
    found = _SEARCH.findall(turn_text)
    return found[-1].strip() if found else None


def passages_text(passages: Sequence[Passage]) -> str:
    """``Doc i (Title: t) text`` lines, 1-based, best first; a fixed note when empty."""
    if not passages:
        return NO_RESULTS_TEXT
    return "\n".join(f"Doc {i} (Title: {p.title}) {p.text}" for i, p in enumerate(passages, 1))


def information_ids(tokenizer, passages: Sequence[Passage], max_tokens: int) -> list[int]:
    """Token ids of one information block, at most ``max_tokens`` long.

    The wrapper (``\\n\\n<information>`` ... ``</information>\\n\\n``) is always complete;
    the passages text is cut to the tokens that fit between.

    Raises:
        ValueError: ``max_tokens`` cannot even hold the wrapper plus one token.
    """
    prefix = tokenizer(INFORMATION_PREFIX, add_special_tokens=False)["input_ids"]
    suffix = tokenizer(INFORMATION_SUFFIX, add_special_tokens=False)["input_ids"]
    room = max_tokens - len(prefix) - len(suffix)
    if room < 1:
        raise ValueError(
            f"max_information_tokens={max_tokens} cannot hold the {len(prefix) + len(suffix)}-token wrapper"
        )
    body = tokenizer(passages_text(passages), add_special_tokens=False)["input_ids"]
    return list(prefix) + list(body[:room]) + list(suffix)


def invalid_search_ids(tokenizer) -> list[int]:
    """Token ids of :data:`INVALID_SEARCH_MESSAGE`."""
    return list(tokenizer(INVALID_SEARCH_MESSAGE, add_special_tokens=False)["input_ids"])
