"""The multi-turn loop's token accounting, batching, budgets and failure handling.

Engine and retriever are cheap protocol implementations (``ScriptedEngine``, a scripted
policy, and the in-process passage table below), so every expected token sequence can be written down; the
real engines and the real HTTP server are exercised in tests/integration.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from rollout_fakes import TableRetriever
from scripted_engine import ScriptedEngine

from actors.config import RolloutConfig
from actors.prompts import INVALID_SEARCH_MESSAGE, information_ids, prompt_ids
from actors.retrieval_client import Passage
from actors.rollout import run_rollout

LIMA = Passage("p1", "Lima", "Lima is the capital of Peru.", 3.0)
PERU = Passage("p2", "Peru", "Peru is a country in South America.", 2.0)


def record(question: str, answer: str, qid: str = "q0") -> dict:
    return {
        "id": qid,
        "question": question,
        "golden_answers": [answer],
        "data_source": "single_hop",
    }


def enc(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_two_turn_episode_token_accounting(tok):
    turn0 = "<think>I need the capital.</think><search> capital of Peru </search>"
    turn1 = "<answer> Lima </answer>"
    engine = ScriptedEngine(tok, {"Capital of Peru?": [turn0, turn1]})
    retriever = TableRetriever({"capital of Peru": [LIMA, PERU]})
    rec = record("Capital of Peru?", "Lima")
    (traj,), stats = run_rollout(engine, tok, retriever, [rec], ["g0"], RolloutConfig())

    t0, t1 = enc(tok, turn0), enc(tok, turn1)
    info = information_ids(tok, [LIMA, PERU], 256)
    assert tok.decode(info) == (
        "\n\n<information>Doc 1 (Title: Lima) Lima is the capital of Peru.\n"
        "Doc 2 (Title: Peru) Peru is a country in South America.</information>\n\n"
    )
    assert traj.prompt_ids.tolist() == prompt_ids(tok, rec)
    assert traj.response_ids.tolist() == t0 + info + t1
    # what the engine saw: the prompt, then prompt + turn 0 + information
    assert engine.calls == [[traj.prompt_ids.tolist()], [traj.prompt_ids.tolist() + t0 + info]]
    assert traj.loss_mask.tolist() == [1] * len(t0) + [0] * len(info) + [1] * len(t1)
    assert traj.turn_ids.tolist() == [0] * len(t0) + [-1] * len(info) + [1] * len(t1)
    expected_lp = [-(k + 1) / 100 for k in range(len(t0))] + [0.0] * len(info)
    expected_lp += [-(k + 1) / 100 for k in range(len(t1))]
    np.testing.assert_allclose(traj.behavior_logprobs, expected_lp, rtol=0, atol=1e-7)
    assert (traj.reward, traj.success, traj.answer, traj.malformed_reason) == (
        1.0,
        True,
        "Lima",
        None,
    )
    assert (traj.num_turns, traj.num_searches, traj.finish_reason) == (2, 1, "answer")
    assert retriever.requests == [["capital of Peru"]]
    assert (stats.num_engine_calls, stats.num_searches, stats.num_generated_tokens) == (
        2,
        1,
        len(t0) + len(t1),
    )


def test_episodes_are_batched_per_turn_and_queries_per_request(tok):
    scripts = {
        "A?": ["<answer>x</answer>"],
        "B?": ["<search>b</search>", "<answer>y</answer>"],
        "C?": ["<search>c1</search>", "<search>c2</search>"],
    }
    engine = ScriptedEngine(tok, scripts)
    retriever = TableRetriever({"b": [PERU], "c1": [LIMA], "c2": [LIMA]})
    recs = [record("A?", "x", "a"), record("B?", "y", "b"), record("C?", "z", "c")]
    trajs, stats = run_rollout(
        engine, tok, retriever, recs, ["a", "b", "c"], RolloutConfig(max_turns=2)
    )
    assert [len(call) for call in engine.calls] == [3, 2]  # one generate call per turn
    assert retriever.requests == [["b", "c1"]]  # one /retrieve per turn; last-turn search not sent
    assert [t.finish_reason for t in trajs] == ["answer", "answer", "max_turns"]
    assert [t.num_turns for t in trajs] == [1, 2, 2]
    assert [t.num_searches for t in trajs] == [0, 1, 1]
    assert [t.reward for t in trajs] == [1.0, 1.0, 0.0]
    assert trajs[2].malformed_reason == "no_answer"
    assert stats.num_trajectories == 3


def test_retrieval_failure_marks_trajectory_and_adds_no_information(tok):
    turn0 = "<search> capital of Peru </search>"
    engine = ScriptedEngine(tok, {"Q?": [turn0, "<answer>Lima</answer>"]})
    retriever = TableRetriever({}, fail=True, status=500)
    (traj,), stats = run_rollout(
        engine, tok, retriever, [record("Q?", "Lima")], ["g"], RolloutConfig()
    )
    assert traj.retrieval_failed is True
    assert traj.finish_reason == "retrieval_failed"
    assert traj.response_ids.tolist() == enc(tok, turn0)  # no empty <information> block
    assert (traj.reward, traj.success, traj.malformed_reason) == (0.0, False, None)
    assert traj.extra["retrieval_error"].startswith("http_500")
    assert (stats.num_retrieval_failures, stats.num_retrieval_failed_trajectories) == (1, 1)
    assert len(engine.calls) == 1


def test_turn_budget_ends_episode_with_max_tokens(tok):
    turn0 = "<think>" + "very long reasoning " * 20 + "</think><answer>Lima</answer>"
    engine = ScriptedEngine(tok, {"Q?": [turn0]})
    cfg = RolloutConfig(max_new_tokens_per_turn=10)
    (traj,), _ = run_rollout(engine, tok, TableRetriever({}), [record("Q?", "Lima")], ["g"], cfg)
    assert traj.response_ids.tolist() == enc(tok, turn0)[:10]
    assert (traj.finish_reason, traj.malformed_reason, traj.reward) == (
        "max_tokens",
        "no_answer",
        0.0,
    )


def test_information_block_is_truncated_to_its_budget(tok):
    long_passage = Passage("p", "Long", "word " * 300, 1.0)
    engine = ScriptedEngine(tok, {"Q?": ["<search>q</search>", "<answer>Lima</answer>"]})
    cfg = RolloutConfig(max_information_tokens=20)
    (traj,), _ = run_rollout(
        engine, tok, TableRetriever({"q": [long_passage]}), [record("Q?", "Lima")], ["g"], cfg
    )
    env = traj.response_ids[traj.loss_mask == 0].tolist()
    assert len(env) == 20
    text = tok.decode(env)
    assert text.startswith("\n\n<information>Doc 1 (Title: Long) word word")
    assert text.endswith("</information>\n\n")
    assert traj.finish_reason == "answer"


def test_response_budget_stops_before_an_information_block_that_does_not_fit(tok):
    turn0 = "<search>q</search>"
    engine = ScriptedEngine(tok, {"Q?": [turn0, "<answer>Lima</answer>"]})
    n0 = len(enc(tok, turn0))
    cfg = RolloutConfig(max_response_tokens=n0 + 20, max_information_tokens=64)
    passages = {"q": [Passage("p", "T", "word " * 100, 1.0)]}
    (traj,), _ = run_rollout(
        engine, tok, TableRetriever(passages), [record("Q?", "Lima")], ["g"], cfg
    )
    assert traj.response_ids.tolist() == enc(tok, turn0)
    assert (traj.finish_reason, traj.num_searches) == ("max_tokens", 1)


def test_empty_search_gets_the_invalid_action_message(tok):
    engine = ScriptedEngine(tok, {"Q?": ["<search> </search>", "<answer>Lima</answer>"]})
    retriever = TableRetriever({})
    (traj,), _ = run_rollout(engine, tok, retriever, [record("Q?", "Lima")], ["g"], RolloutConfig())
    env = traj.response_ids[traj.loss_mask == 0].tolist()
    assert env == enc(tok, INVALID_SEARCH_MESSAGE)
    assert retriever.requests == []
    assert (traj.num_searches, traj.extra["num_invalid_searches"], traj.reward) == (0, 1, 1.0)


def test_eos_without_action_ends_the_episode(tok):
    engine = ScriptedEngine(tok, {"Q?": ["Lima.<|im_end|>"]})
    (traj,), _ = run_rollout(
        engine, tok, TableRetriever({}), [record("Q?", "Lima")], ["g"], RolloutConfig()
    )
    assert traj.response_ids.tolist()[-1] == tok.eos_token_id
    assert (traj.finish_reason, traj.malformed_reason) == ("eos", "no_answer")


def test_policy_version_range_spans_a_weight_update_between_turns(tok):
    engine = ScriptedEngine(
        tok, {"Q?": ["<search>q</search>", "<answer>Lima</answer>"]}, bump_after_calls=1
    )
    (traj,), _ = run_rollout(
        engine, tok, TableRetriever({"q": [LIMA]}), [record("Q?", "Lima")], ["g"], RolloutConfig()
    )
    assert (traj.policy_version_min, traj.policy_version_max) == (0, 1)


def test_bad_input_is_rejected(tok):
    engine = ScriptedEngine(tok, {})
    with pytest.raises(ValueError, match="at least one record"):
        run_rollout(engine, tok, TableRetriever({}), [], [], RolloutConfig())
    with pytest.raises(ValueError, match="golden_answers"):
        run_rollout(
            engine, tok, TableRetriever({}), [{"id": "x", "question": "q?"}], ["g"], RolloutConfig()
        )


def test_vllm_engine_without_vllm_says_how_to_install_it(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    from actors.engines.vllm import VLLMEngine

    with pytest.raises(ImportError, match=r"scripts/setup\.sh"):
        VLLMEngine("unused-model-path")


def test_a_missing_vllm_stops_the_engine_unless_the_config_asks_for_the_fallback(
    monkeypatch, caplog, tiny_llama_dir
):
    import importlib.util
    import logging

    from actors.engines import build as rollout
    from actors.engines.hf import HFEngine

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "vllm" else real_find_spec(name, *a),
    )
    with pytest.raises(rollout.EngineUnavailableError, match="vLLM is not installed here"):
        rollout.build_engine(str(tiny_llama_dir), RolloutConfig(engine="vllm", dtype="fp32"), 0)
    with caplog.at_level(logging.WARNING, logger="actors.engines.build"):
        engine = rollout.build_engine(
            str(tiny_llama_dir),
            RolloutConfig(engine="vllm", dtype="fp32", engine_fallback=True),
            0,
        )
    assert isinstance(engine, HFEngine)
    assert [r.getMessage() for r in caplog.records if "not installed" in r.getMessage()] == [
        "rollout.engine = 'vllm' but vLLM is not installed here: using the HF engine "
        "(rollout.engine_fallback = true)"
    ]


# ------------------------------------------------- interruptible generation (issue 30)


def interruptible_worker(tok, scripts, every_tokens: int, **cfg):
    """A RolloutWorker on the scripted engine with a table retriever (no HTTP)."""
    from actors.rollout import RolloutWorker

    engine = ScriptedEngine(tok, scripts)
    cfg = RolloutConfig(group_size=1, interrupt_every_tokens=every_tokens, **cfg)
    worker = RolloutWorker("unused", cfg, "http://127.0.0.1:9", engine=engine)
    worker.client = TableRetriever({"q": [LIMA]})
    return worker, engine


def start_loader_and_wait(worker, version: int) -> threading.Thread:
    """Call ``worker.load_weights`` on another thread (the actor's weight thread) and
    return once it waits for the gate."""
    thread = threading.Thread(target=worker.load_weights, args=({}, version), daemon=True)
    thread.start()
    while not worker.gate.update_waiting:
        time.sleep(0.001)
    return thread


def start_loader_during_first_retrieval(worker, version: int) -> list[threading.Thread]:
    """Make the worker's first ``/retrieve`` start a ``load_weights(version)`` and wait
    until it queues for the gate (an update arriving while retrieval runs, between two
    turns); the returned list gets the loader thread."""
    loaders: list[threading.Thread] = []
    retrieve = worker.client.retrieve

    def retrieve_and_start_loader(queries):
        if not loaders:
            loaders.append(start_loader_and_wait(worker, version))
        return retrieve(queries)

    worker.client.retrieve = retrieve_and_start_loader
    return loaders


TURN0 = "<think>I should look this up first.</think><search>q</search>"


def test_load_weights_returns_its_seconds_not_the_version(tok):
    """The driver adds the ack to the export time of ``stppo_weight_sync_seconds``: a
    version number there (it was) read as seconds."""
    worker, _engine = interruptible_worker(tok, {}, 0)
    took = worker.load_weights({}, 7)
    assert isinstance(took, float) and 0.0 <= took < 5.0
    assert worker.get_policy_version() == 7


def test_an_update_lands_mid_turn_and_later_tokens_carry_it(tok):
    worker, engine = interruptible_worker(tok, {"Q?": [TURN0, "<answer>Lima</answer>"]}, 4)
    threads = []

    def hook(index: int) -> None:  # during turn 0, at its first safe point (4 tokens)
        if index == 0 and len(engine.calls) == 1:
            threads.append(start_loader_and_wait(worker, 1))

    engine.safe_point_hook = hook
    (traj,) = worker.rollout([record("Q?", "Lima")])
    threads[0].join(5)
    n0, n1 = len(enc(tok, TURN0)), len(enc(tok, "<answer>Lima</answer>"))
    policy = traj.token_versions[traj.loss_mask.astype(bool)].tolist()
    assert policy == [0] * 4 + [1] * (n0 - 4) + [1] * n1  # turn 0 spans versions 0 and 1
    assert (traj.policy_version_min, traj.policy_version_max) == (0, 1)
    assert worker.last_stats.num_inflight_weight_updates == 1
    assert traj.extra["inflight_weight_updates"] == 1


def test_an_update_waiting_between_turns_lands_before_the_next_turn(tok):
    worker, _engine = interruptible_worker(tok, {"Q?": [TURN0, "<answer>Lima</answer>"]}, 1000)
    start_loader_during_first_retrieval(worker, 1)
    (traj,) = worker.rollout([record("Q?", "Lima")])
    n0 = len(enc(tok, TURN0))
    policy = traj.token_versions[traj.loss_mask.astype(bool)].tolist()
    assert policy[:n0] == [0] * n0 and set(policy[n0:]) == {1}
    assert worker.last_stats.num_inflight_weight_updates == 1


def test_with_interruption_off_a_load_waits_for_the_whole_batch(tok):
    worker, engine = interruptible_worker(tok, {"Q?": [TURN0, "<answer>Lima</answer>"]}, 0)
    threads = start_loader_during_first_retrieval(worker, 1)
    (traj,) = worker.rollout([record("Q?", "Lima")])
    threads[0].join(5)
    assert set(traj.token_versions[traj.loss_mask.astype(bool)].tolist()) == {0}
    assert worker.last_stats.num_inflight_weight_updates == 0
    assert engine.policy_version == 1  # landed after the batch
    worker.set_interrupt_every_tokens(4)  # live change, from the next rollout on
    assert worker.interrupt_every_tokens == 4
    with pytest.raises(ValueError, match=">= 0"):
        worker.set_interrupt_every_tokens(-1)


def test_a_rollout_waits_for_the_version_it_was_admitted_at(tok):
    worker, _engine = interruptible_worker(
        tok, {"Q?": ["<answer>Lima</answer>"]}, 4, weight_wait_timeout_s=0.3
    )
    with pytest.raises(TimeoutError, match="policy_version 2 did not arrive"):
        worker.rollout([record("Q?", "Lima")], min_policy_version=2)
    timer = threading.Timer(0.1, worker.load_weights, args=({}, 2))
    timer.start()
    (traj,) = worker.rollout([record("Q?", "Lima")], min_policy_version=2)
    assert traj.policy_version_min == 2 and worker.last_stats.weight_wait_s > 0.05
