"""The HF engine benchmark's merge mode (benchmarks/hf_engine.py --merge-contexts): the
contexts it builds and the speed-up it reports, on a tiny random Llama on CPU."""

from __future__ import annotations

import argparse
import statistics

import pytest
import torch
from script_modules import load_script

from actors.engines.hf import HFEngine
from actors.engines.protocol import SamplingParams
from services.env import PROJECT_ROOT

_bench = load_script(PROJECT_ROOT / "benchmarks" / "hf_engine.py", "hf_engine_benchmark")


@pytest.fixture(scope="module")
def engine(tiny_llama_dir) -> HFEngine:
    return HFEngine(tiny_llama_dir, dtype=torch.float32, device="cpu", seed=0)


def test_context_prompts_are_chat_prompts_of_the_asked_length(engine: HFEngine) -> None:
    prompts = _bench.context_prompts(engine, batch=3, tokens=120)
    assert [len(p) for p in prompts] == [120, 120, 120]
    chat = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": _bench.QUESTIONS[1]}],
        tokenize=True,
        add_generation_prompt=True,
    )["input_ids"]
    assert prompts[1][: len(chat)] == chat  # the question's chat prompt, then passage text
    with pytest.raises(ValueError, match="shorter than the chat prompt"):
        _bench.context_prompts(engine, batch=1, tokens=5)


def test_merge_speedup_is_sequential_over_merged_seconds(engine: HFEngine) -> None:
    args = argparse.Namespace(merge_contexts="60,120", batch=2, repeats=3)
    params = SamplingParams(max_new_tokens=4, temperature=1.0, stop=(), seed=3)
    out = _bench.measure_merge(engine, params, args)
    seconds = out["seconds_all"]
    assert [len(v) for v in seconds.values()] == [3, 3, 3]
    sequential = [a + b for a, b in zip(seconds["a"], seconds["b"], strict=True)]
    assert out["sequential_s"] == statistics.median(sequential)
    assert out["merged_s"] == statistics.median(seconds["merged"])
    assert out["merge_speedup"] == pytest.approx(out["sequential_s"] / out["merged_s"])
    assert out["contexts"] == [60, 120]
    assert out["merged_tokens_per_s"] > 0 and out["sequential_tokens_per_s"] > 0
