"""The ``collective`` weight-sync transport on CPU (gloo): learner -> vLLM-CPU and HF engines.

Three real processes join one :class:`actors.weight_group.WeightGroup`: rank 0 holds a tiny
Llama's *new* weights and broadcasts them tensor by tensor; ranks 1 and 2 are a vLLM-CPU
engine and an HF engine started from the *old* weights, which receive the broadcast and
load it in place. Each engine then generates from fixed prompts, and its log-probs must be
the new weights' log-probs as the learner computes them (the contract tests' bf16 bounds).
The same code runs with nccl on CUDA (``tests/gpu``).
"""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest
import torch
from test_engines_contract import (
    HAS_VLLM,
    LOGPROB_MAX_ATOL_BF16,
    LOGPROB_MEAN_ATOL_BF16,
    build_tiny,
    learner_logprobs,
    prompts,
)
from transformers import AutoTokenizer, LlamaForCausalLM

from actors.weight_group import tensor_metas

pytestmark = [pytest.mark.integration, pytest.mark.vllm]
TIMEOUT_S = 240.0


def _sender(ports: mp.Queue, world: int, new_dir: str, out: mp.Queue) -> None:
    from actors.weight_group import WeightGroup, bind_master_store

    store = bind_master_store(TIMEOUT_S)  # bound once, then its port is handed over
    for _ in range(world - 1):
        ports.put(store.port)
    model = LlamaForCausalLM.from_pretrained(new_dir, dtype=torch.bfloat16)
    state = model.state_dict()
    group = WeightGroup("127.0.0.1", store.port, 0, world, "gloo", TIMEOUT_S, store=store)
    sent = group.send(state, tensor_metas(state), version=7)
    out.put(("sender", sent))
    group.close()


def _receiver(kind: str, rank: int, ports, world: int, old_dir: str, metas, ps, out) -> None:
    from actors.engines.protocol import SamplingParams
    from actors.weight_group import WeightGroup

    if kind == "hf":
        from actors.engines.hf import HFEngine

        engine = HFEngine(old_dir, dtype=torch.bfloat16)
    else:
        from actors.engines.vllm import VLLMEngine

        engine = VLLMEngine(old_dir, max_model_len=1024, kv_cache_gib=0.25)
    port = ports.get(timeout=TIMEOUT_S)
    group = WeightGroup("127.0.0.1", port, rank, world, "gloo", TIMEOUT_S)
    version, tensors = group.receive(metas)
    engine.load_weights(dict(tensors), version)
    group.close()
    results = engine.generate(
        ps, SamplingParams(max_new_tokens=16, temperature=1.0, stop=(), seed=11)
    )
    out.put((kind, [(r.token_ids, r.logprobs, r.policy_version) for r in results]))


@pytest.mark.skipif(not HAS_VLLM, reason="vllm not installed")
def test_broadcast_reaches_vllm_and_hf_engines_and_their_logprobs_are_the_learners(
    tmp_path: Path, model_dir: Path
):
    tok = AutoTokenizer.from_pretrained(model_dir)
    old_dir = build_tiny(tmp_path / "old", tok, seed=0)
    new_dir = build_tiny(tmp_path / "new", tok, seed=1)
    new_model = LlamaForCausalLM.from_pretrained(new_dir, dtype=torch.bfloat16).eval()
    metas = tensor_metas(new_model.state_dict())
    ps = prompts(tok)

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    ports, world = ctx.Queue(), 3
    procs = [
        ctx.Process(target=_sender, args=(ports, world, str(new_dir), out)),
        ctx.Process(target=_receiver, args=("vllm", 1, ports, world, str(old_dir), metas, ps, out)),
        ctx.Process(target=_receiver, args=("hf", 2, ports, world, str(old_dir), metas, ps, out)),
    ]
    for p in procs:
        p.start()
    try:
        results = dict(out.get(timeout=TIMEOUT_S) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0, 0]
    expected_bytes = sum(t.numel() * t.element_size() for t in new_model.state_dict().values())
    assert results["sender"] == expected_bytes

    for kind in ("vllm", "hf"):
        gaps = []
        for prompt, (token_ids, logprobs, version) in zip(ps, results[kind], strict=True):
            assert version == 7
            gaps.append(
                (torch.tensor(logprobs) - learner_logprobs(new_model, prompt, token_ids)).abs()
            )
        gap = torch.cat(gaps)
        assert gap.mean().item() < LOGPROB_MEAN_ATOL_BF16, (kind, gap.mean().item())
        assert gap.max().item() < LOGPROB_MAX_ATOL_BF16, (kind, gap.max().item())
