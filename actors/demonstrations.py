"""Demonstrations of the search-agent format, built with the rollout's own prompt code.

A demonstration is an ordinary :class:`actors.trajectory.Trajectory` built from a training
QA record: for each query in ``record["metadata"]["search_queries"]`` (the gold entity, then
the bridge entity for multi-hop) a policy turn ``<think> ... </think>\\n<search> q
</search>``, the real retrieval server's ``<information>`` block (environment tokens,
``loss_mask = 0``), and a final policy turn ``<think> ... </think>\\n<answer> gold
</answer>``. Prompt, information block and turn layout come from :mod:`actors.prompts`, the
same code the rollout actors use, so the learned format is exactly the one the rollout
parses. The learner's warm start (:mod:`learner.sft`) trains on them.

Source of the format: Search-R1 (Jin et al., 2025); the warm start itself is our choice (a
135M model does not follow the tool format zero-shot).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from actors.prompts import information_ids, prompt_ids
from actors.retrieval_client import Passage
from actors.scoring import is_multiple_choice, normalize_answer
from actors.trajectory import Trajectory

RetrieveFn = Callable[[list[str]], list[list[Passage]]]
"""``queries -> top-k passages per query`` (e.g. ``RetrievalClient(...).retrieve``)."""

SEARCH_THOUGHT = "<think> I need to look up {query}. </think>\n<search> {query} </search>"
"""Policy text of a demonstration search turn."""

ANSWER_THOUGHT = (
    "<think> The information answers the question. </think>\n<answer> {answer} </answer>"
)
"""Policy text of the demonstration's final turn."""


class DemonstrationError(ValueError):
    """A QA record cannot be turned into a demonstration (the message says why)."""


@dataclass
class DemonstrationSet:
    """Demonstrations and what was dropped while building them.

    Attributes:
        demonstrations: the trajectories (``extra["demonstration"] = True``).
        num_records: records tried.
        num_answer_not_retrieved: dropped because no retrieved passage contains a gold
            answer (only with ``require_answer_in_passages``).
        num_invalid: dropped records (no search queries, no gold answer...), with reasons
            in ``invalid_reasons``.
        num_early_answer: demonstrations that stopped after their first search and answered
            what it returned (``early_answer_share``).
        num_early_eligible: records that could be (more than one search and a
            ``metadata.partial_answer``).
    """

    demonstrations: list[Trajectory] = field(default_factory=list)
    num_records: int = 0
    num_answer_not_retrieved: int = 0
    num_invalid: int = 0
    invalid_reasons: list[str] = field(default_factory=list)
    num_early_answer: int = 0
    num_early_eligible: int = 0


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _search_queries(record: Mapping) -> list[str]:
    """``metadata.search_queries``; a record without them (your own QA files) searches its
    question text once."""
    meta = record.get("metadata") or {}
    if "search_queries" not in meta and isinstance(record.get("question"), str):
        return [record["question"].strip().split("\n")[0]]
    queries = meta.get("search_queries")
    if (
        not isinstance(queries, list)
        or not queries
        or not all(isinstance(q, str) and q.strip() for q in queries)
    ):
        raise DemonstrationError(
            f"record {record.get('id')!r}: metadata.search_queries must be a non-empty list of "
            "non-empty strings"
        )
    return [q.strip() for q in queries]


def _gold_answer(record: Mapping) -> str:
    golden = record.get("golden_answers")
    if not isinstance(golden, list) or not golden or not str(golden[0]).strip():
        raise DemonstrationError(f"record {record.get('id')!r} has no golden answer")
    return str(golden[0]).strip()


def answer_in_passages(record: Mapping, passages: Sequence[Passage]) -> bool:
    """Whether a normalised gold alias occurs in a retrieved passage's normalised text
    (multiple choice: the correct option's text). Used to skip demonstrations that would
    teach answering without evidence."""
    if is_multiple_choice(record):
        meta = record.get("metadata") or {}
        letter = str(meta.get("answer_letter", record["golden_answers"][0]))
        aliases = [str((meta.get("options") or {}).get(letter, ""))]
    else:
        aliases = [str(a) for a in record["golden_answers"]]
    wanted = [normalize_answer(a) for a in aliases if normalize_answer(a)]
    texts = [normalize_answer(f"{p.title} {p.text}") for p in passages]
    return any(a in t for a in wanted for t in texts)


