"""Sequence packing without padding (learner/packing.py): the layout, and that every forward
(chunked log-probs and entropy, critic values, a whole learner step) gives the padded
batch's numbers in float32."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from learner_factories import (
    capture_gradients,
    make_tiny_learner,
    make_trajectory,
    make_uneven_batch,
)
from numerics import assert_gradients_close

from learner.attention import (
    VARLEN,
    segment_attention,
    set_varlen_attention,
    uses_varlen_kernel,
    varlen_kernel,
)
from learner.batch import collate_trajectories
from learner.config import GRPOConfig, LearnerConfig, PPOConfig, uses_critic
from learner.logprobs import lm_head_of, masked_token_stats
from learner.micro_batches import token_budget_micro_batches
from learner.modeling import ValueModel
from learner.packing import block_causal_mask, pack_rows, packed_inputs, padded_inputs


def test_pack_rows_docstring_example():
    assert pack_rows([3, 5, 2, 4]) == (5, [(2, 0), (0, 0), (2, 3), (1, 0)])


@pytest.mark.parametrize("seed", range(20))
def test_pack_rows_places_every_sequence_once_within_width(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 50, rng.integers(1, 30)).tolist()
    width, places = pack_rows(lengths)
    assert width == max(lengths)
    rows = 1 + max(r for r, _ in places)
    cover = np.zeros((rows, width), dtype=int)
    for (row, start), n in zip(places, lengths, strict=True):
        assert start + n <= width
        cover[row, start : start + n] += 1
    assert cover.max() == 1  # no overlap
    assert rows <= len(lengths)
    # first fit decreasing: within 11/9 of the lower bound, plus one row
    assert rows <= 11 / 9 * np.ceil(sum(lengths) / width) + 1


def test_pack_rows_rejects_bad_lengths():
    with pytest.raises(ValueError, match="positive"):
        pack_rows([])
    with pytest.raises(ValueError, match="positive"):
        pack_rows([3, 0])
    with pytest.raises(ValueError, match="width 4 is narrower than the longest sequence"):
        pack_rows([3, 5], width=4)
    assert pack_rows([3, 5, 2], width=10) == (10, [(0, 5), (0, 0), (0, 8)])


def test_packed_inputs_hand_checked():
    trajs = [
        make_trajectory([5, 6], [8, 9, 10, 11], [1, 0, 0, 1]),  # 6 tokens
        make_trajectory([7], [12, 13], [1, 1]),  # 3 tokens
        make_trajectory([3, 4], [14], [1]),  # 3 tokens
    ]
    batch = collate_trajectories(trajs, pad_token_id=0)
    packed = packed_inputs(batch)
    # width 6: row 0 = seq 0; row 1 = seq 1 then seq 2
    assert packed.packed and not padded_inputs(batch).packed
    assert packed.input_ids.tolist() == [[5, 6, 8, 9, 10, 11], [7, 12, 13, 3, 4, 14]]
    # row 0 causal; row 1 two causal blocks of 3
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    block = torch.block_diag(causal[:3, :3], causal[:3, :3])
    assert torch.equal(packed.attention_mask, torch.stack([causal, block]).unsqueeze(1))
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 0, 1, 2]]
    # the column predicting response token t: row * 6 + start + prompt - 1 + t; past a
    # row's response, its last response token's
    assert packed.state_index.tolist() == [[1, 2, 3, 4], [6, 7, 7, 7], [10, 10, 10, 10]]
    assert packed.slots == 12 and padded_inputs(batch).slots == 3 * 6
    padded = padded_inputs(batch)  # P = 2: column 1 + t of each row
    assert padded.state_index.tolist() == [[1, 2, 3, 4], [7, 8, 9, 10], [13, 14, 15, 16]]


def test_packed_rows_tail_is_a_sequence_of_its_own():
    trajs = [make_trajectory([5, 6], [8, 9, 10], [1, 1, 1]), make_trajectory([7], [12], [1])]
    packed = packed_inputs(collate_trajectories(trajs, pad_token_id=0))
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 0, 1, 2]]
    tail = packed.attention_mask[1, 0]
    assert not tail[2:, :2].any() and torch.equal(tail[2:, 2:], torch.ones(3, 3).tril().bool())


def test_block_causal_mask_equals_transformers_own(tiny_llama_dir):
    """The prepared mask of the packed layout is the one transformers builds from the
    packed positions when given none (``create_causal_mask``), and given it, transformers
    passes it through unchanged."""
    from transformers import AutoConfig
    from transformers.masking_utils import create_causal_mask

    config = AutoConfig.from_pretrained(tiny_llama_dir)
    config._attn_implementation = "sdpa"
    packed = packed_inputs(collate_trajectories(make_uneven_batch(0, 8), pad_token_id=0))
    rows, width = packed.input_ids.shape
    embeds = torch.zeros(rows, width, config.hidden_size)

    def built(attention_mask):
        return create_causal_mask(
            config=config,
            inputs_embeds=embeds,
            attention_mask=attention_mask,
            past_key_values=None,
            position_ids=packed.position_ids,
        )

    own = built(None)
    assert own.shape == (rows, 1, width, width) and own.dtype == torch.bool
    assert torch.equal(packed.attention_mask, own)
    assert built(packed.attention_mask) is packed.attention_mask
    assert torch.equal(
        block_causal_mask(torch.tensor([[0, 0, 1, 1]]))[0, 0].int(),
        torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]),
    )


def test_token_budget_counts_real_tokens_when_packed():
    prompts, responses = [10, 10, 10], [90, 20, 30]
    # packed: 40 + 30 real tokens fit 70; padded, the two take 2 * 40 = 80 slots
    assert token_budget_micro_batches(range(3), prompts, responses, 70, packed=True) == [
        [0],
        [2, 1],
    ]
    assert token_budget_micro_batches(range(3), prompts, responses, 70) == [[0], [2], [1]]


def _token_stats(model, batch, packed: bool, varlen: bool = False):
    """Chunked log-probs and entropy of the batch's policy tokens (temperature 0.9)."""
    return masked_token_stats(
        model,
        batch,
        batch.policy_token_positions(),
        lm_head_of(model),
        temperature=0.9,
        chunk_tokens=5,
        with_entropy=True,
        packed=packed,
        varlen=varlen,
    )


