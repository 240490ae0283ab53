"""The DeepSpeed learner end to end on the tiny Llama (real DeepSpeed engines, gloo, CPU)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import deepspeed
import numpy as np
import pytest
import torch
from learner_factories import make_batch
from transformers import AutoModelForCausalLM

from learner.batch import EmptyBatchError
from learner.config import VARIANT_CONFIGS, LearnerConfig, PPOConfig, STPPOConfig
from learner.trainer import Learner

pytestmark = pytest.mark.integration


def policy_state(learner: Learner) -> dict[str, torch.Tensor]:
    """Full policy weights (gathered under ZeRO-3)."""
    return learner.export_weights().state_dict


def critic_state(learner: Learner) -> dict[str, torch.Tensor]:
    """Full critic weights (gathered under ZeRO-3)."""
    module = learner.critic_engine.module
    with deepspeed.zero.GatheredParameters(
        list(module.parameters()), enabled=learner.config.zero_stage == 3
    ):
        return {k: v.detach().clone() for k, v in module.state_dict().items()}


def learner_dtype(learner: Learner) -> torch.dtype:
    """The dtype the learner's weights are in (``dtype = "auto"``: bf16 or fp32 by the CPU)."""
    return learner.dtype_choice.torch_dtype


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def learner_config(**overrides) -> LearnerConfig:
    base = dict(
        train_batch_size=4, mini_batch_size=2, micro_batch_size=1, actor_lr=1e-3, critic_lr=1e-3
    )
    return LearnerConfig(**{**base, **overrides})


@pytest.fixture(scope="module")
def learner(tiny_llama_dir: Path) -> Learner:
    # ratios against the behaviour log-probs, which make_batch draws far from the model's,
    # so tokens clip from the first mini-batch on (decoupled PPO would start at ratio 1)
    return Learner(tiny_llama_dir, learner_config(), STPPOConfig(off_policy="behavior"), seed=0)


@pytest.mark.cpu_isa
def test_two_steps_update_weights_and_export_loads_into_hf(learner: Learner, tiny_llama_dir):
    before = policy_state(learner)
    version = learner.policy_version
    first = learner.step(make_batch(0))
    second = learner.step(make_batch(1))
    assert (first.policy_version, second.policy_version) == (version + 1, version + 2)
    assert learner.policy_version == version + 2
    # StepMetrics reads as a Mapping (the driver logs dict(metrics))
    assert dict(first)["policy_version"] == version + 1 and first.get("skipped_steps") == 0
    # mini-batches of 2 out of 4 trajectories: 2 optimizer steps per learner step, none skipped
    assert first.optimizer_steps == 2 and first.skipped_steps == 0
    assert not same(before, policy_state(learner))
    for m in (first, second):
        for name in (
            "clip_ratio",
            "approx_kl",
            "kl_ref",
            "entropy",
            "pg_loss",
            "value_loss",
            "grad_norm",
            "clip_bias_norm",
            "clip_bias_scale",
            "tokens_per_s",
        ):
            assert math.isfinite(getattr(m, name)), name
        assert m.reward_mean == 0.5 and m.success_rate == 0.5
        assert m.num_turns_mean == 2.0 and m.response_tokens_mean == 10.0
    assert first.clip_ratio > 0.0  # behaviour log-probs far from the model's

    export = learner.export_weights()
    assert export.policy_version == learner.policy_version
    # the dtype the learner trains in ("auto": bf16 or fp32, by the CPU), so the export loads
    # without a cast and the logits compare bit for bit
    fresh = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=learner_dtype(learner))
    fresh.load_state_dict(export.state_dict, strict=True)
    assert {t.dtype for t in export.state_dict.values()} == {learner_dtype(learner)}
    ids = torch.tensor([[1, 50, 60, 70, 80, 90]])
    with torch.no_grad():
        expected = learner.policy_engine.module(input_ids=ids).logits
        got = fresh(input_ids=ids).logits
    assert torch.equal(expected, got)
    # clones: contiguous CPU tensors that do not alias the engine's parameters
    engine_ptrs = {p.data_ptr() for p in learner.policy_engine.module.parameters()}
    for tensor in export.state_dict.values():
        assert tensor.is_contiguous() and tensor.device.type == "cpu"
        assert tensor.data_ptr() not in engine_ptrs


def test_retrieval_failed_trajectories_are_excluded_and_counted(learner: Learner):
    batch = make_batch(2)
    batch[3].retrieval_failed = True
    metrics = learner.step(batch)
    assert metrics.num_trajectories == 3
    assert metrics.num_excluded_retrieval_failed == 1
    for traj in batch:
        traj.retrieval_failed = True
    version = learner.policy_version
    with pytest.raises(EmptyBatchError, match="4 retrieval failed"):
        learner.step(batch)
    assert learner.policy_version == version


