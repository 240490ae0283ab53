"""The config tree: every TOML in the repo loads; bad keys, types and bounds fail naming the field."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from learner.config import (
    VARIANT_CONFIGS,
    PPOConfig,
    STPPOConfig,
    uses_bias_correction,
    uses_critic,
)
from services.config import ConfigError, RunConfig, apply_overrides, load_config, update_config
from services.env import PROJECT_ROOT

RUN_CONFIG_TOMLS = sorted((PROJECT_ROOT / "deploy").rglob("configs/*.toml"))


def test_repo_has_run_configs():
    names = {p.name for p in RUN_CONFIG_TOMLS}
    assert "cpu_demo.toml" in names


@pytest.mark.parametrize("path", RUN_CONFIG_TOMLS, ids=lambda p: str(p.relative_to(PROJECT_ROOT)))
def test_every_toml_in_repo_loads(path: Path):
    cfg = load_config(path)
    assert isinstance(cfg, RunConfig)


def test_default_variant_is_st_ppo():
    cfg = load_config()
    assert isinstance(cfg.algorithm, STPPOConfig)
    assert uses_critic(cfg.algorithm) and uses_bias_correction(cfg.algorithm)


def test_dotted_overrides_parse_toml_values():
    cfg = load_config(
        None, ["learner.actor_lr=1e-5", "algorithm.variant=ppo", "rollout.retrieval.topk=5"]
    )
    assert cfg.learner.actor_lr == 1e-5
    assert isinstance(cfg.algorithm, PPOConfig)
    assert cfg.rollout.retrieval.topk == 5


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["learner.actor_lrr=1e-5"], "learner.actor_lrr: Extra inputs are not permitted"),
        (["learner.actor_lr=-1"], "learner.actor_lr: Input should be greater than 0"),
        (["learner.actor_lr='fast'"], "learner.actor_lr: Input should be a valid number"),
        (
            ["rollout.retrieval.topk=0"],
            "rollout.retrieval.topk: Input should be greater than or equal to 1",
        ),
        (["buffer.max_staleness=-1"], "buffer.max_staleness"),
        # tau exists only on the clipping-bias variants
        (
            ["algorithm.variant=ppo", "algorithm.tau=0.5"],
            "algorithm.ppo.tau: Extra inputs are not permitted",
        ),
        (["algorithm.variant=sppo"], "does not match any of the expected tags"),
        (
            ["algorithm.variant=grpo", "rollout.group_size=1"],
            "rollout.group_size must be >= 2 for grpo",
        ),
        (
            ["learner.train_batch_size=6", "learner.mini_batch_size=4"],
            "multiple of mini_batch_size",
        ),
        (["rollout.interrupt_every_tokens=-1"], "rollout.interrupt_every_tokens"),
        (["rollout.weight_wait_timeout_s=0"], "rollout.weight_wait_timeout_s"),
        (
            ["sync.fixed_lag=true", "rollout.interrupt_every_tokens=8"],
            "rollout.interrupt_every_tokens must be 0 with sync.fixed_lag = true (got 8)",
        ),
        (["rollout.calls_per_actor=0"], "rollout.calls_per_actor"),
        (
            ["sync.fixed_lag=true", "run.eval_every=5"],
            "run.eval_every must be 0 with sync.fixed_lag = true (got 5)",
        ),
        (
            ["sync.fixed_lag=true", "rollout.calls_per_actor=2"],
            "rollout.calls_per_actor must be 1 with sync.fixed_lag = true (got 2)",
        ),
        (["learner.gpu_memory_fraction=0"], "learner.gpu_memory_fraction"),
        (
            ["learner.compile_layers=true", "learner.zero_stage=3"],
            "learner: Value error, compile_layers needs zero_stage <= 2",
        ),
        (
            ["learner.offload_optimizer=true", "learner.zero_stage=0"],
            "learner: Value error, offload_optimizer needs zero_stage >= 1",
        ),
        (
            ["learner.offload_params=true", "learner.zero_stage=2"],
            "learner: Value error, offload_params needs zero_stage = 3, got 2",
        ),
        (
            ["learner.offload_optimizer=true", "learner.fused_adamw=true"],
            "learner: Value error, fused_adamw = true with offload_optimizer",
        ),
        (["sync.bucket_mb=0"], "sync.bucket_mb"),
        (
            ["ray.learner_gpus=1", "ray.rollout_actor_gpus=0.5", 'sync.transport="collective"'],
            "sync.transport = 'collective' with ray.rollout_actor_gpus = 0.5: ranks that "
            "share a GPU cannot be in one NCCL group",
        ),
        (
            ["ray.learner_gpus=0.5", "learner.micro_batch_tokens=-1"],
            "learner.gpu_memory_fraction = 1.0 is more than the learner's share of its GPU "
            "(ray.learner_gpus = 0.5)",
        ),
    ],
)
def test_invalid_values_fail_naming_the_field(overrides, expected):
    with pytest.raises(ConfigError) as exc:
        load_config(None, overrides)
    assert expected in str(exc.value)


def test_unknown_toml_key_names_file_and_field(tmp_path: Path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[learner]\nactor_lr = 1e-5\nzero_stag = 2\n")
    with pytest.raises(ConfigError) as exc:
        load_config(bad)
    assert str(exc.value) == f"{bad}: learner.zero_stag: Extra inputs are not permitted"


def test_missing_file_and_bad_syntax_are_config_errors(tmp_path: Path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("[learner\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(broken)


def test_override_syntax_errors():
    with pytest.raises(ConfigError, match=r"expected dotted\.key=value"):
        apply_overrides({}, ["learner.actor_lr"])
    with pytest.raises(ConfigError, match="is not a section"):
        apply_overrides({"learner": 3}, ["learner.actor_lr=1"])


def test_a_learner_sharing_its_gpu_plans_within_its_share():
    cfg = load_config(
        None,
        [
            "ray.learner_gpus=0.5",
            "learner.micro_batch_tokens=-1",
            "learner.gpu_memory_fraction=0.45",
        ],
    )
    assert cfg.learner.gpu_memory_fraction == 0.45
    assert load_config(None, ["ray.learner_gpus=0.5"]).learner.micro_batch_tokens != -1


def test_update_config_switches_variant_keeping_shared_fields():
    cfg = load_config(
        None, ["algorithm.variant=st_ppo", "algorithm.clip_eps_high=0.28", "algorithm.tau=0.5"]
    )
    # st_ppo -> grpo: shared fields (clip eps) survive, tau (not a grpo field) is dropped
    new = update_config(cfg, {"algorithm": {"variant": "grpo"}})
    assert new.algorithm.variant == "grpo"
    assert new.algorithm.clip_eps_high == 0.28
    assert not hasattr(new.algorithm, "tau")
    assert cfg.algorithm.variant == "st_ppo"  # the original is untouched


def test_update_config_is_all_or_nothing():
    cfg = load_config()
    with pytest.raises(ConfigError, match=r"buffer\.max_staleness"):
        update_config(cfg, {"learner": {"actor_lr": 1e-4}, "buffer": {"max_staleness": -3}})
    assert cfg.learner.actor_lr == load_config().learner.actor_lr


def test_every_field_has_a_docstring():
    missing = []

    def walk(model, prefix):
        for name, field in model.model_fields.items():
            if not field.description:
                missing.append(f"{prefix}{name}")
            ann = field.annotation
            if isinstance(ann, type) and hasattr(ann, "model_fields"):
                walk(ann, f"{prefix}{name}.")

    walk(RunConfig, "")
    for variant, cls in VARIANT_CONFIGS.items():
        walk(cls, f"algorithm[{variant}].")
    assert missing == []


def test_cli_reports_invalid_key_in_one_line(tmp_path: Path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[buffer]\nmax_stalenes = 2\n")
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "config", f"@{bad}"],
        capture_output=True,
        text=True,
        cwd=PROJECT_ROOT,
        timeout=60,
    )
    assert proc.returncode == 2
    assert (
        proc.stderr.strip() == f"error: {bad}: buffer.max_stalenes: Extra inputs are not permitted"
    )


def test_cli_help_lists_subcommands_without_heavy_imports():
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from services.cli import app\n"
        "r = CliRunner().invoke(app, ['--help'])\n"
        "print(r.output)\n"
        "heavy = [m for m in ('torch', 'ray', 'vllm', 'deepspeed', 'transformers') if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=PROJECT_ROOT, timeout=60
    )
    for cmd in ("train", "prepare", "serve-retrieval", "eval", "ctl", "config", "plot"):
        assert cmd in proc.stdout
    assert "HEAVY []" in proc.stdout


def test_null_sets_an_optional_number_to_none_and_leaves_strings_alone():
    st = 'algorithm.variant="st_ppo"'
    cfg = load_config(
        None, [st, "algorithm.token_log_ratio_bound=null", 'algorithm.clip_ratio_c="null"']
    )
    assert cfg.algorithm.token_log_ratio_bound is None and cfg.algorithm.clip_ratio_c is None
    # a string field keeps "null" as text (and fails its own validation where it must)
    cfg = load_config(None, ['run.label="null"'])
    assert cfg.run.label == "null"
    with pytest.raises(ConfigError, match="is_level"):
        load_config(None, [st, 'algorithm.rollout_correction.is_level="null"'])


def test_a_rollout_correction_set_under_the_behaviour_objective_fails_even_at_its_defaults():
    """The documented migration of the old behaviour-weight options (``is_level = "token"``,
    ``is_cap = 2.0``: the correction's own defaults) loaded under ``off_policy = "behavior"``
    and did nothing; an old config that relied on the former ``decoupled`` default changed
    objective without a word. What the user set is refused, naming the objective it needs."""
    ppo = 'algorithm.variant="ppo"'
    for overrides in (
        [
            'algorithm.rollout_correction.is_level="token"',
            "algorithm.rollout_correction.is_cap=2.0",
        ],
        ["algorithm.rollout_correction.is_cap=3.0"],
    ):
        with pytest.raises(ConfigError, match='off_policy = "decoupled"'):
            load_config(None, [ppo, *overrides])
    decoupled = load_config(
        None, [ppo, 'algorithm.off_policy="decoupled"', "algorithm.rollout_correction.is_cap=2.0"]
    )
    assert decoupled.algorithm.rollout_correction.is_cap == 2.0
    # a dump re-validated (every live change, a resume) is not mistaken for a setting
    behavior = load_config(None, [])
    assert update_config(behavior, {"buffer": {"max_staleness": 2}}).buffer.max_staleness == 2
    # the decoupled objective's default correction switches to behaviour live; a correction
    # the user set must be unset in the same change
    default_decoupled = load_config(None, [ppo, 'algorithm.off_policy="decoupled"'])
    switched = update_config(default_decoupled, {"algorithm": {"off_policy": "behavior"}})
    assert switched.algorithm.off_policy == "behavior"
    with pytest.raises(ConfigError, match='off_policy = "decoupled"'):
        update_config(decoupled, {"algorithm": {"off_policy": "behavior"}})
    for unset in (None, "null"):  # JSON null, or the string a config file or ctl writes
        switched = update_config(
            decoupled, {"algorithm": {"off_policy": "behavior", "rollout_correction": unset}}
        )
        assert switched.algorithm.rollout_correction is None