def test_packed_forward_equals_padded(tiny_llama_dir):
    """Log-probs, entropy and their gradients (the policy), and values (the critic) of the
    packed forward equal the padded forward's in float32; the packed batch computes fewer
    token slots."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    batch = collate_trajectories(make_uneven_batch(), pad_token_id=0)
    assert packed_inputs(batch).slots < 0.85 * padded_inputs(batch).slots
    mask = batch.loss_mask
    stats = {packed: _token_stats(model, batch, packed) for packed in (False, True)}
    torch.testing.assert_close(stats[True].logprobs, stats[False].logprobs, rtol=0, atol=1e-5)
    torch.testing.assert_close(stats[True].entropy, stats[False].entropy, rtol=0, atol=1e-5)
    params = list(model.parameters())
    cot = torch.randn(mask.shape)
    grads = {
        k: torch.autograd.grad(((s.logprobs - 0.1 * s.entropy) * cot).sum(), params)
        for k, s in stats.items()
    }
    for want, got in zip(grads[False], grads[True], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))

    critic = ValueModel(model.model, model.config.hidden_size)
    torch.nn.init.normal_(critic.value_head.weight)
    with torch.no_grad():
        values = {}
        for packed in (False, True):
            inputs = packed_inputs(batch) if packed else padded_inputs(batch)
            values[packed] = critic(
                inputs.input_ids, inputs.attention_mask, inputs.position_ids, inputs.state_index
            )
    real = batch.response_mask.bool()
    torch.testing.assert_close(values[True][real], values[False][real], rtol=0, atol=1e-5)


def test_packing_breaks_without_the_block_mask(tiny_llama_dir):
    """The packed rows only equal the padded batch because of the block-diagonal mask: a
    plain causal mask over each row, or no mask with positions counting across a row, lets
    trajectories attend to each other, which this test sees. Given no mask, transformers
    builds the same one from the restarting positions; the prepared one also holds with a
    KV cache (where transformers would not look for packed rows)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    batch = collate_trajectories(make_uneven_batch(), pad_token_id=0)
    packed = packed_inputs(batch)
    rows, width = packed.input_ids.shape
    causal = torch.ones(width, width, dtype=torch.bool).tril().expand(rows, 1, width, width)
    with torch.no_grad():
        good = model(**packed.forward_kwargs(), use_cache=False).logits
        cached = model(**packed.forward_kwargs(), use_cache=True).logits
        kwargs = {"input_ids": packed.input_ids, "use_cache": False}
        built = model(**kwargs, position_ids=packed.position_ids).logits
        plain = model(**kwargs, position_ids=packed.position_ids, attention_mask=causal).logits
        joined = model(**kwargs, position_ids=torch.arange(width).expand(rows, width)).logits
    shared = [r for r in range(rows) if (packed.position_ids[r] == 0).sum() > 1]
    assert shared, "the batch must put two trajectories in one row"
    assert torch.equal(good, built) and torch.equal(good, cached)
    assert (good - plain).abs().max() > 1e-2
    assert (good - joined).abs().max() > 1e-2