def test_every_variant_runs_one_step_and_switches_live(learner: Learner):
    for variant, cls in VARIANT_CONFIGS.items():
        critic_before = critic_state(learner)
        learner.set_algorithm(cls(off_policy="behavior"))
        metrics = learner.step(make_batch(3))
        assert metrics.variant == variant
        assert metrics.skipped_steps == 0 and math.isfinite(metrics.pg_loss)
        if variant in ("grpo", "so_grpo"):
            # no critic: value loss not computed, critic weights untouched
            assert metrics.value_loss == 0.0
            assert same(critic_before, critic_state(learner))
        else:
            assert metrics.value_loss > 0.0
            assert not same(critic_before, critic_state(learner))
        if variant in ("s_ppo", "st_ppo", "so_grpo"):
            assert 0.0 < metrics.clip_bias_scale <= 1.0
        else:
            assert metrics.clip_bias_scale == 1.0
    learner.set_algorithm(
        STPPOConfig(off_policy="behavior", token_log_ratio_bound=None, bias_norm="param", tau=1e-6)
    )
    metrics = learner.step(make_batch(4))
    # tau far below ||C||: the triggered scale tau / ||C|| is < 1 (one per optimizer step)
    assert metrics.clip_bias_norm > 0.0 and metrics.clip_bias_scale < 1.0
    learner.set_algorithm(STPPOConfig(off_policy="behavior"))


def test_set_lr_changes_optimizer_learning_rates(learner: Learner):
    learner.set_lr(actor_lr=2e-4, critic_lr=3e-4)
    assert learner.learning_rates() == {"actor_lr": 2e-4, "critic_lr": 3e-4}
    assert learner.policy_engine.get_lr() == [2e-4]
    learner.set_lr(actor_lr=1e-3, critic_lr=1e-3)
    with pytest.raises(ValueError, match="> 0"):
        learner.set_lr(actor_lr=0.0)


def test_lr_warmup_scales_the_first_updates_and_restores_the_rates(tiny_llama_dir):
    """With ``lr_warmup_steps = 4`` the first step moves the policy a quarter as far as the
    same step without warm-up (AdamW's first update is linear in lr), and the configured
    rates are back afterwards."""
    moved = {}
    for warmup in (0, 4):
        learner = Learner(
            tiny_llama_dir, learner_config(mini_batch_size=4, lr_warmup_steps=warmup),
            PPOConfig(), seed=0,
        )  # fmt: skip
        before = policy_state(learner)
        assert learner.lr_warmup_factor() == (1.0 if warmup == 0 else 0.25)
        learner.step(make_batch(seed=1))
        after = policy_state(learner)
        moved[warmup] = sum(float((after[k] - before[k]).abs().sum()) for k in before)
        assert learner.learning_rates() == {"actor_lr": 1e-3, "critic_lr": 1e-3}
        assert learner.lr_warmup_factor() == (1.0 if warmup == 0 else 0.5)
    assert moved[4] == pytest.approx(moved[0] / 4, rel=0.02)


@pytest.mark.cpu_isa
def test_checkpoint_round_trip_restores_weights_optimizer_step_and_version(
    learner: Learner, tmp_path: Path, tiny_llama_dir
):
    learner.step(make_batch(5))
    saved_policy, saved_critic = policy_state(learner), critic_state(learner)
    saved_step, saved_version = learner.global_step, learner.policy_version
    learner.save_checkpoint(tmp_path / "ckpt")

    after_saved = learner.step(make_batch(6))
    continued = policy_state(learner)
    assert not same(saved_policy, continued)

    learner.load_checkpoint(tmp_path / "ckpt")
    assert (learner.global_step, learner.policy_version) == (saved_step, saved_version)
    assert same(saved_policy, policy_state(learner))
    assert same(saved_critic, critic_state(learner))
    # same batch from the restored state: identical update only if Adam moments came back too
    replayed = learner.step(make_batch(6))
    assert replayed.policy_version == after_saved.policy_version
    for name, tensor in policy_state(learner).items():
        torch.testing.assert_close(tensor, continued[name], rtol=0, atol=0)

    hf = AutoModelForCausalLM.from_pretrained(
        tmp_path / "ckpt" / "hf_policy", dtype=learner_dtype(learner)
    )
    for name, tensor in hf.state_dict().items():
        assert torch.equal(tensor, saved_policy[name]), name


@pytest.mark.parametrize(("dtype", "zero_stage"), [("bf16", 2), ("fp32", 0), ("bf16", 3)])
def test_nonfinite_batch_is_skipped_counted_and_never_written(tiny_llama_dir, dtype, zero_stage):
    """fp32 ZeRO-0 has no DeepSpeed overflow check: the learner's own guard must hold.
    ZeRO-3 partitions the parameters: export must gather them."""
    learner = Learner(
        tiny_llama_dir,
        learner_config(dtype=dtype, zero_stage=zero_stage, mini_batch_size=2),
        # behaviour log-probs enter the ratio and the in-reward KL (decoupled PPO would use
        # the recomputed proximal log-probs there, and the NaN would reach the policy only)
        PPOConfig(off_policy="behavior"),
        seed=0,
    )
    poisoned = make_batch(7, num=2)
    poisoned[1].behavior_logprobs[0] = np.nan  # a policy token: the policy loss is NaN
    before, critic_before = policy_state(learner), critic_state(learner)
    metrics = learner.step(poisoned)
    assert metrics.skipped_steps == 1 and metrics.nonfinite_steps_total == 1
    assert math.isnan(metrics.grad_norm)
    assert same(before, policy_state(learner))
    assert all(torch.isfinite(t).all() for t in policy_state(learner).values())
    # the NaN reaches the critic too (KL-in-reward -> token rewards -> GAE returns)
    assert metrics.critic_skipped_steps == 1
    assert same(critic_before, critic_state(learner))
    clean = learner.step(make_batch(8, num=2))
    assert clean.skipped_steps == 0 and clean.nonfinite_steps_total == 1
    assert not same(before, policy_state(learner))
    assert dataclasses.asdict(clean)["policy_version"] == 2
