"""Advantage estimators (learner/advantages.py): hand-computed GAE across environment
blocks, GAE vs a textbook loop, GRPO group advantages, whitening, turn ids."""

from __future__ import annotations

import pytest
import torch

from learner.advantages import (
    broadcast_sequence_advantages,
    compute_gae,
    group_relative_advantages,
    turn_ids_from_mask,
    whiten,
)


def test_gae_hand_computed_skips_environment_tokens():
    # One sequence: policy tokens t0 | env t1 t2 | policy t3 t4 | padding t5.
    # Env/padding values are 7.0 (garbage that must not be read).
    rewards = torch.tensor([[0.0, 0.0, 0.0, -0.1, 1.0, 0.0]], dtype=torch.float64)
    values = torch.tensor([[0.2, 7.0, 7.0, 0.5, 0.6, 7.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 0, 0, 1, 1, 0]])
    out = compute_gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # gamma * lam = 0.72. Policy order t0 -> t3 -> t4 -> end (V = 0).
    # t4: delta = 1.0 + 0.9*0 - 0.6 = 0.4 ;            A4 = 0.4
    # t3: delta = -0.1 + 0.9*0.6 - 0.5 = -0.06 ;        A3 = -0.06 + 0.72*0.4 = 0.228
    # t0: delta = 0 + 0.9*0.5 - 0.2 = 0.25 (V of t3 bootstraps across the env block)
    #                                                  A0 = 0.25 + 0.72*0.228 = 0.41416
    expected_adv = torch.tensor([[0.41416, 0, 0, 0.228, 0.4, 0]], dtype=torch.float64)
    torch.testing.assert_close(out.advantages, expected_adv, rtol=0, atol=1e-12)
    # returns = A + V: 0.61416, 0.728, 1.0
    expected_ret = torch.tensor([[0.61416, 0, 0, 0.728, 1.0, 0]], dtype=torch.float64)
    torch.testing.assert_close(out.returns, expected_ret, rtol=0, atol=1e-12)


def test_gae_gamma_lambda_one_is_return_minus_value():
    # Spec default gamma = lam = 1 with a terminal reward R = 1: A_t = R - V_t.
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    values = torch.tensor([[0.1, 5.0, 0.3, 0.7], [0.25, 0.5, 5.0, 5.0]])
    mask = torch.tensor([[1, 0, 1, 1], [1, 1, 0, 0]])
    out = compute_gae(rewards, values, mask, gamma=1.0, lam=1.0)
    expected = torch.tensor([[0.9, 0.0, 0.7, 0.3], [-0.25, -0.5, 0.0, 0.0]])
    torch.testing.assert_close(out.advantages, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(out.returns, torch.tensor([[1.0, 0, 1, 1], [0.0, 0, 0, 0]]))


def _gae_reference(rewards, values, mask, gamma, lam):
    """Textbook GAE per sequence over the compacted list of policy tokens (Python loops)."""
    adv = torch.zeros_like(rewards)
    for i in range(rewards.shape[0]):
        idx = [t for t in range(rewards.shape[1]) if mask[i, t]]
        running, next_v = 0.0, 0.0
        for t in reversed(idx):
            delta = rewards[i, t].item() + gamma * next_v - values[i, t].item()
            running = delta + gamma * lam * running
            adv[i, t] = running
            next_v = values[i, t].item()
    return adv


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.95, 0.9), (0.5, 0.0)])
def test_gae_matches_reference_loop_on_random_inputs(gamma, lam):
    gen = torch.Generator().manual_seed(3)
    mask = (torch.rand(5, 17, generator=gen) < 0.6).long()
    mask[2] = 0  # a sequence with no policy token
    rewards = torch.randn(5, 17, generator=gen, dtype=torch.float64) * mask
    values = torch.randn(5, 17, generator=gen, dtype=torch.float64)
    out = compute_gae(rewards, values, mask, gamma=gamma, lam=lam)
    expected = _gae_reference(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(out.advantages, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(out.returns, (expected + values) * mask, rtol=0, atol=1e-12)


def test_gae_input_errors():
    rewards = torch.tensor([[0.0, 1.0]])
    values = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="loss_mask is 0"):
        compute_gae(rewards, values, torch.tensor([[1, 0]]), gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match="values shape"):
        compute_gae(rewards, values[:, :1], torch.tensor([[1, 1]]), gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match="gamma"):
        compute_gae(rewards, values, torch.tensor([[1, 1]]), gamma=1.5, lam=1.0)


def test_group_relative_advantages_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    group_ids = torch.tensor([7, 7, 7, 7, 3, 3, 3, 3])
    # group 7: mean 0.75, unbiased std sqrt((3 * 0.25^2 + 0.75^2) / 3) = sqrt(0.25) = 0.5
    #   -> (1 - .75)/.5 = 0.5, (0 - .75)/.5 = -1.5
    # group 3: mean 0.25, std 0.5 -> (0 - .25)/.5 = -0.5, (1 - .25)/.5 = 1.5
    eps = 1e-6
    adv = group_relative_advantages(rewards, group_ids, std_normalize=True, eps=eps)
    centred = torch.tensor(
        [0.25, -0.75, 0.25, 0.25, -0.25, -0.25, 0.75, -0.25], dtype=torch.float64
    )
    torch.testing.assert_close(adv, centred / (0.5 + eps), rtol=0, atol=1e-12)
    # Dr. GRPO: only centred.
    adv = group_relative_advantages(rewards, group_ids, std_normalize=False, eps=eps)
    torch.testing.assert_close(
        adv, torch.tensor([0.25, -0.75, 0.25, 0.25, -0.25, -0.25, 0.75, -0.25]).double()
    )


def test_group_relative_advantages_all_equal_rewards_give_zero():
    adv = group_relative_advantages(
        torch.tensor([1.0, 1.0, 0.0, 0.0]), torch.tensor([0, 0, 1, 1]), std_normalize=True, eps=1e-6
    )
    torch.testing.assert_close(adv, torch.zeros(4))


def test_group_relative_advantages_errors():
    with pytest.raises(ValueError, match=r"size 1 .*\[5\]"):
        group_relative_advantages(
            torch.tensor([1.0, 0.0, 1.0]), torch.tensor([2, 2, 5]), std_normalize=True, eps=1e-6
        )
    with pytest.raises(ValueError, match="int64"):
        group_relative_advantages(
            torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0]), std_normalize=True, eps=1e-6
        )
    with pytest.raises(ValueError, match=r"\[B\]"):
        group_relative_advantages(
            torch.zeros(2, 2), torch.zeros(2, 2, dtype=torch.long), std_normalize=True, eps=1e-6
        )