def test_varlen_layout_is_one_row_of_segments():
    """The varlen layout: every trajectory in one row, longest first, no tail; its
    segments (``cu_seq_lens``) are the trajectories' lengths, and transformers gets them
    as its flash-attention keyword arguments."""
    batch = collate_trajectories(make_uneven_batch(), pad_token_id=0)
    lengths = (batch.prompt_lengths + batch.response_lengths).tolist()
    inputs = packed_inputs(batch, varlen=True)
    assert inputs.input_ids.shape == (1, sum(lengths))
    assert inputs.slots == sum(lengths)
    ordered = sorted(lengths, reverse=True)
    assert inputs.cu_seq_lens.dtype == torch.int32
    assert inputs.cu_seq_lens.tolist() == [0, *np.cumsum(ordered).tolist()]
    assert inputs.max_length == max(lengths)
    kwargs = inputs.forward_kwargs()
    assert kwargs["cu_seq_lens_q"] is kwargs["cu_seq_lens_k"] is inputs.cu_seq_lens
    assert kwargs["max_length_q"] == kwargs["max_length_k"] == max(lengths)
    assert "cu_seq_lens_q" not in packed_inputs(batch).forward_kwargs()


def test_segment_attention_equals_block_masked_attention():
    """The CPU twin of the varlen kernel: each segment's causal attention alone equals one
    attention over all tokens with the block-diagonal causal mask (grouped-query heads)."""
    torch.manual_seed(0)
    lengths = [5, 1, 7, 3]
    total, heads, kv_heads, dim = sum(lengths), 4, 2, 8
    q = torch.randn(total, heads, dim)
    k, v = torch.randn(total, kv_heads, dim), torch.randn(total, kv_heads, dim)
    cu = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int32)
    segment = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    position = torch.arange(total)
    allowed = (segment[:, None] == segment[None, :]) & (position[:, None] >= position[None, :])
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(2, dim=1).transpose(0, 1),
        v.repeat_interleave(2, dim=1).transpose(0, 1),
        attn_mask=allowed,
    ).transpose(0, 1)
    torch.testing.assert_close(segment_attention(q, k, v, cu, None), want, rtol=0, atol=1e-6)


