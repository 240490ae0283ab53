"""Continuous batching of rollout calls (``rollout.calls_per_actor``): a call submitted
while another runs joins its next turn, each call gets back exactly what it would have got
alone, and weight updates land between turns, counted once and stamped on every token."""

from __future__ import annotations

import threading

import pytest
from rollout_fakes import TableRetriever
from scripted_engine import ScriptedEngine
from test_rollout_loop import (
    LIMA,
    TURN0,
    enc,
    record,
    start_loader_and_wait,
    start_loader_during_first_retrieval,
)

from actors.config import RolloutConfig
from actors.rollout import ContinuousBatcher, RolloutWorker, run_rollout

TWO_SEARCHES = [TURN0, TURN0, "<answer>Lima</answer>"]  # three turns
ONE_TURN = ["<answer>Lima</answer>"]
SCRIPTS = {"Long?": TWO_SEARCHES, "Short?": ONE_TURN, "Next?": [TURN0, "<answer>Lima</answer>"]}


def batcher(tok, cfg: RolloutConfig | None = None) -> tuple[ContinuousBatcher, ScriptedEngine]:
    engine = ScriptedEngine(tok, SCRIPTS)
    return ContinuousBatcher(
        engine, tok, TableRetriever({"q": [LIMA]}), cfg or RolloutConfig()
    ), engine


def same_tokens(a, b) -> bool:
    return (
        a.response_ids.tolist() == b.response_ids.tolist()
        and a.loss_mask.tolist() == b.loss_mask.tolist()
        and a.behavior_logprobs.tolist() == b.behavior_logprobs.tolist()
        and a.turn_ids.tolist() == b.turn_ids.tolist()
        and (a.reward, a.finish_reason, a.num_turns) == (b.reward, b.finish_reason, b.num_turns)
    )


def test_a_call_submitted_mid_run_shares_the_next_turns_engine_call(tok):
    b, engine = batcher(tok)
    first = b.submit([record("Long?", "Lima"), record("Short?", "Lima", "q1")], ["g0", "g1"], 1.0)
    b.step()  # turn 0 of the first call: both rows
    assert not first.done and b.num_running == 1
    second = b.submit([record("Next?", "Lima", "q2")], ["g2"], 1.0)
    b.step()  # the first call's slow episode (turn 1) and the second call's turn 0, together
    assert [len(c) for c in engine.calls] == [2, 2]
    b.step()
    assert first.done and second.done and b.num_running == 0
    (long, short), first_stats = b.result(first)
    (nxt,), second_stats = b.result(second)
    assert (first_stats.num_engine_calls, second_stats.num_engine_calls) == (3, 2)
    assert first_stats.num_searches == 2 and second_stats.num_searches == 1

    # each call's trajectories are token for token those of the call run alone
    cfg = RolloutConfig()
    for alone_records, merged in (
        ([record("Long?", "Lima"), record("Short?", "Lima", "q1")], [long, short]),
        ([record("Next?", "Lima", "q2")], [nxt]),
    ):
        alone, _ = run_rollout(
            ScriptedEngine(tok, SCRIPTS), tok, TableRetriever({"q": [LIMA]}), alone_records,
            [f"g{i}" for i in range(len(alone_records))], cfg,
        )  # fmt: skip
        assert all(same_tokens(a, m) for a, m in zip(alone, merged, strict=True))


def test_calls_of_two_temperatures_get_an_engine_call_each(tok):
    b, engine = batcher(tok)
    greedy = b.submit([record("Short?", "Lima")], ["g0"], 0.0)
    sampled = b.submit([record("Short?", "Lima", "q1")], ["g1"], 1.0)
    b.step()
    assert greedy.done and sampled.done and [len(c) for c in engine.calls] == [1, 1]


def test_result_of_a_running_call_is_an_error(tok):
    b, _ = batcher(tok)
    call = b.submit([record("Long?", "Lima")], ["g0"], 1.0)
    with pytest.raises(RuntimeError, match="has not ended"):
        b.result(call)
    with pytest.raises(ValueError, match="at least one record"):
        b.submit([], [], 1.0)


def two_call_worker(tok, calls_per_actor: int):
    engine = ScriptedEngine(tok, SCRIPTS)
    cfg = RolloutConfig(group_size=1, calls_per_actor=calls_per_actor)
    worker = RolloutWorker("unused", cfg, "http://127.0.0.1:9", engine=engine)
    worker.client = TableRetriever({"q": [LIMA]})
    return worker, engine


def test_two_rollout_calls_on_one_worker_share_turns_and_an_update_lands_between_them(tok):
    """The actor's second rollout thread submits while the first call runs: its turn 0 goes
    into the same engine call as the first call's later turn; a weight load that arrives
    meanwhile lands between two turns (calls_per_actor > 1 with interrupt_every_tokens = 0),
    is reported by one call only, and every token carries the version that produced it."""
    worker, engine = two_call_worker(tok, calls_per_actor=2)
    results: dict[str, list] = {}
    second_started = threading.Event()
    loaders: list[threading.Thread] = []
    retrieve = worker.client.retrieve

    def retrieve_then_start_second(queries):  # during the first call's turn 0 retrieval
        if not second_started.is_set():
            second_started.set()
            thread = threading.Thread(
                target=lambda: results.__setitem__("second", worker.rollout([record("Next?", "Lima", "q2")]))
            )  # fmt: skip
            thread.start()
            while worker.batcher.num_running < 2:  # the second call has been submitted
                pass
            loaders.append(start_loader_and_wait(worker, 1))
            loaders.append(thread)
        return retrieve(queries)

    worker.client.retrieve = retrieve_then_start_second
    results["first"] = worker.rollout([record("Long?", "Lima")])
    for thread in loaders:
        thread.join(10)
    (long,), (nxt,) = results["first"], results["second"]
    # engine calls: [Long t0], then [Long t1, Next t0] after the update, then [Long t2, Next t1]
    assert [len(c) for c in engine.calls] == [1, 2, 2]
    n0 = len(enc(tok, TURN0))
    policy = long.token_versions[long.loss_mask.astype(bool)].tolist()
    assert policy[:n0] == [0] * n0 and set(policy[n0:]) == {1}  # turn 0 at 0, the rest at 1
    assert (long.policy_version_min, long.policy_version_max) == (0, 1)
    assert set(nxt.token_versions[nxt.loss_mask.astype(bool)].tolist()) == {1}
    # one update landed while tokens were in flight: reported on exactly one batch
    assert long.extra["inflight_weight_updates"] + nxt.extra["inflight_weight_updates"] == 1
    assert worker.total_stats.num_inflight_weight_updates == 1
    assert worker.total_stats.num_trajectories == 2


def test_with_one_call_per_actor_a_load_still_waits_for_the_whole_call(tok):
    """calls_per_actor = 1 (the default) keeps the old behaviour: no safe point between
    turns unless interrupt_every_tokens > 0."""
    worker, engine = two_call_worker(tok, calls_per_actor=1)
    loaders = start_loader_during_first_retrieval(worker, 1)
    (long,) = worker.rollout([record("Long?", "Lima")])
    loaders[0].join(5)
    assert set(long.token_versions[long.loss_mask.astype(bool)].tolist()) == {0}
    assert engine.policy_version == 1 and worker.last_stats.num_inflight_weight_updates == 0
