"""The arena's leaderboards (experiments.arena) and the stabiliser-activity line
(services.stabilisers) on run directories written by hand, numbers worked in comments."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from experiments.arena import (
    FAMILIES,
    acted_on,
    bias_norm_distributions,
    board_power,
    curve_panels,
    detectable_difference,
    leaderboard,
    leaderboard_header,
    method_family,
    plot_curves,
    read_run,
    seed_band,
    summary_markdown,
    write_leaderboards,
)
from experiments.collapse import CollapseRule
from experiments.grid import experiment_path, load_experiment
from services.config import load_config
from services.stabilisers import activity_line, stabiliser_activity

RULE = CollapseRule(window=1, last_k=2, drop=0.5)


def write_run(root: Path, method: str, staleness: int, seed: int, end: float, **step) -> Path:
    """A finished run: 4 steps of ``step`` fields (step_s 1.0 unless given), start 0.1."""
    run_dir = root / f"{method}_{staleness}_{seed}"
    run_dir.mkdir(parents=True)
    cfg = load_config(None, [f'run.label="{method}"', f"buffer.max_staleness={staleness}",
                             f"run.seed={seed}", "run.num_steps=4"])  # fmt: skip
    (run_dir / "config.json").write_text(cfg.model_dump_json())
    steps = [{"step": i, "success_rate": 0.5, "step_s": 1.0, **step} for i in range(1, 5)]
    (run_dir / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    evals = [{"tag": "start", "success_rate": 0.1}, {"tag": "end", "success_rate": end}]
    (run_dir / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    return run_dir


def test_a_run_the_time_cap_stopped_early_is_left_out_of_the_boards(tmp_path: Path):
    complete = write_run(tmp_path, "base", 4, 0, 0.5)
    capped = write_run(tmp_path, "base", 4, 1, 0.9)
    steps = (capped / "steps.jsonl").read_text().splitlines()
    (capped / "steps.jsonl").write_text("\n".join(steps[:3]) + "\n")  # 3 of its 4 steps
    assert read_run(complete, RULE).finished and not read_run(capped, RULE).finished
    out = tmp_path / "board"
    write_leaderboards([complete, capped], RULE, out, baseline=None)
    payload = json.loads((out / "leaderboard.json").read_text())
    assert payload["unfinished_runs"] == 1
    assert [r["val_success_per_seed"] for r in payload["rows"]] == [[0.5]]


def test_leaderboard_ranks_compares_and_counts(tmp_path: Path):
    dirs = []
    for seed, (a, b) in enumerate([(0.5, 0.2), (0.6, 0.3), (0.7, 0.4)]):
        dirs.append(write_run(tmp_path, "base", 4, seed, b, clip_ratio=0.01, step_s=2.0))
        dirs.append(write_run(tmp_path, "good", 4, seed, a, clip_ratio=0.03, step_s=3.0,
                              behavior_masked=0.1))  # fmt: skip
    dirs += [write_run(tmp_path, "base", 0, seed, v) for seed, v in enumerate((0.5, 0.7, 0.71))]
    runs = [read_run(d, RULE) for d in dirs]
    rows = leaderboard(runs, baseline="base")
    board = [r for r in rows if r.staleness == 4]
    assert [r.method for r in board] == ["good", "base"]  # fewer ended low (2 vs 3) first
    good = board[0]
    # IQM of 3 values cuts floor(0.75) = 0 from each end: the mean, 0.6
    assert good.val_success_iqm == pytest.approx(0.6)
    assert good.gain_mean == pytest.approx(0.5)  # 0.6 - 0.1
    # every good run beats every base run: P(improve) = 1
    assert good.poi_vs_baseline == 1.0
    assert good.step_time_vs_baseline == pytest.approx(1.5)  # 3.0 / 2.0 (steps after the first)
    assert good.shares["clip_ratio"] == pytest.approx(0.03)
    assert good.shares["behavior_masked"] == pytest.approx(0.1)
    assert math.isnan(good.shares["m2po_masked"])  # never logged
    # vs on-policy: 0.6 - mean(0.5, 0.7, 0.71)
    assert good.vs_on_policy == pytest.approx(0.6 - 0.6366667)
    assert good.overlaps_best and not board[1].overlaps_best  # [.5, .7] vs [.2, .4]
    # ended low: below the on-policy median 0.70 - 0.05 = 0.65 (not the mean's 0.587):
    # good's 0.5 and 0.6, every base run
    assert (good.ended_low, board[1].ended_low) == (2, 3)
    assert good.ended_low_ci == pytest.approx((0.2077, 0.9385), abs=1e-4)  # Wilson, 2 of 3
    assert math.isnan(board[1].poi_vs_baseline)  # the baseline is not compared with itself


def test_curve_band_stays_inside_what_the_seeds_reached():
    import numpy as np

    # a share at step 0 where one seed of three broke (0.9) and two held (0.0): mean 0.3,
    # sd 0.424; the band is [0.0, 0.724], not [-0.124, 0.724]; at step 1 all agree (0.5)
    curves = np.array([[0.0, 0.5], [0.0, 0.5], [0.9, 0.5]])
    mean, low, high = seed_band(curves)
    assert mean == pytest.approx([0.3, 0.5])
    assert low == pytest.approx([0.0, 0.5]) and high == pytest.approx([0.72426, 0.5], abs=1e-4)
    # the upper clip: two seeds at 1.0 and one at 0.0 (a success rate): mean 0.667 + sd
    # 0.471 would read 1.138; the band ends at the highest seed
    mean, low, high = seed_band(np.array([[0.0], [1.0], [1.0]]))
    assert high == pytest.approx([1.0]) and low == pytest.approx([0.19526], abs=1e-4)


def test_step_time_compares_only_the_seeds_both_cells_ran(tmp_path: Path):
    # the baseline's seed 1 ran on a slower machine (step 4.0 s), and "good" has no seed 1:
    # the ratio is 3.0 / 2.0 over seed 0, not 3.0 / mean(2.0, 4.0)
    dirs = [write_run(tmp_path, "base", 4, 0, 0.3, step_s=2.0),
            write_run(tmp_path, "base", 4, 1, 0.3, step_s=4.0),
            write_run(tmp_path, "good", 4, 0, 0.5, step_s=3.0),
            write_run(tmp_path, "alone", 4, 2, 0.5, step_s=3.0)]  # fmt: skip
    runs = [read_run(d, RULE) for d in dirs]
    rows = {r.method: r for r in leaderboard(runs, baseline="base")}
    assert rows["good"].step_time_vs_baseline == pytest.approx(1.5)
    assert math.isnan(rows["alone"].step_time_vs_baseline)  # no seed in common


def test_summary_lists_every_seed_and_what_acted(tmp_path: Path):
    dirs = [write_run(tmp_path, "base", 4, seed, v, clip_ratio=0.004)
            for seed, v in enumerate((0.3, 0.2))]  # fmt: skip
    # st's second run degrades at the end (malformed 0.2 > 0.1); its first sits on the bound
    dirs += [write_run(tmp_path, "st", 4, seed, v, clip_ratio=0.0, behavior_weight_capped=2e-5,
                       behavior_masked=1e-3, clip_bias_scale=0.5 if seed else 1.0,
                       malformed_rate=0.2 if seed else 0.1)
             for seed, v in enumerate((0.6, 0.5))]  # fmt: skip
    dirs += [write_run(tmp_path, "base", 0, 0, 0.55)]
    rows = leaderboard([read_run(d, RULE) for d in dirs], baseline="base")
    st, base = (r for r in rows if r.staleness == 4)
    # base: clipped 0.4% of tokens; st: nothing clipped, TIS 0.002% (below 0.005%: not
    # named), MIS 0.1%, s = 0.5 in the 4 steps of one of its two runs (half of its steps)
    assert acted_on(base) == "clipped 0.40%"
    assert acted_on(st) == "MIS 0.10%, s >= 0.50 (50.00% of steps < 1)"
    assert acted_on(rows[0]) == "nothing"  # the on-policy run logged no shares at all
    text = summary_markdown(rows, "base")
    assert (
        "| method | runs | ended low | val success mean | val success IQM [95% CI] | gain "
        "over start | collapsed | degrading at the end | P(improve over base) |" in text
    )
    # st: IQM of (0.5, 0.6) = 0.55, gain 0.45 over the start 0.1, both above 0.55 - 0.05:
    # none ended low; every st run beats every base run; 0.55 - 0.55 on-policy = 0
    line = next(x for x in text.splitlines() if x.startswith("| **st** "))
    assert line.startswith(
        "| **st** | 2 | 0/2 | 0.550 | 0.550 [0.50, 0.60] | +0.450 [0.40, 0.50] | 0/2 | 1/2 | "
        "1.00 [1.00, 1.00] |"
    )
    # (one on-policy run: no interval for the difference)
    assert "| +0.000 | 0.500 0.600 | MIS 0.10%, s >= 0.50" in line
    line = next(x for x in text.splitlines() if x.startswith("| base "))
    assert (
        line.startswith("| base | 2 | 2/2 | 0.250 |")
        and "| - |" in line
        and "| 0.200 0.300 | clipped 0.40% |" in line
    )
    assert st.malformed_end_per_seed == pytest.approx([0.1, 0.2])
    assert st.degrading_ci == pytest.approx((0.0945, 0.9055), abs=1e-4)  # Wilson, 1 of 2


def test_bias_norm_distribution_counts_zero_and_triggering_steps(tmp_path: Path):
    run_dir = write_run(tmp_path, "st", 16, 0, 0.3)
    norms = [0.0, 0.0, 0.005, 0.02]  # ||C|| / 0.01 = 0, 0, 0.5, 2
    steps = [{"step": i + 1, "success_rate": 0.5, "clip_bias_norm": n, "step_s": 1.0}
             for i, n in enumerate(norms)]  # fmt: skip
    (run_dir / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    (dist,) = bias_norm_distributions([read_run(run_dir, RULE)])
    assert (dist.steps, dist.share_zero, dist.share_above_one) == (4, 0.5, 0.25)
    assert dist.quantiles["max"] == pytest.approx(2.0)
    assert dist.quantiles["0.5"] == pytest.approx(0.25)  # between 0 and 0.5


def test_detectable_difference_solves_the_two_sample_size_formula():
    # n = 2 (z_.975 + z_.8)^2 sd^2 / d^2 with z_.975 = 1.959964, z_.8 = 0.841621:
    # sd 0.012, n = 10 -> d = 2.801585 * 0.012 * sqrt(0.2) = 0.0150349
    assert detectable_difference(0.012, 10) == pytest.approx(0.0150349, rel=1e-5)
    # and back: that d needs 10 seeds per cell
    d = detectable_difference(0.03, 6)
    assert 2 * (1.959964 + 0.841621) ** 2 * 0.03**2 / d**2 == pytest.approx(6, rel=1e-5)
    # a one-sided-looking alpha and a higher power move it the right way
    assert detectable_difference(0.012, 10, power=0.9) > detectable_difference(0.012, 10)
    assert math.isnan(detectable_difference(0.012, 1))
    with pytest.raises(ValueError, match="must lie in"):
        detectable_difference(0.012, 10, alpha=0.0)


def test_board_power_pools_cells_and_leaves_out_collapsed_runs(tmp_path: Path):
    runs = [read_run(write_run(tmp_path, m, 4, s, v), RULE)
            for m, vals in (("a", (0.2, 0.4)), ("b", (0.5, 0.6, 0.7)), ("c", (0.3,)))
            for s, v in enumerate(vals)]  # fmt: skip
    collapsed = read_run(write_run(tmp_path, "b", 4, 9, 0.0), RULE)
    collapsed.collapsed = True
    (power,) = board_power([*runs, collapsed])
    # a: var 0.02 (1 dof); b: var 0.01 (2 dof); c: one run, left out; b's collapse left out
    # pooled var = (0.02 + 2 * 0.01) / 3
    assert (power.cells, power.runs) == (2, 5)
    assert power.pooled_sd == pytest.approx(math.sqrt(0.04 / 3))
    assert power.detectable["5"] == pytest.approx(detectable_difference(power.pooled_sd, 5))
    # with an on-policy reference at 0.45 (threshold 0.40) a's 0.2 ended low: a keeps one run
    # and drops out; b alone: var 0.01 over 2 dof
    on_policy = read_run(write_run(tmp_path, "a", 0, 0, 0.45), RULE)
    _, stale = board_power([*runs, collapsed, on_policy])  # staleness 0, then 4
    assert (stale.cells, stale.runs) == (1, 3)
    assert stale.pooled_sd == pytest.approx(0.1)


def test_write_leaderboards_writes_tables_and_figures(tmp_path: Path):
    dirs = [write_run(tmp_path / "runs", m, 4, s, 0.3 + 0.1 * s, clip_bias_norm=0.001)
            for m in ("a", "b") for s in range(2)]  # fmt: skip
    md = write_leaderboards(dirs, RULE, tmp_path / "out", baseline="a", extra={"x": 1})
    text = md.read_text()
    assert "### Staleness 4" in text and "| **a** | 2 |" in text
    data = json.loads((tmp_path / "out" / "leaderboard.json").read_text())
    assert data["x"] == 1 and len(data["rows"]) == 2 and data["unfinished_runs"] == 0
    # seeds 0.3 and 0.4 in both cells: pooled sd 0.0707, d(5) = 2.8016 * 0.0707 * sqrt(0.4)
    assert "Power: pooled sd 0.071 of final success over 4 runs in 2 cells" in text
    assert "of 0.125 with 5 seeds per cell, 0.089 with 10 seeds per cell." in text
    assert data["power"][0]["detectable"]["10"] == pytest.approx(0.0886, abs=1e-4)
    for name in ("intervals", "curves", "curves_malformed", "curves_kl", "bias_norm"):
        assert (tmp_path / "out" / f"leaderboard_{name}.png").stat().st_size > 0
    summary = (tmp_path / "out" / "leaderboard_summary.md").read_text()
    assert "| **a** | 2 | - | 0.350 | 0.350 [0.30, 0.40] |" in summary
    assert summary.count("**Staleness 4**") == 1


def test_stabiliser_activity_line():
    steps = [
        {"clip_ratio": 0.0, "behavior_weight_capped": 0.02, "clip_bias_scale": 1.0},
        {"clip_ratio": 0.01, "behavior_weight_capped": 0.0, "clip_bias_scale": 0.5},
    ]
    act = stabiliser_activity(steps)
    assert act.shares["clip_ratio"] == pytest.approx(0.005)
    assert act.steps_acting == {"clip_ratio": 1, "token_bound_ratio": 0,
                                "behavior_weight_capped": 1, "behavior_masked": 0,
                                "m2po_masked": 0}  # fmt: skip
    assert (act.scale_min, act.scale_max, act.scale_steps_below_one) == (0.5, 1.0, 1)
    line = activity_line(act)
    assert line == (
        "stabilisers over 2 steps: clipped 0.50% of tokens (1 steps), truncated (TIS) 1.00% "
        "(1 steps); scale s 0.500-1.000 (< 1 in 1 steps)"
    )
    idle = activity_line(stabiliser_activity([{"clip_ratio": 0.0, "clip_bias_scale": 1.0}]))
    assert idle.endswith("-- none acted")


def test_leaderboard_header_says_what_ran_where(tmp_path: Path):
    cells = (("a", 4, 3), ("b", 4, 3), ("c", 16, 5))
    dirs = [write_run(tmp_path, m, st, s, 0.3) for m, st, n in cells for s in range(n)]
    runs = leaderboard([read_run(d, RULE) for d in dirs], None)
    extra = {"experiment": "arena", "parallel_runs": 2, "archive_dir": "docs/arena_runs",
             "archived": {"runs": 10, "cpus": {"Xeon": 8, "EPYC": 2},
                          "first_day": "2026-11-27", "last_day": "2026-11-28"}}  # fmt: skip
    text = leaderboard_header(runs, 4 * 3600.0, extra)
    assert text.startswith("# Leaderboards: `stppo experiment arena`\n\n")
    assert "11 finished runs, 3 cells (5 seeds in 1 cell, 3 seeds in 2 cells)" in text
    assert "10 of them from the archive `docs/arena_runs`, final evaluations 2026-11-27 to" in text
    assert (
        "on Xeon (8 runs), EPYC (2 runs); 4.0 h of run time (2 runs at a time: about 2.0 h" in text
    )
    sliced = leaderboard_header(runs, math.nan, {"only": {"seed": [0, 1, 2]}})
    assert "(5 seeds in 1 cell, 3 seeds in 2 cells), the slice seed in [0, 1, 2]." in sliced
    alone = leaderboard_header(runs[:1], math.nan, None)
    assert alone == "# Leaderboards\n\n3 finished runs, 1 cell (3 seeds in 1 cell).\n\n"


def test_boards_rank_failures_first_then_the_mean(tmp_path: Path):
    """A cell that lost a run ranks below every cell that lost none, whatever its IQM (which
    trims the lost run away); among equals the higher mean ranks first."""
    dirs = [write_run(tmp_path, "base", 0, seed, 0.5) for seed in range(3)]  # low: < 0.45
    dirs += [write_run(tmp_path, "steady", 4, seed, 0.5) for seed in range(4)]
    dirs += [write_run(tmp_path, "mid", 4, seed, 0.48) for seed in range(4)]
    dirs += [
        write_run(tmp_path, "spiky", 4, seed, v) for seed, v in enumerate((0.0, 0.7, 0.7, 0.7))
    ]
    rows = [r for r in leaderboard([read_run(d, RULE) for d in dirs], None) if r.staleness == 4]
    assert [r.method for r in rows] == ["steady", "mid", "spiky"]
    spiky = rows[2]
    assert (spiky.ended_low, spiky.val_success_mean) == (1, pytest.approx(0.525))
    assert spiky.val_success_iqm == pytest.approx(0.7)  # the highest IQM, ranked last
    assert spiky.overlaps_best  # bold still marks the interval of the highest IQM


def test_the_curves_figure_splits_the_methods_by_family_a_few_per_panel(tmp_path: Path):
    """13 methods overlaid in one panel were unreadable: a row per method family, a column
    per staleness, the on-policy runs and the baseline dashed in every panel."""
    arena = load_experiment(experiment_path("arena"))
    families = {}
    for method, overrides in arena.methods.items():
        cfg = load_config(None, [f"{k}={json.dumps(v) if isinstance(v, str) else v}"
                                 for k, v in overrides.items()])  # fmt: skip
        families[method] = method_family(cfg.algorithm.model_dump())
    assert families["ppo_behavior"] == families["st_ppo_tau"] == FAMILIES[0]
    assert families["ppo_tis"] == families["ppo_loglinear"] == FAMILIES[1]
    assert families["ppo_icepop"] == families["m2po"] == families["ppo_geo_mis"] == FAMILIES[2]
    assert families["st_ppo"] == families["gspo"] == families["cispo"] == FAMILIES[3]
    largest = max(list(families.values()).count(f) for f in FAMILIES)
    assert largest <= 4  # with the two references, at most six lines in a panel

    dirs = [write_run(tmp_path / "runs", "ppo_tis", 0, 0, 0.5)]
    for method in ("ppo_behavior", "ppo_tis", "st_ppo"):
        dirs += [write_run(tmp_path / "runs", method, 4, seed, 0.4) for seed in (0, 1)]
    runs = []
    for d in dirs:
        run = read_run(d, RULE)
        run.family = families[run.method]
        runs.append(run)
    grid = curve_panels(runs, baseline="ppo_behavior")
    assert [[(p.family, p.staleness, p.methods) for p in row] for row in grid] == [
        [(FAMILIES[0], 4, ["ppo_behavior"])],
        [(FAMILIES[1], 4, ["ppo_tis"])],
        [(FAMILIES[3], 4, ["st_ppo"])],
    ]
    assert grid[0][0].references == [("ppo_tis", 0)]  # the baseline is the panel's own
    assert grid[1][0].references == [("ppo_tis", 0), ("ppo_behavior", 4)]
    out = plot_curves(runs, tmp_path / "curves.png", "kl_curve", "ppo_behavior", window=2)
    assert out.stat().st_size > 0
