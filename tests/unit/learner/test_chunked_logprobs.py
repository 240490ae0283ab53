"""Chunked log-probs and entropy (learner.logprobs) == the full-vocabulary path, values and
gradients, in float32 and bfloat16, with and without temperature and bias; and the masked
per-token wrapper on a tiny HF model == response_logits + token_logprobs."""

from __future__ import annotations

import pytest
import torch
from learner_factories import make_batch

from learner import losses
from learner.batch import collate_trajectories
from learner.logprobs import chunked_logprobs, lm_head_of, masked_token_stats
from learner.modeling import response_logits, token_logprobs


def full_path(hidden, weight, bias, labels, temperature):
    """The full-vocabulary path: logits in the model dtype, then / T in float32 (as the
    chunked path does; the learner's old path divided bf16 logits in bf16, which rounds
    them once more)."""
    logits = torch.nn.functional.linear(hidden, weight, bias).float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = token_logprobs(logits.unsqueeze(0), labels.unsqueeze(0))[0]
    entropy = losses.entropy_from_logits(logits.unsqueeze(0).float())[0]
    return logp, entropy


def inputs(dtype, with_bias, seed=0, num=37, hidden_size=16, vocab=101):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num, hidden_size, generator=gen).to(dtype).requires_grad_(True)
    weight = (torch.randn(vocab, hidden_size, generator=gen) * 0.7).to(dtype).requires_grad_(True)
    bias = (torch.randn(vocab, generator=gen)).to(dtype).requires_grad_(True) if with_bias else None
    labels = torch.randint(0, vocab, (num,), generator=gen)
    g_lp = torch.randn(num, generator=gen)
    g_h = torch.randn(num, generator=gen)
    return hidden, weight, bias, labels, g_lp, g_h


def grads(tensors, outputs, cotangents):
    live = [t for t in tensors if t is not None]
    return torch.autograd.grad(outputs, live, cotangents)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("temperature", "with_bias"), [(1.0, False), (0.7, True)])
@pytest.mark.parametrize("chunk", [1, 8, 1000])
def test_chunked_equals_full(dtype, temperature, with_bias, chunk):
    hidden, weight, bias, labels, g_lp, g_h = inputs(dtype, with_bias)
    want_lp, want_h = full_path(hidden, weight, bias, labels, temperature)
    got_lp, got_h = chunked_logprobs(
        hidden, weight, labels, bias=bias, temperature=temperature, chunk_tokens=chunk,
        with_entropy=True,
    )  # fmt: skip
    tol = {"rtol": 1e-5, "atol": 5e-5} if dtype == torch.float32 else {"rtol": 0, "atol": 2e-2}
    torch.testing.assert_close(got_lp, want_lp, **tol)
    torch.testing.assert_close(got_h, want_h, **tol)
    params = (hidden, weight, bias)
    want = grads(params, (want_lp, want_h), (g_lp, g_h))
    got = grads(params, (got_lp, got_h), (g_lp, g_h))
    for w, g in zip(want, got, strict=True):
        assert g.dtype == w.dtype
        scale = float(w.float().abs().max())
        gtol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(g.float(), w.float(), rtol=0, atol=gtol * scale)


def test_entropy_not_used_gives_logprob_gradient_only():
    hidden, weight, _, labels, g_lp, _ = inputs(torch.float32, False)
    want_lp, _ = full_path(hidden, weight, None, labels, 1.0)
    got_lp, got_h = chunked_logprobs(hidden, weight, labels, chunk_tokens=5, with_entropy=True)
    want = grads((hidden, weight), want_lp, g_lp)
    got = grads((hidden, weight), got_lp, g_lp)  # entropy computed but not in the loss
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    _, none = chunked_logprobs(hidden, weight, labels, chunk_tokens=5)
    assert none is None and got_h.shape == labels.shape


def test_rejects_bad_arguments():
    hidden, weight, _, labels, _, _ = inputs(torch.float32, False)
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_logprobs(hidden, weight, labels, chunk_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        chunked_logprobs(hidden, weight, labels, temperature=0.0)
    with pytest.raises(ValueError, match="labels"):
        chunked_logprobs(hidden, weight, labels[:-1])


def test_masked_token_stats_equals_full_model_path(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    head = lm_head_of(model)
    assert head is not None
    batch = collate_trajectories(make_batch(3), pad_token_id=0)
    mask = batch.loss_mask
    logits = response_logits(model, batch, temperature=0.8)
    want_lp = token_logprobs(logits, batch.response_ids) * mask
    want_h = losses.entropy_from_logits(logits) * mask
    stats = masked_token_stats(
        model,
        batch,
        batch.policy_token_positions(),
        head,
        temperature=0.8,
        chunk_tokens=7,
        with_entropy=True,
    )
    torch.testing.assert_close(stats.logprobs, want_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stats.entropy, want_h, rtol=1e-5, atol=1e-5)
    assert (stats.logprobs[mask == 0] == 0).all()
    params = [p for p in model.parameters()]
    cot = torch.randn(mask.shape)
    want = torch.autograd.grad(((want_lp - 0.1 * want_h) * cot).sum(), params)
    got = torch.autograd.grad(((stats.logprobs - 0.1 * stats.entropy) * cot).sum(), params)
    for w, g in zip(want, got, strict=True):  # fp32 sums in another order: 1e-5 of the max
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5 * float(w.abs().max()))


def test_bf16_model_paths_agree_at_a_temperature(tiny_llama_dir):
    """In bf16 both paths take the LM head's bf16 output to float32 before dividing by the
    temperature, as the engines do; a bf16 division rounded the full path's logits again
    (0.026 mean log-prob gap to the CUDA engine on an H200), here up to 1.7e-3 off the
    chunked path on the tiny model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16)
    head = lm_head_of(model)
    batch = collate_trajectories(make_batch(3), pad_token_id=0)
    mask = batch.loss_mask
    with torch.no_grad():
        full = token_logprobs(response_logits(model, batch, temperature=0.7), batch.response_ids)
        positions = batch.policy_token_positions()
        chunked = masked_token_stats(model, batch, positions, head, temperature=0.7, chunk_tokens=7)
    gap = ((full - chunked.logprobs).abs() * mask).max().item()
    assert gap < 1e-4, f"bf16 full vs chunked log-prob gap {gap:.2e} at temperature 0.7"
