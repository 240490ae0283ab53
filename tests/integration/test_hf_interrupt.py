"""Interruptible generation with the real HF engine (a random 2-layer Llama, fp32).

An update applied at a safe point mid-turn changes the version of the later tokens only,
and their behaviour log-probs are the new weights' (teacher-forced forward over
``prompt + tokens``), the earlier ones the old weights'. Without an update, the
interruptible loop reproduces ``generate`` (greedy tokens equal, log-probs to 1e-5).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from actors.engines.hf import HFEngine
from actors.engines.interrupt import Interrupt, WeightGate
from actors.engines.protocol import SamplingParams

pytestmark = pytest.mark.integration

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9]]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return HFEngine(tiny_llama_dir, dtype=torch.float32, seed=0)


def perturbed(engine: HFEngine, seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """The engine's weights plus N(0, scale^2) noise: a policy visibly different."""
    g = torch.Generator().manual_seed(seed)
    return {
        n: p.detach() + scale * torch.randn(p.shape, generator=g)
        for n, p in engine.model.named_parameters()
    }


def teacher_forced_logprobs(engine: HFEngine, prompt: list[int], tokens: list[int]) -> list[float]:
    """log pi(tokens[i] | prompt + tokens[:i]) under the engine's current weights (T = 1)."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = engine.model(input_ids=ids).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return logp.gather(1, torch.tensor(tokens)[:, None]).squeeze(1).tolist()


def test_interruptible_loop_without_updates_matches_generate(engine):
    params = SamplingParams(max_new_tokens=12, temperature=0.0, stop=())
    plain = engine.generate(PROMPTS, params)
    calls = []
    chunked = engine.generate(PROMPTS, params, interrupt=Interrupt(4, lambda: calls.append(1)))
    assert len(calls) == 2  # after tokens 4 and 8 (not after the last one)
    for a, b in zip(plain, chunked, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
        assert b.token_versions == [engine.policy_version] * len(b.token_ids)


def test_update_mid_turn_versions_later_tokens_and_their_logprobs_are_the_new_weights(engine):
    old = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    start = engine.policy_version
    new = perturbed(engine, seed=1)
    calls = 0

    def safe_point() -> None:  # the 2nd safe point (after 8 tokens) applies the update
        nonlocal calls
        calls += 1
        if calls == 2:
            engine.load_weights(new, start + 1)

    params = SamplingParams(max_new_tokens=16, temperature=1.0, stop=(), seed=3)
    try:
        results = engine.generate(PROMPTS, params, interrupt=Interrupt(4, safe_point))
        for prompt, r in zip(PROMPTS, results, strict=True):
            n = len(r.token_ids)
            assert n == 16  # the random model did not end early (else this test is moot)
            assert r.policy_version == start
            assert r.token_versions == [start] * 8 + [start + 1] * 8
            # the later tokens' log-probs: the new weights', the whole prefix recomputed
            assert r.logprobs[8:] == pytest.approx(
                teacher_forced_logprobs(engine, prompt, r.token_ids)[8:], abs=1e-4
            )
            # ... and clearly not the old weights'
            engine.load_weights(old, start + 1)
            before = teacher_forced_logprobs(engine, prompt, r.token_ids)
            assert r.logprobs[:8] == pytest.approx(before[:8], abs=1e-4)
            assert max(abs(a - b) for a, b in zip(r.logprobs[8:], before[8:], strict=False)) > 1e-2
            engine.load_weights(new, start + 1)
    finally:
        engine.load_weights(old, engine.policy_version)


def test_a_loader_thread_lands_at_a_safe_point_through_the_gate(engine):
    """The rollout thread holds the gate; a loader thread waits for it and gets in at the
    next safe point, mid-generation; the loader returns once the weights are in."""
    gate = WeightGate()
    old = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    start = engine.policy_version
    new = perturbed(engine, seed=2)
    loaded = threading.Event()
    seen: list[int] = []

    def safe_point() -> None:
        seen.append(engine.policy_version)
        if len(seen) == 1:  # start the loader and wait until it waits for the gate
            threading.Thread(target=load, daemon=True).start()
            while not gate.update_waiting:
                time.sleep(0.001)
        gate.safe_point()

    def load() -> None:
        with gate.updating():
            engine.load_weights(new, start + 1)
        loaded.set()

    params = SamplingParams(max_new_tokens=12, temperature=1.0, stop=(), seed=5)
    try:
        with gate.generating():
            results = engine.generate(PROMPTS, params, interrupt=Interrupt(4, safe_point))
        assert loaded.wait(5)
        assert gate.num_inflight_updates == 1
        for r in results:
            assert r.token_versions == [start] * 4 + [start + 1] * 8
    finally:
        engine.load_weights(old, engine.policy_version)


def test_without_safe_points_a_load_waits_for_the_batch(engine):
    gate = WeightGate()
    params = SamplingParams(max_new_tokens=6, temperature=0.0, stop=())
    same = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    start = engine.policy_version
    done = threading.Event()

    def load() -> None:
        with gate.updating():
            engine.load_weights(same, start + 1)
        done.set()

    with gate.generating():
        threading.Thread(target=load, daemon=True).start()
        while not gate.update_waiting:
            time.sleep(0.001)
        results = engine.generate(PROMPTS, params)  # no interrupt: no safe point
        assert not done.is_set()
    assert done.wait(5)
    assert gate.num_inflight_updates == 0 and gate.num_updates == 1
    assert all(r.token_versions == [start] * 6 for r in results)
