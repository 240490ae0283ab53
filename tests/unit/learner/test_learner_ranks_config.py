"""Config and batch split of the learner on N ranks (no Ray, no torch.distributed)."""

from __future__ import annotations

import pytest

from learner.distributed import balanced_shards
from services.config import ConfigError, load_config


def test_num_ranks_defaults_to_one_and_is_bounded():
    assert load_config().learner.num_ranks == 1
    assert load_config(None, ["learner.num_ranks=4"]).learner.num_ranks == 4
    with pytest.raises(ConfigError, match="num_ranks"):
        load_config(None, ["learner.num_ranks=0"])


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_param_bias_norm_loads_up_to_zero_2(stage):
    cfg = load_config(
        None,
        ["algorithm.variant=st_ppo", "algorithm.bias_norm=param", f"learner.zero_stage={stage}"],
    )
    assert cfg.algorithm.bias_norm == "param"


def test_param_bias_norm_with_zero_3_fails_at_load_naming_the_fields():
    with pytest.raises(ConfigError, match=r"algorithm\.bias_norm.*learner\.zero_stage"):
        load_config(
            None, ["algorithm.variant=so_grpo", "algorithm.bias_norm=param", "learner.zero_stage=3"]
        )
    # logprob (the default) is fine at ZeRO-3
    load_config(None, ["algorithm.variant=st_ppo", "learner.zero_stage=3"])


def test_balanced_shards_split_whole_rows_by_tokens_deterministically():
    rows = [7, 3, 5, 1, 0]
    tokens = [100, 10, 60, 50, 10]
    shards = balanced_shards(rows, tokens, 2)
    assert sorted(r for s in shards for r in s) == sorted(rows)  # every row once
    load = [sum(tokens[rows.index(r)] for r in s) for s in shards]
    assert max(load) - min(load) <= max(tokens)  # greedy longest-first bound
    assert shards == [[7, 3, 0], [5, 1]]  # order of `rows` kept inside a shard
    assert balanced_shards(rows, tokens, 1) == [rows]
    assert balanced_shards([4], [9], 3) == [[4], [], []]
    with pytest.raises(ValueError):
        balanced_shards(rows, tokens[:2], 2)