def build_demonstration(
    record: Mapping,
    tokenizer,
    retrieve_fn: RetrieveFn,
    *,
    max_information_tokens: int = 256,
    require_answer_in_passages: bool = True,
    system_prompt: str | None = None,
    early_answer: bool = False,
) -> Trajectory | None:
    """One demonstration trajectory for a QA record (format in the module docstring).

    Args:
        record: QA record with ``question``, ``golden_answers``, ``data_source`` and
            ``metadata.search_queries``.
        tokenizer: the policy's tokenizer (chat template required).
        retrieve_fn: the real retrieval server's client (``RetrievalClient.retrieve``).
        max_information_tokens: budget of one information block (the rollout's
            ``max_information_tokens``).
        require_answer_in_passages: return None when no retrieved passage contains a gold
            answer.
        system_prompt: the agent's system message (``rollout.system_prompt``; None =
            Search-R1's), so the demonstrations show the prompt the rollouts will use.
        early_answer: stop after the first search and answer what it returned, the
            record's ``metadata.partial_answer`` (a demonstrator that missed that the
            question asks about a linked record). Such a demonstration is never dropped for
            ``require_answer_in_passages``.

    Returns:
        A validated :class:`Trajectory` (``behavior_logprobs = 0``, ``policy_version =
        -1``: not generated by any policy; ``reward = 1``, or 0 for an early answer that is
        not a gold one), or None (see above).

    Raises:
        DemonstrationError: record without search queries or gold answer; ``early_answer``
            for a record without ``metadata.partial_answer``.
        actors.retrieval_client.RetrievalFailed: the server did not answer.
    """
    queries = _search_queries(record)
    if early_answer:
        partial = _partial_answer(record)
        if not partial:
            raise DemonstrationError(f"record {record.get('id')!r}: no metadata.partial_answer")
        queries = queries[:1]
    answer = _gold_answer(record)
    if is_multiple_choice(record):
        answer = str((record.get("metadata") or {}).get("answer_letter", answer))
    correct = not early_answer or str(partial) == answer
    answer = str(partial) if early_answer else answer
    response: list[int] = []
    loss_mask: list[int] = []
    turn_ids: list[int] = []
    retrieved: list[Passage] = []
    for turn, query in enumerate(queries):
        policy = _encode(tokenizer, SEARCH_THOUGHT.format(query=query))
        passages = retrieve_fn([query])[0]
        retrieved.extend(passages)
        env = information_ids(tokenizer, passages, max_information_tokens)
        response += policy + env
        loss_mask += [1] * len(policy) + [0] * len(env)
        turn_ids += [turn] * len(policy) + [-1] * len(env)
    if (
        require_answer_in_passages
        and not early_answer
        and not answer_in_passages(record, retrieved)
    ):
        return None
    final = _encode(tokenizer, ANSWER_THOUGHT.format(answer=answer))
    response += final
    loss_mask += [1] * len(final)
    turn_ids += [len(queries)] * len(final)
    return Trajectory(
        prompt_ids=np.asarray(
            prompt_ids(tokenizer, record, system_prompt=system_prompt), dtype=np.int64
        ),
        response_ids=np.asarray(response, dtype=np.int64),
        loss_mask=np.asarray(loss_mask, dtype=np.int8),
        turn_ids=np.asarray(turn_ids, dtype=np.int32),
        behavior_logprobs=np.zeros(len(response), dtype=np.float32),
        reward=1.0 if correct else 0.0,
        success=correct,
        num_searches=len(queries),
        num_turns=len(queries) + 1,
        policy_version_min=-1,
        policy_version_max=-1,
        group_id=f"demo/{record['id']}",
        question_id=str(record["id"]),
        data_source=str(record["data_source"]),
        finish_reason="answer",
        answer=answer,
        extra={"demonstration": True, "early_answer": early_answer},
    ).validate()


def build_demonstrations(
    records: Sequence[Mapping],
    tokenizer,
    retrieve_fn: RetrieveFn,
    *,
    max_information_tokens: int = 256,
    require_answer_in_passages: bool = True,
    system_prompt: str | None = None,
    early_answer_share: float = 0.0,
    seed: int = 0,
) -> DemonstrationSet:
    """:func:`build_demonstration` over many records; invalid records are counted with
    their reason, not raised (a retrieval failure still raises: that is an outage).

    With ``early_answer_share`` each demonstration of a question that names a
    ``metadata.partial_answer`` and needs more than one search (each entry of ``records``:
    a question drawn twice is demonstrated twice, independently) stops after its first
    search with that probability and answers what that search returned
    (``early_answer``). Seeded by ``seed``. The answer is always one the demonstration
    read, so the policy learns one way of answering (copy from the last passage) and a
    decision, search again or answer now; a guessed answer instead taught the synthetic
    task's policy to answer against what it read.

    Raises:
        ValueError: if ``early_answer_share > 0`` and no record is eligible (the share would
            silently do nothing; the synthetic task writes ``partial_answer`` since its
            version 2). Checked before any retrieval.
    """
    eligibility = [
        len(_search_queries_or_none(record)) > 1 and bool(_partial_answer(record))
        for record in records
    ]
    if early_answer_share > 0.0 and not any(eligibility):
        raise ValueError(
            f"sft.early_answer_share = {early_answer_share} but none of the {len(records)} "
            "demonstrated questions needs two searches and names a metadata.partial_answer "
            "(the synthetic task writes them since its version 2: stppo prepare-synthetic "
            "--force)"
        )
    out = DemonstrationSet()
    rng = random.Random(seed)
    for record, eligible in zip(records, eligibility, strict=True):
        out.num_records += 1
        out.num_early_eligible += int(eligible)
        early = eligible and early_answer_share > 0.0 and rng.random() < early_answer_share
        try:
            demo = build_demonstration(
                record,
                tokenizer,
                retrieve_fn,
                max_information_tokens=max_information_tokens,
                require_answer_in_passages=require_answer_in_passages,
                system_prompt=system_prompt,
                early_answer=early,
            )
        except DemonstrationError as err:
            out.num_invalid += 1
            out.invalid_reasons.append(str(err))
            continue
        if demo is None:
            out.num_answer_not_retrieved += 1
        else:
            out.demonstrations.append(demo)
            out.num_early_answer += int(early)
    return out


def _partial_answer(record: Mapping) -> str | None:
    """``metadata.partial_answer``: what stopping after the first search answers (None where
    the record names none)."""
    return (record.get("metadata") or {}).get("partial_answer")


def _search_queries_or_none(record: Mapping) -> list[str]:
    """The record's search queries, [] where it has none (it fails as a demonstration)."""
    try:
        return _search_queries(record)
    except DemonstrationError:
        return []
