"""The HF engine generating on CUDA, checked against the DeepSpeed learner on CUDA.

What the CPU contract tests (``tests/integration/test_engines_contract.py``, engine on the
CPU) cannot check: that ``HFEngine(device="cuda")`` runs the model on the GPU and that its
behaviour log-probs equal the learner's own (the importance ratio of a fresh batch is 1 up
to numerics), through the learner's log-prob paths (chunked, and the full-vocabulary
``response_logits``) on the policy engine and
through its step (``train_logprob_gap``, the mean |behaviour - learner| log-prob of
staleness-0 tokens); and that weights exported by the learner after a step load into the
CUDA engine and keep the two in agreement.

Tolerances are those of the CPU contract tests (measured there: fp32 max 1.5e-5, bf16 mean
0.04, max 0.25). Measured on an H200 (``scripts/gpu_smoke.sh --learner``, 2026-11-26;
recorded as junit properties): fp32 mean 1.4e-6, max 1.1e-5; bf16 mean 1.0e-6, max 1.9e-6,
both paths. Before ``response_logits`` divided by the temperature in float32 its bf16 gap was
mean 0.026, max 0.14-0.18 (H100 and H200). Engine that ignores the temperature: mean gap
0.31; ``load_weights`` that copies nothing: 1.3.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from learner_factories import make_trajectory
from tiny_models import peaked_llama, save_model
from transformers import AutoTokenizer

from actors.engines.hf import HFEngine
from actors.engines.protocol import SamplingParams
from actors.trajectory import Trajectory
from learner.batch import collate_trajectories
from learner.config import LearnerConfig, STPPOConfig
from learner.modeling import response_logits, token_logprobs
from learner.trainer import Learner

pytestmark = [pytest.mark.gpu, pytest.mark.integration]

TOLERANCES = {  # dtype -> (mean, max) |engine - learner| log-prob per sampled token
    "fp32": (1e-5, 1e-4),
    "bf16": (0.06, 0.4),
}
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
QUESTIONS = ["What is the capital of Peru?", "Hi", "Name three rivers in South America.", "2+2?"]


@pytest.fixture(scope="module")
def peaked_llama_dir(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Path:
    """A random 2-layer Llama (head_dim 64) with SmolLM2's tokenizer and peaked,
    prompt-dependent logits (scaled embeddings and untied output layer), saved in fp32."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    return save_model(peaked_llama(tok, seed=0), tok, tmp_path_factory.mktemp("peaked_llama"))


def prompts(tok) -> list[list[int]]:
    return [
        tok.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=True, add_generation_prompt=True
        )["input_ids"]
        for q in QUESTIONS
    ]


def rollout(engine: HFEngine, temperature: float, version: int) -> list[Trajectory]:
    """One response per prompt from ``engine``, as fresh (staleness-0) trajectories."""
    ps = prompts(engine.tokenizer)
    params = SamplingParams(max_new_tokens=24, temperature=temperature, stop=(), seed=3)
    out = []
    for i, (p, r) in enumerate(zip(ps, engine.generate(ps, params), strict=True)):
        assert len(r.token_ids) > 0 and r.policy_version == version
        traj = make_trajectory(
            p,
            r.token_ids,
            [1] * len(r.token_ids),
            r.logprobs,
            reward=float(i % 2),
            group_id=f"g{i // 2}",
        )
        traj.policy_version_min = traj.policy_version_max = version
        out.append(traj.validate())
    return out


def logprob_gaps(
    learner: Learner, trajectories: list[Trajectory], *, full_vocab: bool = False
) -> torch.Tensor:
    """|behaviour - learner policy| log-prob of every policy token, float32 [N] on CPU, by
    the learner's own log-prob path (chunked through the LM head by default), or with
    ``full_vocab`` by the full-vocabulary logits (``response_logits``)."""
    batch = collate_trajectories(trajectories, learner.pad_token_id).to(learner.device)
    with torch.no_grad():
        if full_vocab:
            logits = response_logits(learner.policy_engine, batch, learner.temperature)
            learner_logp = token_logprobs(logits, batch.response_ids)
        else:
            learner_logp = learner._logprobs(learner.policy_engine, batch)
    mask = batch.loss_mask.bool()
    return (batch.behavior_logprobs - learner_logp)[mask].abs().float().cpu()


def assert_close_gaps(gaps: torch.Tensor, dtype: str, record_property, name: str) -> None:
    mean_tol, max_tol = TOLERANCES[dtype]
    assert gaps.numel() > 0
    record_property(f"{name}_gap_mean", gaps.mean().item())  # into the junit report
    record_property(f"{name}_gap_max", gaps.max().item())
    assert gaps.mean().item() < mean_tol and gaps.max().item() < max_tol, (
        f"{dtype}: mean {gaps.mean().item():.2e}, max {gaps.max().item():.2e}"
    )


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cuda_engine_logprobs_equal_the_cuda_learner_before_and_after_a_step(
    peaked_llama_dir: Path, dtype: str, record_property
):
    temperature = 0.7
    engine = HFEngine(peaked_llama_dir, dtype=TORCH_DTYPES[dtype], device="cuda", seed=0)
    assert engine.device.type == "cuda"
    assert {p.device.type for p in engine.model.parameters()} == {"cuda"}
    config = LearnerConfig(
        dtype=dtype,
        zero_stage=2,
        train_batch_size=4,
        mini_batch_size=2,
        micro_batch_size=2,
        actor_lr=1e-3,
        critic_lr=1e-3,
    )
    learner = Learner(
        peaked_llama_dir, config, STPPOConfig(off_policy="decoupled"), temperature=temperature
    )
    assert learner.device.type == "cuda"

    trajectories = rollout(engine, temperature, version=0)
    gaps = logprob_gaps(learner, trajectories)
    assert_close_gaps(gaps, dtype, record_property, "before_step")
    # the full-vocabulary path (models the chunked path cannot take) agrees as closely
    full = logprob_gaps(learner, trajectories, full_vocab=True)
    assert_close_gaps(full, dtype, record_property, "full_vocab")
    metrics = learner.step(trajectories)  # its prepare stage measures the same gap
    assert metrics.skipped_steps == 0 and metrics.policy_version == 1
    assert metrics.train_logprob_gap == pytest.approx(gaps.mean().item(), rel=0.25, abs=1e-5)

    # weight sync: the learner's exported (CPU) weights into the CUDA engine
    export = learner.export_weights()
    engine.load_weights(export.state_dict, export.policy_version)
    after = logprob_gaps(learner, rollout(engine, temperature, version=1))
    assert_close_gaps(after, dtype, record_property, "after_load")


def test_build_engine_puts_the_hf_engine_on_the_gpu(tiny_llama_dir: Path):
    """A rollout actor that sees a GPU (``ray.rollout_actor_gpus > 0``) generates on it:
    ``build_engine`` used to leave the HF engine on the CPU whatever the device."""
    from actors.config import RolloutConfig
    from actors.engines.build import build_engine

    engine = build_engine(str(tiny_llama_dir), RolloutConfig(engine="hf", dtype="bf16"), seed=0)
    assert engine.device.type == "cuda"
    assert next(engine.model.parameters()).device.type == "cuda"