def test_broadcast_sequence_advantages():
    out = broadcast_sequence_advantages(
        torch.tensor([0.5, -1.5]), torch.tensor([[1, 0, 1], [0, 1, 1]])
    )
    torch.testing.assert_close(out, torch.tensor([[0.5, 0.0, 0.5], [0.0, -1.5, -1.5]]))


def test_whiten_hand_computed():
    values = torch.tensor([[1.0, 2.0, 3.0, 100.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0]])
    # mean 2, unbiased var ((1)+(0)+(1))/2 = 1 -> (x - 2) / sqrt(1 + 1e-8); masked -> 0
    out = whiten(values, mask)
    expected = torch.tensor([[-1.0, 0.0, 1.0, 0.0]], dtype=torch.float64) / (1 + 1e-8) ** 0.5
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    # shift_mean=False: mean added back -> [1, 2, 3, 0] (scaled by 1/sqrt(1 + 1e-8))
    out = whiten(values, mask, shift_mean=False)
    expected = torch.tensor([[-1.0, 0.0, 1.0, 0.0]], dtype=torch.float64) / (1 + 1e-8) ** 0.5
    expected = expected + torch.tensor([[2.0, 2.0, 2.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="at least 2"):
        whiten(values, torch.tensor([[1, 0, 0, 0]]))


def test_turn_ids_from_mask():
    mask = torch.tensor([[1, 1, 0, 0, 1, 0, 1], [0, 1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0]])
    expected = torch.tensor(
        [[0, 0, -1, -1, 1, -1, 2], [-1, 0, 0, 0, -1, -1, -1], [-1, -1, -1, -1, -1, -1, -1]]
    )
    out = turn_ids_from_mask(mask)
    assert out.dtype == torch.int64
    torch.testing.assert_close(out, expected)
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        turn_ids_from_mask(mask[0])


# ---------------------------------------------------------------- input contracts (mutation
# testing found these unchecked: messages, boundaries, the dtype of the result)


def test_gae_accepts_the_closed_interval_and_names_bad_inputs():
    rewards = torch.tensor([[0.0, 1.0]])
    values = torch.tensor([[0.5, 0.25]])
    mask = torch.tensor([[1, 1]])
    myopic = compute_gae(rewards, values, mask, gamma=0.0, lam=0.0)  # gamma = 0 is legal
    torch.testing.assert_close(myopic.advantages, torch.tensor([[-0.5, 0.75]]))
    with pytest.raises(ValueError, match=r"^lam must be in \[0, 1\], got 1.5$"):
        compute_gae(rewards, values, mask, gamma=1.0, lam=1.5)
    with pytest.raises(ValueError, match=r"^gamma must be in \[0, 1\], got -0.1$"):
        compute_gae(rewards, values, mask, gamma=-0.1, lam=1.0)
    with pytest.raises(ValueError, match=r"^token_rewards must be \[B, T\], got shape \(2,\)$"):
        compute_gae(rewards[0], values[0], mask[0], gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match=r"^values shape \(1, 1\) != token_rewards shape"):
        compute_gae(rewards, values[:, :1], mask, gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match=r"^loss_mask shape \(1, 1\) != token_rewards shape"):
        compute_gae(rewards, values, mask[:, :1], gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match=r"^token_rewards must be 0 where loss_mask is 0"):
        compute_gae(rewards, values, torch.tensor([[1, 0]]), gamma=1.0, lam=1.0)


def test_advantages_are_float32_for_low_precision_inputs():
    """bf16 critic values and int rewards still give float32 advantages (the documented
    dtype), not bf16 ones that round every advantage to 3 significant digits."""
    mask = torch.tensor([[1, 1, 0, 1]])
    values = torch.tensor([[0.3, 0.7, 0.0, 0.1]], dtype=torch.bfloat16)
    rewards = torch.tensor([[0, 0, 0, 1]], dtype=torch.int64)
    gae = compute_gae(rewards, values, mask, gamma=1.0, lam=1.0)
    assert gae.advantages.dtype == gae.returns.dtype == torch.float32
    grpo = group_relative_advantages(
        torch.tensor([1, 0, 1, 1], dtype=torch.int64), torch.tensor([7, 7, 7, 7]),
        std_normalize=True, eps=1e-6,
    )  # fmt: skip
    assert grpo.dtype == torch.float32
    torch.testing.assert_close(grpo, torch.tensor([0.5, -1.5, 0.5, 0.5]), atol=1e-5, rtol=0)
    tokens = broadcast_sequence_advantages(
        torch.tensor([0.5, -1.0]), torch.tensor([[1, 0], [1, 1]])
    )
    assert tokens.dtype == torch.float32
    half = whiten(torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64), torch.tensor([1, 1, 1]))
    assert half.dtype == torch.float64


def test_group_and_broadcast_contracts():
    rewards, groups = torch.tensor([1.0, 0.0]), torch.tensor([3, 3])
    with pytest.raises(ValueError, match=r"^eps must be > 0, got 0.0$"):
        group_relative_advantages(rewards, groups, std_normalize=True, eps=0.0)
    with pytest.raises(ValueError, match=r"^group_ids shape \(3,\) != rewards shape \(2,\)$"):
        group_relative_advantages(rewards, torch.tensor([3, 3, 3]), std_normalize=True, eps=1e-6)
    bad = {
        "1-D mask": (torch.tensor([0.5]), torch.tensor([1, 1])),
        "2-D advantages": (torch.tensor([[0.5]]), torch.tensor([[1, 1]])),
        "rows differ": (torch.tensor([0.5, 1.0, 2.0]), torch.tensor([[1, 1], [1, 0]])),
    }
    for name, (adv, mask) in bad.items():
        with pytest.raises(
            ValueError, match=r"^advantages must be \[B\] and loss_mask \[B, T\], got"
        ):
            broadcast_sequence_advantages(adv, mask)
        assert name


def test_whiten_needs_two_entries_and_two_are_enough():
    two = whiten(torch.tensor([1.0, 3.0, 50.0]), torch.tensor([1, 1, 0]))
    torch.testing.assert_close(two, torch.tensor([-(2**-0.5), 2**-0.5, 0.0]), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match=r"^whiten needs at least 2 masked entries, got 1$"):
        whiten(torch.tensor([1.0, 3.0]), torch.tensor([1, 0]))
    with pytest.raises(ValueError, match=r"^mask shape \(1,\) != values shape \(2,\)$"):
        whiten(torch.tensor([1.0, 3.0]), torch.tensor([1]))
