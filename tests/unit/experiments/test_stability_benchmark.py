"""The stability benchmark's pieces without Ray: the synthetic task's records and QA sets,
the ``sync.fixed_lag`` config check, the per-cell statistics and the seed-major run order."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from experiments.collapse import CollapseRule
from experiments.grid import ExperimentSpec, plan_runs
from experiments.stability import (
    cell_summaries,
    iqm,
    iqm_ci,
    mean_ci,
    mean_difference,
    mean_difference_ci,
    poi_ci,
    probability_of_improvement,
    run_stats,
    wilson_ci,
)
from prepare.synthetic_task import make_records, qa_records
from services.config import ConfigError, load_config


def test_records_are_seeded_unique_and_link_elsewhere():
    a, b = make_records(200, seed=3), make_records(200, seed=3)
    assert a == b and a != make_records(200, seed=4)
    ids = [r.rid for r in a]
    assert len(set(ids)) == 200
    assert all(r.link != r.rid and r.link in set(ids) for r in a)
    assert all(len(r.code) == 3 and r.code.isdigit() for r in a)


def test_qa_answers_follow_the_corpus_and_splits_are_disjoint():
    records = make_records(100, seed=0)
    by_id = {r.rid: r for r in records}
    qa = qa_records(records, seed=0)
    for name in ("single_hop", "multi_hop"):
        assert sum(len(v) for v in qa[name].values()) == 100
    seen: dict[str, set[str]] = {}
    for split, rows in qa["multi_hop"].items():
        seen[split] = {r["metadata"]["entity"] for r in rows}
        for row in rows:
            first, second = row["metadata"]["search_queries"]
            assert by_id[first].link == second
            assert row["golden_answers"] == [by_id[second].code]
    for row in qa["single_hop"]["train"]:
        rid = row["metadata"]["entity"]
        assert row["golden_answers"] == [by_id[rid].code] and rid in row["question"]
    assert not seen["train"] & seen["validation"] and not seen["train"] & seen["test"]


def test_fixed_lag_needs_sync_every_step():
    load_config(None, ["sync.fixed_lag=true", "buffer.max_staleness=4"])
    with pytest.raises(ConfigError, match=r"sync: .*fixed_lag needs every_k_steps = 1"):
        load_config(None, ["sync.fixed_lag=true", "buffer.max_staleness=4", "sync.every_k_steps=2"])


def test_seed_major_order_covers_every_point_first():
    grid = {"algorithm.variant": ["ppo", "st_ppo"], "buffer.max_staleness": [0, 2]}
    spec = ExperimentSpec(grid=grid, seeds=[0, 1], seed_major=True)
    runs = plan_runs(spec, "x", Path("/tmp/none"))
    assert [r.seed for r in runs] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert len({r.name for r in runs}) == 8
    default = plan_runs(ExperimentSpec(grid=grid, seeds=[0, 1]), "x", Path("/tmp/none"))
    assert [r.seed for r in default] == [0, 1, 0, 1, 0, 1, 0, 1]


def test_iqm_is_the_mean_of_the_middle_half():
    # 8 values: floor(0.25 * 8) = 2 cut from each end -> mean(2, 3, 4, 5) = 3.5; the
    # outlier 100 does not move it, the plain mean (3 + 100/8 ...) would
    assert iqm([0, 1, 2, 3, 4, 5, 6, 7]) == pytest.approx(3.5)
    assert iqm([0, 1, 2, 3, 4, 5, 6, 100]) == pytest.approx(3.5)
    # 4 values: 1 cut from each end -> mean(0.2, 0.3) = 0.25; NaN ignored
    assert iqm([0.9, 0.2, 0.3, 0.0, math.nan]) == pytest.approx(0.25)
    assert math.isnan(iqm([]))


def test_bootstrap_intervals_cover_and_degenerate_cleanly():
    low, high = iqm_ci([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0])
    # IQM 0.55 (mean of 0.3..0.8); a resample's IQM stays within the data's range
    assert 0.1 <= low < 0.55 < high <= 1.0
    assert iqm_ci([0.4, 0.4, 0.4]) == pytest.approx((0.4, 0.4))  # every resample gives 0.4
    assert all(math.isnan(v) for v in iqm_ci([0.4]))
    # gains all positive: the interval of the mean excludes zero
    low, high = mean_ci([0.05, 0.08, 0.1, 0.12, 0.07])
    assert low >= 0.05 and high <= 0.12 and low > 0


def test_probability_of_improvement():
    # x beats y in 4 of 9 pairs (1>0, 2>0, 3>0, 3>2) and ties one (2=2): (4 + 0.5) / 9
    assert probability_of_improvement([1, 2, 3], [0, 2, 5]) == pytest.approx(4.5 / 9)
    # clearly separated samples: 1 (every pair won), interval [1, 1]; reversed: 0
    high, low = [0.8, 0.85, 0.9, 0.95], [0.1, 0.15, 0.2]
    assert probability_of_improvement(high, low) == 1.0 and poi_ci(high, low) == (1.0, 1.0)
    assert probability_of_improvement(low, high) == 0.0
    # identical samples: 0.5, and the interval holds 0.5
    same = [0.1, 0.5, 0.9, 0.3]
    assert probability_of_improvement(same, same) == pytest.approx(0.5)
    lo, hi = poi_ci(same, same)
    assert lo < 0.5 < hi
    assert math.isnan(probability_of_improvement([], [0.1]))


def test_vectorised_poi_equals_scipy_mann_whitney_on_ties_and_batches():
    """The bootstrap's vectorised statistic == the scipy point estimate, per resample row."""
    import numpy as np

    from experiments.stability import _poi_axis

    rng = np.random.default_rng(0)
    x = rng.integers(0, 4, size=(5, 7)) / 4  # many ties
    y = rng.integers(0, 4, size=(5, 6)) / 4
    rows = _poi_axis(x, y, axis=-1)
    for i in range(5):
        assert rows[i] == pytest.approx(probability_of_improvement(list(x[i]), list(y[i])))


