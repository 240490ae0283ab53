"""Prompt modes (agent, closed-book, RAG) checked on text, and the one-turn baselines scored
on known outputs (scripted engine, in-process passage table: every expected value can be
written down)."""

from __future__ import annotations

import numpy as np
import pytest
from rollout_fakes import TableRetriever
from scripted_engine import ScriptedEngine

from actors.baselines import run_single_turn
from actors.config import RolloutConfig
from actors.prompts import (
    CLOSED_BOOK_SYSTEM_PROMPT,
    MULTIPLE_CHOICE_SUFFIX,
    RAG_SYSTEM_PROMPT,
    SYSTEM_PROMPT,
    prompt_ids,
    prompt_messages,
)
from actors.retrieval_client import Passage
from services.evaluate import parse_modes, score_set, side_by_side

LIMA = Passage("1", "Lima", "Lima is the capital and largest city of Peru.", 7.5)
PERU = Passage("0", "Peru", "Peru is a country in western South America.", 6.0)

PERU_Q = {
    "id": "q-peru",
    "question": "What is the capital of Peru?",
    "golden_answers": ["Lima"],
    "data_source": "single_hop",
}
KENYA_Q = {
    "id": "q-kenya",
    "question": "What is the capital of Kenya?",
    "golden_answers": ["Nairobi"],
    "data_source": "single_hop",
}
MC_Q = {
    "id": "q-mc",
    "question": "Which vitamin deficiency causes scurvy?\nA. A\nB. B12\nC. C\nD. D",
    "golden_answers": ["C"],
    "data_source": "medical_mc",
    "metadata": {"options": {"A": "A", "B": "B12", "C": "C", "D": "D"}, "answer_letter": "C"},
}