def test_varlen_kernel_only_on_cuda_in_16_bits():
    """torch's FlashAttention kernel computes in 16 bits on CUDA: everything else (the CPU,
    float32 on CUDA) takes the per-trajectory loop."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert not uses_varlen_kernel(cpu, torch.bfloat16)
    assert not uses_varlen_kernel(cuda, torch.float32)
    for dtype in (torch.bfloat16, torch.float16):
        assert uses_varlen_kernel(cuda, dtype) == (varlen_kernel() is not None)


def test_varlen_forward_equals_padded(tiny_llama_dir):
    """A model switched to the varlen attention: the varlen layout's log-probs, entropy,
    their gradients and the critic's values equal the padded forward's in float32; a
    padded forward of the switched model is unchanged (transformers' sdpa with the mask),
    and so is a packed one given no mask (sdpa with the mask built from the positions);
    the one row as a single segment lets trajectories attend to each other (what the
    segments prevent), and without segments its empty mask fails loudly."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    batch = collate_trajectories(make_uneven_batch(), pad_token_id=0)
    mask = batch.loss_mask
    padded = _token_stats(model, batch, packed=False)
    set_varlen_attention([model], True)
    assert model.config._attn_implementation == VARLEN
    varlen = _token_stats(model, batch, packed=True, varlen=True)
    padded_switched = _token_stats(model, batch, packed=False)
    torch.testing.assert_close(varlen.logprobs, padded.logprobs, rtol=0, atol=1e-5)
    torch.testing.assert_close(varlen.entropy, padded.entropy, rtol=0, atol=1e-5)
    torch.testing.assert_close(padded_switched.logprobs, padded.logprobs, rtol=0, atol=1e-6)
    params = list(model.parameters())
    cot = torch.randn(mask.shape)
    grads = [
        torch.autograd.grad(((s.logprobs - 0.1 * s.entropy) * cot).sum(), params)
        for s in (padded, varlen)
    ]
    for want, got in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))

    inputs = packed_inputs(batch, varlen=True)
    with torch.no_grad():
        kwargs = inputs.forward_kwargs()
        good = model(**kwargs, use_cache=False).logits
        total = inputs.input_ids.shape[1]  # one segment of every token
        kwargs.update(cu_seq_lens_q=torch.tensor([0, total], dtype=torch.int32))
        kwargs.update(cu_seq_lens_k=kwargs["cu_seq_lens_q"], max_length_q=total)
        joined = model(**kwargs, use_cache=False).logits
        for key in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
            del kwargs[key]
        # without its segments the layout's empty mask reaches sdpa, which rejects it
        with pytest.raises(RuntimeError, match="size of tensor"):
            model(**kwargs, use_cache=False)
        # the switched model given packed rows without a mask: sdpa with the mask
        # transformers builds from the positions, the prepared mask's values
        rows = packed_inputs(batch)
        prepared = model(**rows.forward_kwargs(), use_cache=False).logits
        plain = {"input_ids": rows.input_ids, "position_ids": rows.position_ids}
        torch.testing.assert_close(model(**plain, use_cache=False).logits, prepared)
    assert (good - joined).abs().max() > 1e-2

    critic = ValueModel(model.model, model.config.hidden_size)
    torch.nn.init.normal_(critic.value_head.weight)
    with torch.no_grad():
        values = critic(**inputs.forward_kwargs(), state_index=inputs.state_index)
        set_varlen_attention([critic], False)
        assert model.config._attn_implementation == "sdpa"
        plain = padded_inputs(batch)
        want = critic(**plain.forward_kwargs(), state_index=plain.state_index)
    real = batch.response_mask.bool()
    torch.testing.assert_close(values[real], want[real], rtol=0, atol=1e-5)


def test_varlen_attention_needs_packed_sequences():
    with pytest.raises(ValueError, match="packed_attention = 'varlen' needs pack_sequences"):
        LearnerConfig(packed_attention="varlen")
    LearnerConfig(packed_attention="varlen", pack_sequences=True)


