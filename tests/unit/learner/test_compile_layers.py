"""Regional compilation of the decoder layers (``learner.compile_layers``,
:class:`learner.modeling.LayerCompiler`).

On the CPU the layers go through TorchDynamo and AOTAutograd (the ``aot_eager`` backend:
the graphs inductor would get, run by eager kernels), counted: inductor's C++ build of one
layer takes minutes on 2 cores. Inductor's own kernels are checked on CUDA
(``tests/gpu/test_learner_cuda.py``).
"""

from __future__ import annotations

import pytest
import torch
from learner_factories import make_tiny_learner, make_uneven_batch
from torch._dynamo.backends.registry import lookup_backend

from learner import modeling
from learner.config import PPOConfig
from learner.modeling import LayerCompiler, ValueModel, decoder_layers


@pytest.fixture
def graphs(monkeypatch: pytest.MonkeyPatch) -> list:
    """The graphs compiled from now on (each goes through ``aot_eager``); the learner's
    default backend is this one for the test."""
    torch._dynamo.reset()
    seen: list = []

    def counting(gm, example_inputs):
        seen.append(gm)
        return lookup_backend("aot_eager")(gm, example_inputs)

    monkeypatch.setattr(modeling, "COMPILE_BACKEND", counting)
    yield seen
    torch._dynamo.reset()


def _tiny_llama(layers: int = 3):
    from tiny_models import tiny_llama_config
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(512, num_hidden_layers=layers))


def _loss_and_grads(model, width: int, grad: bool = True) -> tuple[float, list[torch.Tensor]]:
    """Two rows of ``width`` tokens, the first packed with two sequences."""
    generator = torch.Generator().manual_seed(width)
    ids = torch.randint(0, 512, (2, width), generator=generator)
    positions = torch.arange(width).repeat(2, 1)
    positions[0, width // 2 :] = torch.arange(width - width // 2)
    with torch.set_grad_enabled(grad):
        logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        loss = logits.float().logsumexp(-1).mean()
    if grad:
        loss.backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def test_decoder_layers_of_a_causal_lm_and_of_the_critic():
    model = _tiny_llama(layers=3)
    assert decoder_layers(model) == list(model.model.layers)
    critic = ValueModel(model.model, 64)
    assert decoder_layers(critic) == list(model.model.layers)
    with pytest.raises(ValueError, match="no decoder layer"):
        decoder_layers(torch.nn.Linear(2, 2))


def test_one_graph_serves_every_layer_and_width(graphs):
    """Three layers, three widths (packed rows), forward and backward: the first layer's
    blocks compile at the first call, the other layers and widths reuse their graphs; the
    no-grad forward (reference, proximal) compiles its own once; losses and gradients equal
    to the eager model's; off restores the class's forward."""
    model = _tiny_llama(layers=3)
    compiler = LayerCompiler([model])
    assert compiler.blocks == [b for layer in model.model.layers for b in layer.children()]
    first = None
    for width in (30, 41, 57):
        compiler.set(False)
        want, want_grads = _loss_and_grads(model, width)
        compiler.set(True)
        got, got_grads = _loss_and_grads(model, width)
        first = len(graphs) if first is None else first
        assert got == pytest.approx(want, abs=1e-6)
        assert len(got_grads) == len(want_grads)
        for g, w in zip(got_grads, want_grads, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)
    assert first > 0
    assert len(graphs) == first, "no recompile for other layers or widths"
    _loss_and_grads(model, 20, grad=False)
    with_no_grad = len(graphs)
    assert with_no_grad > first, "the no-grad forward has graphs of its own"
    _loss_and_grads(model, 25, grad=False)
    assert len(graphs) == with_no_grad
    compiler.set(False)
    assert all("forward" not in block.__dict__ for block in compiler.blocks)
    _loss_and_grads(model, 33)
    assert len(graphs) == with_no_grad


def test_learner_compiles_its_layers_when_switched_on(graphs, tiny_llama_dir):
    """``compile_layers`` switched on between steps (as the benchmark and the control plane
    change the config): the next RL step and SFT step run the compiled layers of the policy,
    critic and reference, with the same losses as the eager learner's; switched off, no
    layer is compiled any more."""
    results = {}
    for compiled in (False, True):
        learner = make_tiny_learner(
            tiny_llama_dir, PPOConfig(), train_batch_size=6, mini_batch_size=6,
            micro_batch_size=3, pack_sequences=True,
        )  # fmt: skip
        if compiled:
            assert not graphs, "compile_layers is off by default"
            learner.config = learner.config.model_copy(update={"compile_layers": True})
        metrics = learner.step(make_uneven_batch())
        settled = len(graphs)
        if compiled:
            assert settled >= 2, "the RL step compiled the layers (with and without grad)"
        learner.step(make_uneven_batch(seed=1))
        assert len(graphs) == settled, "a second step reuses the first one's graphs"
        sft = learner.supervised_step(make_uneven_batch())
        results[compiled] = (metrics, sft)
    assert len(learner.layer_compiler.layers) == 3 * 2, "policy, critic, reference: 2 layers"
    blocks = learner.layer_compiler.blocks
    assert all("forward" in block.__dict__ for block in blocks)
    eager, compiled = results[False], results[True]
    for key in ("pg_loss", "value_loss", "approx_kl", "kl_ref", "entropy", "grad_norm"):
        want, got = eager[0][key], compiled[0][key]
        assert got == pytest.approx(want, abs=1e-6, nan_ok=True), key
    assert compiled[1].loss == pytest.approx(eager[1].loss, abs=1e-6)
    learner.config = learner.config.model_copy(update={"compile_layers": False})
    learner.supervised_step(make_uneven_batch())
    assert not any("forward" in block.__dict__ for block in blocks)