def chatml(system: str, user: str) -> str:
    return (
        f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_agent_prompt_is_the_default_and_unchanged(tok):
    ids = prompt_ids(tok, PERU_Q)
    assert ids == prompt_ids(tok, PERU_Q, "agent")
    assert tok.decode(ids) == chatml(SYSTEM_PROMPT, "Question: What is the capital of Peru?")


def test_closed_book_prompt_text(tok):
    text = tok.decode(prompt_ids(tok, PERU_Q, "closed_book"))
    assert text == chatml(CLOSED_BOOK_SYSTEM_PROMPT, "Question: What is the capital of Peru?")
    assert "<search>" not in CLOSED_BOOK_SYSTEM_PROMPT
    assert "<answer> Beijing </answer>" in CLOSED_BOOK_SYSTEM_PROMPT


def test_rag_prompt_text_puts_passages_before_the_question(tok):
    text = tok.decode(prompt_ids(tok, PERU_Q, "rag", [LIMA, PERU]))
    user = (
        "Documents:\n"
        "Doc 1 (Title: Lima) Lima is the capital and largest city of Peru.\n"
        "Doc 2 (Title: Peru) Peru is a country in western South America.\n"
        "\nQuestion: What is the capital of Peru?"
    )
    assert text == chatml(RAG_SYSTEM_PROMPT, user)
    # no passages matched: the fixed note, not an empty block
    empty = prompt_messages(PERU_Q, "rag", [])[1]["content"]
    assert (
        empty
        == "Documents:\nNo passage matched the query.\n\nQuestion: What is the capital of Peru?"
    )


def test_multiple_choice_suffix_in_every_mode():
    for mode, passages in (("agent", None), ("closed_book", None), ("rag", [LIMA])):
        user = prompt_messages(MC_Q, mode, passages)[1]["content"]
        assert user.endswith("D. D" + MULTIPLE_CHOICE_SUFFIX)


def test_bad_mode_and_passages_combinations():
    with pytest.raises(ValueError, match="unknown prompt mode 'open_book'"):
        prompt_messages(PERU_Q, "open_book")
    with pytest.raises(ValueError, match="'rag' needs the retrieved passages"):
        prompt_messages(PERU_Q, "rag")
    with pytest.raises(ValueError, match="'closed_book' takes no passages"):
        prompt_messages(PERU_Q, "closed_book", [LIMA])
    with pytest.raises(ValueError, match="has no question text"):
        prompt_messages({**PERU_Q, "question": "  "}, "closed_book")


def test_closed_book_scores_known_outputs(tok):
    scripts = {
        "What is the capital of Peru?": ["<think>Peru.</think><answer> lima </answer>"],
        "What is the capital of Kenya?": ["<answer> Mombasa </answer>"],
        MC_Q["question"] + MULTIPLE_CHOICE_SUFFIX: ["I think it is vitamin C."],
    }
    engine = ScriptedEngine(tok, scripts)
    cfg = RolloutConfig(max_new_tokens_per_turn=64)
    ts = run_single_turn(engine, tok, [PERU_Q, KENYA_Q, MC_Q], "closed_book", cfg)
    # one batched call; the engine saw exactly the closed-book prompts
    assert engine.calls == [[prompt_ids(tok, r, "closed_book") for r in (PERU_Q, KENYA_Q, MC_Q)]]
    assert [t.success for t in ts] == [True, False, False]  # "lima" == "Lima" after normalising
    assert [t.answer for t in ts] == ["lima", "Mombasa", None]
    assert [t.malformed_reason for t in ts] == [None, None, "no_answer"]
    assert [t.finish_reason for t in ts] == ["answer", "answer", "max_tokens"]
    assert [(t.num_turns, t.num_searches) for t in ts] == [(1, 0)] * 3
    first = tok("<think>Peru.</think><answer> lima </answer>", add_special_tokens=False)
    assert ts[0].response_ids.tolist() == first["input_ids"]
    assert ts[0].loss_mask.tolist() == [1] * len(first["input_ids"])
    # ScriptedEngine gives token i the log-prob -(i + 1) / 100
    np.testing.assert_allclose(
        ts[0].behavior_logprobs, [-(i + 1) / 100 for i in range(len(first["input_ids"]))]
    )
    s = score_set("mixed", ts, mode="closed_book")
    # success 1/3, searches 0, turns 1, malformed 1/3
    assert (s.success_rate, s.searches_mean, s.turns_mean) == (pytest.approx(1 / 3), 0.0, 1.0)
    assert (s.malformed_rate, s.mode) == (pytest.approx(1 / 3), "closed_book")


def test_rag_retrieves_once_for_the_raw_questions_and_scores(tok):
    table = {PERU_Q["question"]: [LIMA, PERU], MC_Q["question"]: []}
    client = TableRetriever(table)
    scripts = {
        "What is the capital of Peru?": ["<answer> Lima </answer>"],
        MC_Q["question"] + MULTIPLE_CHOICE_SUFFIX: ["<answer> C. Vitamin C </answer>"],
    }
    engine = ScriptedEngine(tok, scripts)
    ts = run_single_turn(engine, tok, [PERU_Q, MC_Q], "rag", RolloutConfig(), client=client)
    assert client.requests == [[PERU_Q["question"], MC_Q["question"]]]  # one request, raw text
    assert engine.calls[0][0] == prompt_ids(tok, PERU_Q, "rag", [LIMA, PERU])
    assert engine.calls[0][1] == prompt_ids(tok, MC_Q, "rag", [])
    assert [t.success for t in ts] == [True, True]  # option letter C extracted from "C. ..."
    assert [(t.num_turns, t.num_searches) for t in ts] == [(1, 1), (1, 1)]
    assert all(t.extra["mode"] == "rag" for t in ts)


def test_rag_retrieval_failure_is_flagged_not_answered(tok):
    engine = ScriptedEngine(tok, {})
    client = TableRetriever({}, fail=True)
    ts = run_single_turn(engine, tok, [PERU_Q, KENYA_Q], "rag", RolloutConfig(), client=client)
    assert engine.calls == []  # nothing generated without the passages
    assert [t.retrieval_failed for t in ts] == [True, True]
    assert [t.finish_reason for t in ts] == ["retrieval_failed"] * 2
    assert ts[0].extra["retrieval_error"].startswith("http_503: ")
    s = score_set("single_hop", ts, mode="rag")
    assert (s.success_rate, s.retrieval_failed) == (0.0, 2)


def test_run_single_turn_rejects_bad_input(tok):
    engine = ScriptedEngine(tok, {})
    with pytest.raises(ValueError, match="unknown baseline mode 'agent'"):
        run_single_turn(engine, tok, [PERU_Q], "agent", RolloutConfig())
    with pytest.raises(ValueError, match="needs a retrieval client"):
        run_single_turn(engine, tok, [PERU_Q], "rag", RolloutConfig())
    with pytest.raises(ValueError, match="at least one record"):
        run_single_turn(engine, tok, [], "closed_book", RolloutConfig())
    with pytest.raises(ValueError, match="lacks 'golden_answers'"):
        bad = {k: v for k, v in PERU_Q.items() if k != "golden_answers"}
        run_single_turn(engine, tok, [bad], "closed_book", RolloutConfig())


def test_parse_modes_and_side_by_side_table(tok):
    assert parse_modes("all") == ["closed_book", "rag", "agent"]
    assert parse_modes("rag") == ["rag"]
    with pytest.raises(ValueError, match="--mode must be one of"):
        parse_modes("oracle")
    engine = ScriptedEngine(
        tok,
        {
            "What is the capital of Peru?": ["<answer> Lima </answer>"],
            "What is the capital of Kenya?": ["<answer> Nairobi </answer>"],
        },
    )
    closed = run_single_turn(engine, tok, [PERU_Q, KENYA_Q], "closed_book", RolloutConfig())
    wrong = {
        "What is the capital of Peru?": ["<answer> Cusco </answer>"],
        "What is the capital of Kenya?": ["<answer> Nairobi </answer>"],
    }
    client = TableRetriever({PERU_Q["question"]: [PERU], KENYA_Q["question"]: []})
    rag = run_single_turn(
        ScriptedEngine(tok, wrong), tok, [PERU_Q, KENYA_Q], "rag", RolloutConfig(), client
    )
    scores = [score_set("single_hop", closed, "closed_book"), score_set("single_hop", rag, "rag")]
    header, rows = side_by_side(scores)
    # closed book 2/2 correct, rag 1/2 (Cusco is wrong)
    assert header == ["set", "n", "closed_book", "rag"]
    assert rows == [["single_hop", "2", "1.000", "0.500"]]


SHORT = "Search the records, then answer."


def test_system_prompt_replaces_the_agent_instruction_only(tok):
    text = tok.decode(prompt_ids(tok, PERU_Q, system_prompt=SHORT))
    assert text == chatml(SHORT, "Question: What is the capital of Peru?")
    assert prompt_messages(PERU_Q, system_prompt=SHORT)[0] == {"role": "system", "content": SHORT}
    for mode, passages in (("closed_book", None), ("rag", [LIMA])):
        with pytest.raises(ValueError, match=f"'{mode}' keeps its own system message"):
            prompt_messages(PERU_Q, mode, passages, system_prompt=SHORT)


def test_rollouts_and_demonstrations_use_the_configured_system_prompt(tok):
    """rollout.system_prompt reaches the engine's prompt and the warm start's demonstrations
    (a demonstration under another prompt teaches the wrong context)."""
    from actors.demonstrations import build_demonstration
    from actors.rollout import run_rollout

    rec = {**PERU_Q, "metadata": {"search_queries": ["capital of Peru"]}}
    engine = ScriptedEngine(tok, {PERU_Q["question"]: ["<answer> Lima </answer>"]})
    cfg = RolloutConfig(system_prompt=SHORT)
    (traj,), _ = run_rollout(engine, tok, TableRetriever({}), [rec], ["g"], cfg)
    expected = prompt_ids(tok, rec, system_prompt=SHORT)
    assert traj.prompt_ids.tolist() == engine.calls[0][0] == expected
    assert expected != prompt_ids(tok, rec)

    retrieve = TableRetriever({"capital of Peru": [LIMA]}).retrieve
    demo = build_demonstration(rec, tok, retrieve, system_prompt=SHORT)
    assert demo.prompt_ids.tolist() == expected
    assert build_demonstration(rec, tok, retrieve).prompt_ids.tolist() == prompt_ids(tok, rec)


def test_system_prompt_config_rejects_an_empty_message():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="system_prompt"):
        RolloutConfig(system_prompt="")
