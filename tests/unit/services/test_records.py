"""Per-question records (services.records): built from rollouts of the scripted engine and
the in-process retriever, so every field can be written down; recounted against the
aggregates of services.evaluate."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from rollout_fakes import TableRetriever
from scripted_engine import ScriptedEngine

from actors.config import RolloutConfig
from actors.retrieval_client import Passage
from actors.rollout import run_rollout
from actors.trajectory import TurnSummary
from services.evaluate import summarize_eval
from services.records import (
    append_records,
    choose_samples,
    eval_records,
    latest_evaluation,
    read_records,
    recount,
    sample_records,
)

LIMA = Passage("p1", "Lima", "Lima is the capital of Peru.", 3.0)
PERU = Passage("p2", "Peru", "Peru is a country in South America.", 2.0)
SEARCH = "<think>I need the capital.</think><search> capital of Peru </search>"

# question -> (script, golden answer, data_source); verdicts in the comments
EPISODES = {
    "Capital of Peru?": ([SEARCH, "<answer> Lima </answer>"], "Lima", "single_hop"),  # right
    "Capital of Chile?": (["<answer> Lima </answer>"], "Santiago", "single_hop"),  # wrong
    "Capital of Spain?": (
        ["I do not know.<|im_end|>"],
        "Madrid",
        "multi_hop",
    ),  # malformed: no_answer
    "Capital of Italy?": (["<answer> Rome<|im_end|>"], "Rome", "multi_hop"),  # unclosed
    "Capital of France?": (["<answer> the PARIS! </answer>"], "Paris", "multi_hop"),  # right
}


def enc(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def rollout(tok, episodes=EPISODES, cfg: RolloutConfig | None = None):
    engine = ScriptedEngine(tok, {q: script for q, (script, _, _) in episodes.items()})
    retriever = TableRetriever({"capital of Peru": [LIMA, PERU]})
    records = [
        {"id": f"{source}/validation/{i}", "question": q, "golden_answers": [gold],
         "data_source": source}
        for i, (q, (_, gold, source)) in enumerate(episodes.items())
    ]  # fmt: skip
    trajectories, _ = run_rollout(
        engine, tok, retriever, records, [f"g{i}" for i in range(len(records))],
        cfg or RolloutConfig(), temperature=0.0,
    )  # fmt: skip
    return trajectories


def test_records_recount_to_the_evaluation_aggregates(tok, tmp_path: Path) -> None:
    trajectories = rollout(tok)
    summary = summarize_eval(trajectories)
    path = tmp_path / "eval_samples.jsonl"
    append_records(path, eval_records(trajectories[:2], "start", 0, 2000))  # an older one
    append_records(path, eval_records(trajectories, "end", 4, 2000))
    latest = latest_evaluation(read_records(path))
    assert [r["tag"] for r in latest] == ["end"] * 5
    counts = recount(latest)
    # 2 of 5 right (Peru, France); 2 of 5 malformed (Spain: no answer, Italy: unclosed)
    assert (counts["success_rate"], counts["malformed_rate"]) == (2 / 5, 2 / 5)
    assert counts["success_rate/single_hop"] == 1 / 2
    assert counts["success_rate/multi_hop"] == 1 / 3
    for key in ("success_rate", "malformed_rate", "success_rate/single_hop",
                "success_rate/multi_hop", "num_questions", "searches_mean"):  # fmt: skip
        assert counts[key] == summary[key], key


def test_a_record_says_what_the_agent_did(tok) -> None:
    peru, chile, _, _, france = eval_records(rollout(tok), "start", 0, 2000)
    t0, t1 = SEARCH, "<answer> Lima </answer>"
    assert peru["question"] == "Capital of Peru?" and peru["golden_answers"] == ["Lima"]
    assert peru["turns"] == [
        {"text": t0, "tokens": len(enc(tok, t0)), "search_query": "capital of Peru",
         "passages": [{"id": "p1", "title": "Lima"}, {"id": "p2", "title": "Peru"}]},
        {"text": t1, "tokens": len(enc(tok, t1)), "search_query": None, "passages": []},
    ]  # fmt: skip
    assert peru["tokens"]["policy"] == len(enc(tok, t0)) + len(enc(tok, t1))
    assert (peru["answer"], peru["correct"], peru["malformed"]) == ("Lima", True, False)
    assert peru["scoring"] == {"method": "exact_match", "prediction": "lima", "golden": ["lima"]}
    assert (peru["num_searches"], peru["num_turns"], peru["finish_reason"]) == (1, 2, "answer")
    assert peru["policy_version_min"] == peru["policy_version_max"] == 0
    # wrong: the compared forms show why
    assert chile["scoring"] == {"method": "exact_match", "prediction": "lima",
                                "golden": ["santiago"]}  # fmt: skip
    assert (chile["correct"], chile["malformed"]) == (False, False)
    # normalisation made it right: "the PARIS!" -> "paris"
    assert (france["scoring"]["prediction"], france["correct"]) == ("paris", True)
    assert france["truncated"] == [] and france["text_cap_chars"] == 2000
    json.dumps(peru, allow_nan=False)  # strict JSON


def test_a_malformed_answer_says_why(tok) -> None:
    _, _, spain, italy, _ = eval_records(rollout(tok), "start", 0, 2000)
    assert (spain["malformed"], spain["malformed_reason"], spain["finish_reason"]) == (
        True, "no_answer", "eos",
    )  # fmt: skip
    assert (spain["answer"], spain["scoring"]["prediction"], spain["correct"]) == (
        None, None, False,
    )  # fmt: skip
    assert spain["turns"][0]["text"].startswith("I do not know.")
    # right answer, wrongly written: malformed scores 0 whatever it says
    assert (italy["malformed_reason"], italy["answer"], italy["correct"]) == (
        "unclosed_answer", None, False,
    )  # fmt: skip


def test_the_text_cap_holds_and_is_recorded(tok) -> None:
    long_turn = "<think>" + "why " * 200 + "</think><search> capital of Peru </search>"
    question = "Capital of Peru? " + "Please answer. " * 10
    episodes = {question.strip(): ([long_turn, "<answer> Lima </answer>"], "Lima", "single_hop")}
    cfg = RolloutConfig(max_new_tokens_per_turn=1024, max_response_tokens=4096)
    (record,) = eval_records(rollout(tok, episodes, cfg), "start", 0, text_cap_chars=40)
    assert record["text_cap_chars"] == 40
    assert record["truncated"] == ["question", "turns[0].text"]
    assert record["question"] == question.strip()[:40]
    assert record["turns"][0]["text"] == long_turn[:40]
    assert record["turns"][1]["text"] == "<answer> Lima </answer>"  # under the cap: whole
    texts = [record["question"], record["answer"]]
    texts += [t[k] for t in record["turns"] for k in ("text", "search_query") if t[k]]
    assert max(len(t) for t in texts) <= 40
    # the whole line: the two capped texts are ~800 and ~165 characters uncapped
    assert len(json.dumps(record)) < 1500


def test_training_samples_carry_what_the_learner_saw(tok) -> None:
    trajectories = rollout(tok)
    for t, draw in zip(trajectories, range(5), strict=True):
        t.extra["trajectory_id"] = f"d{draw}-g0"
    peru_turns = [TurnSummary(0.5, 0.25, 0.75), {"mean": -1.0, "min": -1.0, "max": -1.0}]
    advantages = [peru_turns, None, [TurnSummary(0.0, 0.0, 0.0)], None, None]
    records = sample_records(
        trajectories, [1, 0, 2, 0, 0], advantages, step=3, k=5, seed=0, text_cap_chars=2000
    )
    # only trained trajectories (advantages not None) are sampled: Peru and Spain
    assert [r["question_id"] for r in records] == ["single_hop/validation/0",
                                                    "multi_hop/validation/2"]  # fmt: skip
    peru = records[0]
    assert (peru["kind"], peru["step"], peru["trajectory_id"], peru["group_id"]) == (
        "train", 3, "d0-g0", "g0",
    )  # fmt: skip
    assert (peru["reward"], peru["staleness"]) == (1.0, 1)
    assert peru["turns"][0]["advantage"] == {"mean": 0.5, "min": 0.25, "max": 0.75}
    assert peru["turns"][1]["advantage"] == {"mean": -1.0, "min": -1.0, "max": -1.0}
    # the scripted engine's i-th token of a turn has log-prob -(i + 1) / 100: over n tokens
    # mean -(n + 1) / 200, min -n / 100, max -0.01
    n = len(enc(tok, SEARCH))
    lp = peru["turns"][0]["behavior_logprob"]
    np.testing.assert_allclose(
        [lp["mean"], lp["min"], lp["max"]], [-(n + 1) / 200, -n / 100, -0.01], atol=1e-6
    )
    assert sample_records(trajectories, [0] * 5, advantages, 3, 0, 0, 2000) == []
    with pytest.raises(ValueError, match="5 trajectories, 4 staleness"):
        sample_records(trajectories, [0] * 4, advantages, 3, 2, 0, 2000)


def test_samples_are_chosen_reproducibly() -> None:
    assert choose_samples(10, 3, seed=1, step=2) == choose_samples(10, 3, seed=1, step=2)
    assert choose_samples(10, 3, 1, 2) != choose_samples(10, 3, 1, 3)  # this pair differs
    assert choose_samples(2, 5, 0, 1) == [0, 1]
    chosen = choose_samples(10, 4, 0, 7)
    assert len(set(chosen)) == 4 and chosen == sorted(chosen)
