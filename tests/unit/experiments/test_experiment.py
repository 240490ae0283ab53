"""The experiment grid: planning, the collapse rule and the summary, on synthetic run
directories whose numbers are computed by hand in the comments."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from experiments.collapse import CollapseRule, detect_collapse, run_collapsed
from experiments.grid import (
    EXPERIMENTS_DIR,
    ExperimentSpec,
    experiment_path,
    load_experiment,
    plan_runs,
    plan_warm_start,
    run_name,
    summarize_experiment,
    summarize_run,
    summary_markdown,
    warm_start_policy_dir,
    write_summary,
)
from services.config import ConfigError, load_config

NAN = math.nan


@pytest.mark.parametrize(
    ("values", "rule", "expected"),
    [
        # best before the last 2 = 0.6; last two 0.3, 0.35 both < 0.6 - 0.2 = 0.4
        ([0.2, 0.6, 0.3, 0.35], dict(window=1, last_k=2, drop=0.2), (True, 0.6, 0.35)),
        # recovers: 0.5 >= 0.4
        ([0.2, 0.6, 0.3, 0.5], dict(window=1, last_k=2, drop=0.2), (False, 0.6, 0.5)),
        # smoothed (window 2): [0, .4, .8, .5, .2, .1]; best of [0, .4, .8, .5] = .8;
        # last [.2, .1] < .6
        ([0.0, 0.8, 0.8, 0.2, 0.2, 0.0], dict(window=2, last_k=2, drop=0.2), (True, 0.8, 0.2)),
        # last 3 = [.5, .2, .1]: .5 < .8 - .2 = .6 -> collapsed
        ([0.0, 0.8, 0.8, 0.2, 0.2, 0.0], dict(window=2, last_k=3, drop=0.2), (True, 0.8, 0.5)),
        # drop .35: .5 is not < .8 - .35 = .45 -> not collapsed
        ([0.0, 0.8, 0.8, 0.2, 0.2, 0.0], dict(window=2, last_k=3, drop=0.35), (False, 0.8, 0.5)),
        # NaN steps are skipped: finite [.5, .5, .1, .1]; best .5, last [.1, .1] < .3
        ([0.5, NAN, 0.5, 0.1, 0.1], dict(window=1, last_k=2, drop=0.2), (True, 0.5, 0.1)),
        # a steady climb never collapses
        ([0.1, 0.2, 0.3, 0.4, 0.5], dict(window=1, last_k=3, drop=0.2), (False, 0.2, 0.5)),
    ],
)
def test_detect_collapse_hand_computed(values, rule, expected):
    check = detect_collapse(values, CollapseRule(**rule))
    assert check.collapsed is expected[0]
    assert check.best == pytest.approx(expected[1])
    assert check.last_max == pytest.approx(expected[2])


def test_detect_collapse_too_short_is_undecided():
    # last_k = 3 needs 4 finite values
    check = detect_collapse([0.9, NAN, 0.0, 0.0], CollapseRule(window=1, last_k=3))
    assert check.collapsed is None and math.isnan(check.best)


def test_run_collapsed_any_metric():
    rule = CollapseRule(window=1, last_k=2, drop=0.2)
    flat = {"success_rate": 0.5}
    # success flat at .5; reward .9, .9, .1, .1: best .9, last two < .7 -> collapsed
    steps = [{**flat, "reward_mean": r} for r in (0.9, 0.9, 0.1, 0.1)]
    assert run_collapsed(steps, rule) is True
    steps = [{**flat, "reward_mean": r} for r in (0.9, 0.9, 0.8, 0.9)]
    assert run_collapsed(steps, rule) is False
    assert run_collapsed(steps[:2], rule) is None


def write_run(run_dir: Path, steps: list[dict], evals: list[dict], **config) -> None:
    run_dir.mkdir(parents=True)
    overrides = [f"{k}={json.dumps(v)}" for k, v in config.items()]
    (run_dir / "config.json").write_text(load_config(None, overrides).model_dump_json())
    (run_dir / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    (run_dir / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))


def test_summarize_run_hand_computed(tmp_path: Path):
    steps = [
        {"step": 1, "variant": "ppo", "success_rate": 0.25, "reward_mean": 0.25,
         "clip_ratio": 0.1, "approx_kl": 0.01, "staleness_mean": 0.0, "elapsed_s": 10.0},
        {"step": 2, "variant": "ppo", "success_rate": 0.5, "reward_mean": 0.5,
         "clip_ratio": 0.2, "approx_kl": 0.03, "staleness_mean": 1.0, "elapsed_s": 20.0},
        {"step": 3, "variant": "ppo", "success_rate": 0.5, "reward_mean": 0.5,
         "clip_ratio": 0.3, "approx_kl": 0.02, "staleness_mean": 2.0, "elapsed_s": 30.0},
        {"step": 4, "variant": "ppo", "success_rate": 0.125, "reward_mean": 0.125,
         "clip_ratio": 0.0, "approx_kl": 0.0, "staleness_mean": 1.0, "elapsed_s": 40.5},
    ]  # fmt: skip
    evals = [
        {"tag": "before_warm_start", "success_rate": 0.9},  # not RL: excluded from "best"
        {"tag": "start", "success_rate": 0.25},
        {"tag": "end", "success_rate": 0.375},
    ]
    run_dir = tmp_path / "variant-ppo_max_staleness-4_seed-7"
    write_run(
        run_dir,
        steps,
        evals,
        **{"algorithm.variant": "ppo", "buffer.max_staleness": 4, "run.seed": 7},
    )
    s = summarize_run(run_dir, CollapseRule())
    assert (s.run, s.variant, s.max_staleness, s.seed, s.num_steps) == (
        run_dir.name, "ppo", 4, 7, 4,
    )  # fmt: skip
    assert (s.val_success_start, s.val_success_final, s.val_success_best) == (0.25, 0.375, 0.375)
    assert (s.train_success_first, s.train_success_last, s.train_success_best) == (0.25, 0.125, 0.5)
    # default rule: window 3 -> [.25, .375, .41667, .375]; best of [.25] = .25; .375 > .05
    assert s.collapsed is False
    assert s.clip_ratio_mean == pytest.approx(0.15)  # (.1 + .2 + .3 + 0) / 4
    assert s.approx_kl_mean == pytest.approx(0.015)  # (.01 + .03 + .02 + 0) / 4
    assert math.isnan(s.clip_bias_norm_mean)  # not in these steps: NaN, shown as -
    assert s.staleness_mean == pytest.approx(1.0)  # (0 + 1 + 2 + 1) / 4
    assert s.wall_s == 40.5


def test_summary_files(tmp_path: Path):
    run_dir = tmp_path / "r"
    steps = [{"step": i, "variant": "st_ppo", "success_rate": v, "clip_ratio": 0.5}
             for i, v in enumerate((0.5, 0.75, 0.0, 0.0), 1)]  # fmt: skip
    write_run(run_dir, steps, [{"tag": "start", "success_rate": 0.5}])
    rule = CollapseRule(window=1, last_k=2, drop=0.2)
    s = summarize_run(run_dir, rule)
    assert s.collapsed is True  # best .75; last two 0 < .55 (reward_mean absent: undecided)
    json_path, md_path = write_summary([s], rule, tmp_path / "out", {"experiment": "x"})
    payload = json.loads(json_path.read_text())
    assert payload["experiment"] == "x"
    assert payload["collapse_rule"] == {
        "drop": 0.2, "last_k": 2, "window": 1, "metrics": ["success_rate", "reward_mean"],
        "malformed": 0.5,
    }  # fmt: skip
    row = payload["runs"][0]
    assert row["val_success_final"] is None  # no "end" eval: NaN -> null
    assert (row["collapsed"], row["clip_ratio_mean"], row["train_success_best"]) == (
        True,
        0.5,
        0.75,
    )
    md = md_path.read_text()
    assert md == summary_markdown([s], rule)
    lines = md.splitlines()
    assert lines[0].startswith("| run | variant | max staleness | seed | steps |")
    assert lines[2] == (
        "| r | st_ppo | 1 | 0 | 4 | 0.500 | - | 0.500 | 0.500 | 0.000 | yes | 0.500 | - | - | - | - |"
    )
    assert "all more than 0.2 below the best earlier value" in md


def test_plan_runs_of_the_shipped_grid():
    spec = load_experiment(experiment_path("ppo_vs_st_ppo"))
    runs = plan_runs(spec, "ppo_vs_st_ppo", Path("out"), ["run.eval_questions=6"])
    assert [r.name for r in runs] == [
        "variant-ppo_max_staleness-0_seed-0",
        "variant-ppo_max_staleness-4_seed-0",
        "variant-st_ppo_max_staleness-0_seed-0",
        "variant-st_ppo_max_staleness-4_seed-0",
    ]
    for r in runs:
        cfg = r.config
        assert (cfg.algorithm.variant, cfg.buffer.max_staleness) == (
            r.grid_values["algorithm.variant"], r.grid_values["buffer.max_staleness"],
        )  # fmt: skip
        assert (cfg.run.seed, cfg.run.num_steps) == (0, spec.num_steps)
        assert cfg.run_dir == Path("out") / "ppo_vs_st_ppo" / r.name
        assert cfg.run.eval_questions == 6  # the extra override wins over the grid's
        assert cfg.sft.num_demonstrations == spec.overrides["sft.num_demonstrations"]
    # same seed and budget for every run: the configs differ only in the grid keys and name
    a, b = (json.loads(r.config.model_dump_json()) for r in runs[:2])
    a["buffer"].pop("max_staleness"), b["buffer"].pop("max_staleness")
    a["run"].pop("name"), b["run"].pop("name")
    assert a == b


def test_shared_warm_start_plan(tmp_path: Path):
    spec = ExperimentSpec(
        grid={"algorithm.variant": ["ppo", "st_ppo"]},
        seeds=[5, 6],
        num_steps=3,
        shared_warm_start=True,
        overrides={"sft.num_demonstrations": 16, "run.eval_questions": 9},
        warm_start_overrides={"ray.num_cpus": 3, "ray.learner_cpus": 2},
    )
    warm = plan_warm_start(spec, "exp", tmp_path)
    policy = tmp_path / "exp" / "warm_start" / "checkpoints" / "step_000000" / "hf_policy"
    assert warm_start_policy_dir(spec, "exp", tmp_path) == policy
    cfg = warm.config
    assert (cfg.run.name, cfg.run.seed, cfg.run.num_steps, cfg.run.eval_questions) == (
        "warm_start", 5, 0, 0,
    )  # fmt: skip
    assert (cfg.sft.enabled, cfg.sft.num_demonstrations) == (True, 16)
    assert (cfg.ray.num_cpus, cfg.ray.learner_cpus) == (3, 2.0)
    runs = plan_runs(spec, "exp", tmp_path)
    assert len(runs) == 4  # 2 variants x 2 seeds
    for r in runs:
        assert (r.config.model.path, r.config.sft.enabled) == (policy, False)
        assert r.config.ray.learner_cpus == 1.0  # the warm start's overrides stay its own
        assert (r.config.run.eval_questions, r.config.run.num_steps) == (9, 3)
    spec.shared_warm_start = False
    assert plan_warm_start(spec, "exp", tmp_path) is None
    assert all(r.config.sft.enabled for r in plan_runs(spec, "exp", tmp_path))


def test_exclude_leaves_out_matching_points_only(tmp_path: Path):
    spec = ExperimentSpec(
        grid={"algorithm.off_policy": ["decoupled", "behavior"], "buffer.max_staleness": [8, 0]},
        exclude=[{"algorithm.off_policy": "behavior", "buffer.max_staleness": 0}],
        overrides={"algorithm.variant": "ppo"},
        num_steps=1,
    )
    # 2 x 2 points, one excluded: the three others in grid order
    assert [r.name for r in plan_runs(spec, "x", tmp_path)] == [
        "off_policy-decoupled_max_staleness-8_seed-0",
        "off_policy-decoupled_max_staleness-0_seed-0",
        "off_policy-behavior_max_staleness-8_seed-0",
    ]
    with pytest.raises(ValueError, match=r"exclude entry .*\['run\.seed'\]"):
        ExperimentSpec(grid={"buffer.max_staleness": [0]}, exclude=[{"run.seed": 0}])
    # the shipped answer grid: behavior / 0 and st_ppo / 0 are not run, ppo / decoupled / 0 is
    answer = load_experiment(experiment_path("stability_answer"))
    names = [r.name for r in plan_runs(answer, "a", tmp_path)]
    assert len(names) == 5 * len(answer.seeds)
    assert not [n for n in names if "behavior_max_staleness-0" in n]
    assert not [n for n in names if n.startswith("variant-st_ppo") and "staleness-0" in n]
    assert "variant-ppo_off_policy-decoupled_max_staleness-0_seed-0" in names


@pytest.mark.parametrize("path", sorted(EXPERIMENTS_DIR.glob("*.toml")), ids=lambda p: p.stem)
def test_every_experiment_toml_plans(path: Path):
    spec = load_experiment(path)
    assert plan_runs(spec, path.stem, Path("out"))


def test_bad_grids_fail_with_clear_errors(tmp_path: Path):
    with pytest.raises(
        ConfigError, match=r"no experiment 'nope'.*known: \['arena', 'ppo_vs_st_ppo'"
    ):
        experiment_path("nope")
    spec = ExperimentSpec(grid={"algorithm.variant": ["ppo", "bogus"]}, num_steps=1)
    with pytest.raises(ConfigError, match=r"run variant-bogus_seed-0: .*algorithm"):
        plan_runs(spec, "x", tmp_path)
    with pytest.raises(ValueError, match=r"'run\.seed' is set by the experiment itself"):
        ExperimentSpec(grid={"run.seed": [1, 2]})
    with pytest.raises(ValueError, match=r"grid axis 'buffer\.max_staleness' has no values"):
        ExperimentSpec(grid={"buffer.max_staleness": []})
    bad = tmp_path / "bad.toml"
    bad.write_text('num_stepz = 3\n[grid]\n"buffer.max_staleness" = [0]\n')
    with pytest.raises(ConfigError, match="num_stepz: Extra inputs are not permitted"):
        load_experiment(bad)


def test_run_name():
    assert run_name({"algorithm.variant": "ppo", "buffer.max_staleness": 4}, 0) == (
        "variant-ppo_max_staleness-4_seed-0"
    )


def test_summarize_experiment_of_a_partial_grid(tmp_path: Path):
    experiments = tmp_path / "experiments"
    experiments.mkdir()
    (experiments / "g.toml").write_text(
        'num_steps = 4\n[grid]\n"algorithm.variant" = ["ppo", "st_ppo"]\n'
    )
    out = tmp_path / "runs"
    steps = [{"step": i, "variant": "ppo", "success_rate": 0.25 * i, "clip_ratio": 0.1}
             for i in (1, 2)]  # fmt: skip
    # only the first run has started (2 of its 4 steps logged); the second has no directory
    write_run(out / "g" / "variant-ppo_seed-0", steps, [{"tag": "start", "success_rate": 0.5}])
    result = summarize_experiment("g", out, experiments_dir=experiments)
    assert [(s.run, s.num_steps, s.train_success_last) for s in result.summaries] == [
        ("variant-ppo_seed-0", 2, 0.5)
    ]
    payload = json.loads(result.summary_json.read_text())
    assert payload["runs_planned"] == ["variant-ppo_seed-0", "variant-st_ppo_seed-0"]
    assert result.figure == out / "g" / "curves.png" and result.figure.stat().st_size > 10_000


def test_format_collapse_counts_even_when_success_never_rose():
    """The ST-PPO staleness-4 run: success flat at 0.08, malformed answers up to 83%."""
    steps = [
        {"success_rate": 0.08, "reward_mean": 0.08, "malformed_rate": m}
        for m in (0.17, 0.1, 0.3, 0.6, 0.8, 0.83, 0.83)
    ]
    assert run_collapsed(steps, CollapseRule()) is True
    assert run_collapsed(steps, CollapseRule(malformed=None)) is False
    healthy = [dict(s, malformed_rate=0.1) for s in steps]
    assert run_collapsed(healthy, CollapseRule()) is False


# --------------------------------------------------------------------------- methods


def method_spec(**extra) -> ExperimentSpec:
    return ExperimentSpec.model_validate({
        "num_steps": 2,
        "seeds": [0, 1],
        "grid": {"method": ["plain", "tis3"], "buffer.max_staleness": [4, 16]},
        "extra_points": [{"method": "plain", "buffer.max_staleness": 0}],
        "methods": {
            "plain": {"algorithm.variant": "ppo", "algorithm.off_policy": "behavior"},
            "tis3": {"algorithm.variant": "ppo", "algorithm.off_policy": "decoupled",
                     "algorithm.rollout_correction.is_cap": 3.0},
        },
        **extra,
    })  # fmt: skip


def test_methods_expand_to_their_overrides_and_label_the_run(tmp_path: Path):
    planned = plan_runs(method_spec(seed_major=True), "a", tmp_path)
    # 2 methods x 2 staleness levels + the extra point, x 2 seeds, seed-major
    assert [(r.grid_values["method"], r.grid_values["buffer.max_staleness"], r.seed)
            for r in planned[:5]] == [("plain", 4, 0), ("plain", 16, 0), ("tis3", 4, 0),
                                      ("tis3", 16, 0), ("plain", 0, 0)]  # fmt: skip
    assert len(planned) == 10
    tis = planned[2].config
    assert tis.run.label == "tis3" and tis.algorithm.rollout_correction.is_cap == 3.0
    assert planned[2].name == "method-tis3_max_staleness-4_seed-0"
    plain = planned[0].config
    assert plain.run.label == "plain" and plain.algorithm.off_policy == "behavior"


def test_bad_methods_fail_naming_the_problem():
    with pytest.raises(ValueError, match=r"method\(s\) \['nope'\] have no \[methods"):
        method_spec(grid={"method": ["plain", "nope"]})
    with pytest.raises(ValueError, match=r"extra point .* must give exactly the grid's axes"):
        method_spec(extra_points=[{"method": "plain"}])
    with pytest.raises(ValueError, match=r"baseline_method 'x' is not a method"):
        method_spec(baseline_method="x")
    with pytest.raises(ValueError, match=r"method 'plain' sets \['buffer.max_staleness'\]"):
        method_spec(methods={"plain": {"buffer.max_staleness": 2}, "tis3": {}})


def test_more_seeds_go_to_the_cells_whose_interval_overlaps_the_best(tmp_path: Path):
    spec = method_spec(
        seeds=[0, 1, 2], grid={"method": ["plain", "tis3"], "buffer.max_staleness": [4]},
        extra_points=[], more_seeds={"seeds": [7]},
    )  # fmt: skip
    base = plan_runs(spec, "a", tmp_path, more_seeds=False)
    assert len(plan_runs(spec, "a", tmp_path)) == 6  # nothing finished: nothing decided
    # plain ends at .50, .52, .54 and tis3 at .10, .12, .14: intervals [.50, .54] and
    # [.10, .14] do not overlap, so only the best (plain) gets seed 7
    finals = {"plain": [0.50, 0.52, 0.54], "tis3": [0.10, 0.12, 0.14]}
    for run in base:
        value = finals[run.grid_values["method"]][run.seed]
        write_run(run.config.run_dir, [], [{"tag": "end", "success_rate": value}])
    extra = plan_runs(spec, "a", tmp_path)[6:]
    assert [(r.grid_values["method"], r.seed) for r in extra] == [("plain", 7)]
    # tis3 at .50, .53, .56 overlaps [.50, .54]: both get seed 7
    for run in base:
        if run.grid_values["method"] == "tis3":
            value = [0.50, 0.53, 0.56][run.seed]
            (run.config.run_dir / "eval.jsonl").write_text(
                json.dumps({"tag": "end", "success_rate": value}) + "\n"
            )
    extra = plan_runs(spec, "a", tmp_path)[6:]
    assert sorted(r.grid_values["method"] for r in extra) == ["plain", "tis3"]
    # an excluded cell overlaps as much and gets none (it still counts for the best)
    spec.more_seeds.exclude = [{"method": "tis3"}]
    extra = plan_runs(spec, "a", tmp_path)[6:]
    assert [(r.grid_values["method"], r.seed) for r in extra] == [("plain", 7)]
    with pytest.raises(ValueError, match=r"more_seeds.exclude entry \{'seed': 1\} names no grid"):
        method_spec(more_seeds={"seeds": [7], "exclude": [{"seed": 1}]})


def test_only_selects_runs_by_axis_and_seed(tmp_path: Path):
    from experiments.grid import parse_only, select_runs

    spec = method_spec()
    only = parse_only(spec, ["method=tis3", "method=plain", "buffer.max_staleness=16", "seed=1"])
    assert only == {"method": ["tis3", "plain"], "buffer.max_staleness": [16], "seed": [1]}
    chosen = select_runs(plan_runs(spec, "a", tmp_path), only)
    assert [r.name for r in chosen] == [
        "method-plain_max_staleness-16_seed-1", "method-tis3_max_staleness-16_seed-1",
    ]  # fmt: skip
    with pytest.raises(ConfigError, match="expected AXIS=VALUE"):
        parse_only(spec, ["variant=ppo"])
