"""The fused AdamW the learner builds itself (``learner.fused_adamw``; the default on CUDA)
takes the same step as DeepSpeed's ``torch_adam`` (torch's foreach AdamW), under ZeRO 0, 2
and 3 (the 7B recipe's stage, where ZeRO-3 hands the fused optimizer its flat fp32
partitions). On CPU torch has a fused AdamW kernel too, so the client-optimizer path is checked
here; ``tests/gpu`` runs it on CUDA by default."""

from __future__ import annotations

import pytest
import torch
from learner_factories import make_batch, make_tiny_learner

from learner.config import LearnerConfig, PPOConfig
from learner.engines import use_fused_adamw


@pytest.mark.parametrize("zero_stage", [0, 2, 3])
def test_fused_adamw_takes_the_foreach_step(tiny_llama_dir, zero_stage):
    params = {}
    for fused in (False, True):
        learner = make_tiny_learner(
            tiny_llama_dir,
            PPOConfig(),
            zero_stage=zero_stage,
            critic_lr=1e-3,
            weight_decay=0.01,
            fused_adamw=fused,
        )
        optimizer = learner.policy_engine.optimizer
        inner = getattr(optimizer, "optimizer", optimizer)  # ZeRO wraps the AdamW
        assert isinstance(inner, torch.optim.AdamW)
        assert inner.defaults["fused"] is (True if fused else None)
        assert inner.defaults["weight_decay"] == 0.01
        assert learner.learning_rates() == {"actor_lr": 1e-3, "critic_lr": 1e-3}
        before = {n: p.detach().clone() for n, p in learner.policy_engine.module.named_parameters()}
        learner.step(make_batch(0))
        params[fused] = {
            n: p.detach().clone() for n, p in learner.policy_engine.module.named_parameters()
        }
    assert not all(torch.equal(before[n], p) for n, p in params[True].items())  # it stepped
    for name, want in params[False].items():
        torch.testing.assert_close(params[True][name], want, rtol=1e-5, atol=1e-6)


def test_fused_adamw_default_follows_the_device():
    assert use_fused_adamw(LearnerConfig()) is torch.cuda.is_available()
    assert use_fused_adamw(LearnerConfig(fused_adamw=False)) is False
