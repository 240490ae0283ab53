"""The vLLM engine's interruptible step loop against a fake ``LLMEngine`` (no vLLM needed):
the requests running when an update waits are aborted, the update lands, and they are
re-added with their tokens so far; each token carries (and is scored by) the version that
sampled it. The fake follows vLLM 0.32's ``add_request`` / ``step`` / ``abort_request`` /
``has_unfinished_requests`` contract with cumulative outputs (``RequestOutputKind``
default)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from actors.engines.interrupt import Interrupt
from actors.engines.protocol import SamplingParams
from actors.engines.vllm import VLLMEngine


class FakeLLMEngine:
    """Each step appends one token to every running request: token id = 100 + the
    request's total length (prompt included) so far, log-prob = -(version + 1) / 10 under
    the weights the owner holds at that step."""

    def __init__(self, owner):
        self.owner = owner
        self.requests: dict[str, dict] = {}
        self.added: list[tuple[str, int, int]] = []  # (id, prompt length, max_tokens)
        self.aborted: list[str] = []

    def add_request(self, rid, prompt, sampling):
        ids = list(prompt["prompt_token_ids"])
        self.requests[rid] = {"prompt": ids, "out": [], "lps": [], "max": sampling.max_tokens}
        self.added.append((rid, len(ids), sampling.max_tokens))

    def abort_request(self, ids):
        self.aborted += ids
        for rid in ids:
            self.requests.pop(rid)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        outs = []
        lp = -(self.owner.policy_version + 1) / 10
        for rid, r in list(self.requests.items()):
            tok = 100 + len(r["prompt"]) + len(r["out"])
            r["out"].append(tok)
            r["lps"].append({tok: SimpleNamespace(logprob=lp)})
            finished = len(r["out"]) == r["max"]
            completion = SimpleNamespace(
                token_ids=list(r["out"]), logprobs=list(r["lps"]),
                finish_reason="length" if finished else None, stop_reason=None,
            )  # fmt: skip
            outs.append(SimpleNamespace(request_id=rid, outputs=[completion], finished=finished))
            if finished:
                del self.requests[rid]
        return outs


@pytest.fixture
def engine(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(TokensPrompt=dict))
    eng = VLLMEngine.__new__(VLLMEngine)
    eng._policy_version = 0
    eng.tokenizer = SimpleNamespace(eos_token_id=None, decode=lambda ids, **kw: "")
    eng.llm = SimpleNamespace(llm_engine=FakeLLMEngine(eng))
    monkeypatch.setattr(
        eng, "_sampling_params", lambda params, row: SimpleNamespace(max_tokens=0, seed=None)
    )
    eng.load_weights = lambda state_dict, version: setattr(eng, "_policy_version", version)
    return eng


def test_requests_in_flight_resume_under_the_new_weights(engine):
    checks = []

    def pending():  # the 2nd check (after 6 steps) finds an update waiting
        checks.append(1)
        return len(checks) == 2

    def safe_point():
        engine.load_weights({}, 1)

    params = SamplingParams(max_new_tokens=10, temperature=1.0, stop=())
    results = engine.generate(
        [[1, 2, 3], [4, 5]], params, interrupt=Interrupt(3, safe_point, pending)
    )
    fake = engine.llm.llm_engine
    assert fake.aborted == ["stppo-1-0-1", "stppo-1-1-1"]
    # re-added with prompt + 6 tokens so far and the 4 tokens left
    assert fake.added[2:] == [("stppo-1-0-2", 9, 4), ("stppo-1-1-2", 8, 4)]
    for prompt, r in zip([[1, 2, 3], [4, 5]], results, strict=True):
        # the same sequence as without interruption (the fake is deterministic in the prefix)
        assert r.token_ids == [100 + len(prompt) + k for k in range(10)]
        assert r.token_versions == [0] * 6 + [1] * 4
        assert r.logprobs == pytest.approx([-0.1] * 6 + [-0.2] * 4)
        assert (r.finish_reason, r.policy_version) == ("length", 0)


def test_no_update_waiting_means_no_abort(engine):
    params = SamplingParams(max_new_tokens=7, temperature=1.0, stop=())
    results = engine.generate([[1, 2]], params, interrupt=Interrupt(2, lambda: None, lambda: False))
    assert engine.llm.llm_engine.aborted == []
    assert results[0].token_versions == [0] * 7 and len(results[0].token_ids) == 7