LAYOUTS = {"padded": {}, "packed": {"pack_sequences": True}}
LAYOUTS["varlen"] = {**LAYOUTS["packed"], "packed_attention": "varlen"}


@pytest.mark.cpu_isa
@pytest.mark.parametrize("algorithm", [PPOConfig(), GRPOConfig()], ids=["ppo_critic", "grpo"])
def test_learner_step_losses_packed_equal_padded(algorithm, tiny_llama_dir):
    """One learner step (reference, critic, policy forwards and backwards, optimizer step)
    on uneven trajectories, padded, packed with the block mask and packed with the varlen
    attention, in float32: every loss and statistic within 1e-5, and the policy's and the
    critic's gradients within the float32 bound of two computations (``tests/numerics.py``).

    Gradients, not the updated weights: the optimizer is the same code for every layout,
    and Adam's first step, ``lr * g / (|g| + eps)``, magnifies a rounding difference in a
    near-zero ``g`` by up to ``lr / eps`` (1e5 here), so the weights would say nothing more
    than the gradients and would need a bound that large."""
    results = {}
    for layout, overrides in LAYOUTS.items():
        learner = make_tiny_learner(
            tiny_llama_dir,
            algorithm,
            train_batch_size=6,
            mini_batch_size=6,
            micro_batch_size=6,
            **overrides,
        )
        grads = capture_gradients(learner)
        metrics = learner.step(make_uneven_batch())
        assert metrics.optimizer_steps == 1
        assert set(grads) == ({"policy", "critic"} if uses_critic(algorithm) else {"policy"})
        results[layout] = (metrics, grads)
    for layout in ("packed", "varlen"):
        _check_step_equal(results["padded"], results[layout])


def _check_step_equal(padded_result, packed_result):
    padded, packed = padded_result[0], packed_result[0]
    keys = (
        "pg_loss",
        "value_loss",
        "approx_kl",
        "kl_ref",
        "entropy",
        "clip_ratio",
        "grad_norm",
        "critic_grad_norm",
        "advantage_mean",
        "advantage_std",
    )
    for key in keys:
        want, got = padded[key], packed[key]
        if isinstance(want, float) and np.isnan(want):
            assert np.isnan(got), key
            continue
        assert got == pytest.approx(want, abs=1e-5), key
    padded_grads, packed_grads = padded_result[1], packed_result[1]
    assert packed_grads.keys() == padded_grads.keys()
    # the vocabulary bounds the critic's chain too (its longest sum is shorter)
    vocab = padded_grads["policy"]["model.embed_tokens.weight"].shape[0]
    for engine, want in padded_grads.items():
        assert_gradients_close(packed_grads[engine], want, vocab, computations=2)


@pytest.mark.parametrize("layout", ["packed", "varlen"])
def test_each_micro_batch_builds_its_layout_once(layout, tiny_llama_dir, monkeypatch):
    """The forwards of one micro-batch (reference and old values in the prepare pass;
    policy and critic in training) share one packed layout: as many builds as
    micro-batches, fewer than forwards (red when every forward builds its own)."""
    import learner.packing as packing

    built: list = []
    build = packing.packed_inputs

    def counted(batch, varlen=False):
        built.append(batch)  # held, so that ids stay distinct
        return build(batch, varlen)

    monkeypatch.setattr(packing, "packed_inputs", counted)
    learner = make_tiny_learner(
        tiny_llama_dir, PPOConfig(), train_batch_size=6, mini_batch_size=6, micro_batch_size=3,
        **LAYOUTS[layout],
    )  # fmt: skip
    forwards = []
    for engine in (learner.policy_engine, learner.critic_engine, learner.reference_engine):
        engine.module.register_forward_pre_hook(lambda *_: forwards.append(1))
    learner.step(make_uneven_batch())
    assert len({id(batch) for batch in built}) == len(built) == 4  # 2 prepare + 2 train
    assert len(forwards) == 8  # reference, values; policy, critic: per micro-batch