def test_wilson_interval_known_answers():
    # Wilson, z = 1.959964: centre (p + z^2/2n) / (1 + z^2/n) = (0.5 + 0.19207) / 1.38415 = 0.5,
    # half-width z / (1 + z^2/n) * sqrt(p(1-p)/n + z^2/4n^2) = 1.41600 * 0.186021 = 0.263406
    assert wilson_ci(5, 10) == pytest.approx((0.236594, 0.763406), abs=1e-6)
    # k = 0: low 0, high = (z^2/n) / (1 + z^2/n) = 0.384146 / 1.384146 = 0.277533
    assert wilson_ci(0, 10) == pytest.approx((0.0, 0.277533), abs=1e-6)
    assert all(math.isnan(v) for v in wilson_ci(0, 0))
    with pytest.raises(ValueError):
        wilson_ci(3, 2)


def _fake_run(
    root: Path,
    name: str,
    variant: str,
    lag: int,
    success: list[float],
    off_policy: str | None = None,
    seed: int = 0,
) -> Path:
    run = root / name
    run.mkdir(parents=True)
    algorithm = {"variant": variant} | ({"off_policy": off_policy} if off_policy else {})
    cfg = {"algorithm": algorithm, "buffer": {"max_staleness": lag}, "run": {"seed": seed},
           "learner": {"train_batch_size": 8, "mini_batch_size": 4, "ppo_epochs": 2}}  # fmt: skip
    (run / "config.json").write_text(json.dumps(cfg))
    steps = [{"step": i + 1, "success_rate": s, "reward_mean": s, "malformed_rate": 0.0,
              "clip_ratio": 0.1, "approx_kl": 0.01, "token_log_ratio_abs_max": 0.5 + i,
              "clip_bias_scale": 0.9, "token_bound_ratio": 0.0 if variant == "ppo" else 0.02,
              "behavior_weight_capped": 0.01 * i} for i, s in enumerate(success)]  # fmt: skip
    (run / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    consumed = [{"step": i + 1, "staleness": [min(i, lag)] * 2} for i in range(len(success))]
    consumed[-1]["staleness"][0] = lag + 1  # one trajectory off the promised lag
    (run / "consumed.jsonl").write_text("".join(json.dumps(c) + "\n" for c in consumed))
    evals = [
        {"tag": "start", "success_rate": success[0]},
        {"tag": "start_sampled", "success_rate": success[0] / 2},  # run.eval_sampled
        {"tag": "end", "success_rate": success[-1]},
        {"tag": "end_sampled", "success_rate": success[-1] / 2},
    ]
    (run / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    return run


def test_cell_summaries(tmp_path: Path):
    rule = CollapseRule(drop=0.3, last_k=2, window=1)
    stable = [0.2, 0.5, 0.6, 0.6, 0.6]
    collapsed = [0.2, 0.8, 0.8, 0.3, 0.2]
    runs = [
        run_stats(_fake_run(tmp_path, "a0", "ppo", 2, stable), rule, final_window=2),
        run_stats(_fake_run(tmp_path, "a1", "ppo", 2, [0.2, 0.4, 0.4, 0.4, 0.4]), rule, 2),
        run_stats(_fake_run(tmp_path, "b0", "st_ppo", 2, collapsed), rule, final_window=2),
    ]
    cells = {c.variant: c for c in cell_summaries(runs)}
    ppo, st = cells["ppo"], cells["st_ppo"]
    # final training success (last 2 steps): 0.6 and 0.4 -> IQM of 2 values cuts none: 0.5
    assert ppo.runs == 2 and ppo.final_success_iqm == pytest.approx(0.5)
    # val success (end) 0.6 and 0.4, started at 0.2 both: gains 0.4 and 0.2
    assert ppo.val_success_sd == pytest.approx(math.sqrt(0.02))
    assert ppo.val_gain_mean == pytest.approx(0.3) and ppo.val_start_mean == pytest.approx(0.2)
    assert (ppo.collapsed, ppo.judged, st.collapsed, st.judged) == (0, 2, 1, 1)
    assert ppo.collapse_ci == pytest.approx(wilson_ci(0, 2))
    assert st.final_success_iqm == pytest.approx(0.25)
    # st_ppo's one run ends at 0.2, below both ppo runs (0.6, 0.4): P(improve) = 0
    assert st.poi_vs_ppo == 0.0 and math.isnan(ppo.poi_vs_ppo)
    assert st.cell == {"algorithm.variant": "st_ppo", "algorithm.off_policy": None,
                       "buffer.max_staleness": 2}  # fmt: skip
    assert ppo.token_log_ratio_max == pytest.approx(4.5)
    assert ppo.exact_staleness_share == pytest.approx(9 / 10)
    assert st.clip_bias_scale_min == pytest.approx(0.9)
    assert ppo.optimizer_steps_per_batch == 4  # 2 epochs x 8 / 4 mini-batches
    # which stabiliser acted: the token bound only in st_ppo; capped weights 0.0..0.04 a step
    assert ppo.token_bound_ratio == 0.0 and st.token_bound_ratio == pytest.approx(0.02)
    assert st.behavior_weight_capped == pytest.approx(0.02)
    assert ppo.val_success_per_seed == pytest.approx([0.6, 0.4]) and ppo.seeds == [0, 0]
    # sampled evaluations at half the greedy values: 0.3 and 0.2 from 0.1 and 0.1
    assert ppo.val_sampled_iqm == pytest.approx(0.25)
    assert ppo.val_sampled_gain_mean == pytest.approx(0.15)


def test_stale_cells_are_compared_with_staleness_0(tmp_path: Path):
    rule = CollapseRule(drop=0.3, last_k=2, window=1)
    ends = {  # (variant, objective, staleness) -> the end value of each seed
        ("ppo", "decoupled", 0): [0.5, 0.6, 0.7],
        ("ppo", "decoupled", 8): [0.3, 0.4, 0.5],
        ("ppo", "behavior", 8): [0.6, 0.7, 0.8],  # no behavior / 0: compared with decoupled / 0
        ("st_ppo", "behavior", 8): [0.5, 0.6, 0.7],  # no st_ppo / 0: compared with ppo's
    }
    runs = [
        run_stats(_fake_run(tmp_path, f"{v}-{o}-{lag}-{i}", v, lag, [0.2, end], o, seed=i),
                  rule, final_window=1)
        for (v, o, lag), values in ends.items() for i, end in enumerate(values)
    ]  # fmt: skip
    cells = {(c.variant, c.off_policy, c.max_staleness): c for c in cell_summaries(runs)}
    on, stale = cells["ppo", "decoupled", 0], cells["ppo", "decoupled", 8]
    paper, st_paper = cells["ppo", "behavior", 8], cells["st_ppo", "behavior", 8]
    assert math.isnan(on.vs_on_policy) and on.on_policy_cell == ""
    # means 0.4 vs 0.6: -0.2; every stale seed is at or below every on-policy one but one tie
    assert stale.vs_on_policy == pytest.approx(-0.2)
    assert stale.on_policy_cell == "ppo / decoupled / 0"
    low, high = stale.vs_on_policy_ci
    assert -0.4 <= low < -0.2 < high <= 0.0
    assert stale.poi_vs_on_policy == pytest.approx(0.5 / 9)  # only 0.5 = 0.5 ties
    assert (
        paper.vs_on_policy == pytest.approx(0.1) and paper.on_policy_cell == "ppo / decoupled / 0"
    )
    assert st_paper.vs_on_policy == pytest.approx(0.0)
    assert st_paper.on_policy_cell == "ppo / decoupled / 0"
    assert mean_difference([1.0, 3.0], [1.0]) == 1.0 and math.isnan(mean_difference([], [1.0]))
    assert mean_difference_ci([0.5, 0.5], [0.2, 0.2]) == pytest.approx((0.3, 0.3))


def test_tokenizer_ids_and_codes_are_single_tokens_and_round_trip():
    from prepare.synthetic_task import SPECIAL_TOKENS, tokenizer_texts, train_tokenizer

    records = make_records(40, seed=1)
    whole = [r.rid for r in records] + [f"{c:03d}" for c in range(1000)]
    tok = train_tokenizer(tokenizer_texts(records, qa_records(records, 1)), 400, whole)
    assert [tok.convert_ids_to_tokens(i) for i in range(3)] == list(SPECIAL_TOKENS)
    r = records[0]
    text = f"<search> {r.rid} </search>\n{r.text}"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    pieces = tok.convert_ids_to_tokens(ids)
    assert pieces.count(r.rid) == 2 and r.code in pieces and r.link in pieces


def test_write_cells_leaves_unfinished_runs_out_and_draws_intervals(tmp_path: Path):
    from experiments.stability import write_cells

    rule = CollapseRule(drop=0.3, last_k=2, window=1)
    done = [_fake_run(tmp_path, f"p{i}", "ppo", 0, [0.2, 0.4, 0.5 + 0.1 * i]) for i in range(3)]
    done += [_fake_run(tmp_path, f"s{i}", "st_ppo", 0, [0.2, 0.3, 0.1 * i]) for i in range(3)]
    running = _fake_run(tmp_path, "s9", "st_ppo", 0, [0.2, 0.0])
    (running / "eval.jsonl").write_text(json.dumps({"tag": "start", "success_rate": 0.2}) + "\n")
    json_path, md_path, figure = write_cells([*done, running], rule, tmp_path / "out")
    payload = json.loads(json_path.read_text())
    assert payload["unfinished"] == ["s9"]
    cells = {c["variant"]: c for c in payload["cells"]}
    assert cells["st_ppo"]["runs"] == 3
    # ppo ends at 0.5, 0.6, 0.7; st_ppo at 0.0, 0.1, 0.2: every pair lost -> 0, interval [0, 0]
    assert cells["st_ppo"]["poi_vs_ppo"] == 0.0 and cells["st_ppo"]["poi_vs_ppo_ci"] == [0.0, 0.0]
    # val gain of ppo: 0.3, 0.4, 0.5 over a start of 0.2 -> mean 0.4, interval inside [0.3, 0.5]
    low, high = cells["ppo"]["val_gain_ci"]
    assert cells["ppo"]["val_gain_mean"] == pytest.approx(0.4) and 0.3 <= low < high <= 0.5
    assert "| st_ppo | None | 0 | 3 |" in md_path.read_text()
    assert figure is not None and (tmp_path / "out" / "cells_intervals.png").stat().st_size > 5_000
