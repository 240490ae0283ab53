"""The generated reference pages (docs/reference/*.md, scripts/gen_docs_reference.py) are the
code's: each committed page equals what the generator makes now, and every config field,
metric and CLI command, listed here independently of the generator, appears in its page."""

from __future__ import annotations

import re

import pytest
import typer
from prometheus_client import CollectorRegistry
from pydantic import BaseModel
from script_modules import load_script

from learner.config import VARIANT_CONFIGS
from retrieval_server.metrics import RetrievalMetrics
from services.cli import app
from services.config import RunConfig
from services.env import PROJECT_ROOT
from services.metrics import TrainingMetrics

gen = load_script(PROJECT_ROOT / "scripts" / "gen_docs_reference.py", "gen_docs_reference")
REFERENCE = PROJECT_ROOT / "docs" / "reference"


@pytest.mark.parametrize("name", sorted(gen.PAGES))
def test_committed_page_is_what_the_code_generates(name):
    committed = (REFERENCE / name).read_text(encoding="utf-8")
    assert committed == gen.PAGES[name](), (
        f"docs/reference/{name} is stale: run `python scripts/gen_docs_reference.py` "
        "and commit the result"
    )


def leaf_paths(model: type[BaseModel], prefix: str = "") -> set[str]:
    """Dotted paths of every leaf field, the algorithm union walked through every variant."""
    out: set[str] = set()
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        if name == "algorithm" and not prefix:
            for cls in VARIANT_CONFIGS.values():
                out |= leaf_paths(cls, "algorithm.")
        elif (section := gen._section_class(field.annotation)) is not None:
            out |= leaf_paths(section, f"{path}.")  # a section, optional ones too
        else:
            out.add(path)
    return out


def test_every_config_field_has_a_heading_in_the_config_page():
    page = (REFERENCE / "config.md").read_text(encoding="utf-8")
    headings = set(re.findall(r"^### `([^`]+)`$", page, re.M))
    paths = leaf_paths(RunConfig)
    # e.g. a field of one variant only, and a field of a nested section
    assert {
        "algorithm.tau",
        "algorithm.rollout_correction.mask_high",
        "rollout.retrieval.topk",
    } <= paths
    assert sorted(paths - headings) == []


def test_every_field_docstring_is_in_the_config_page():
    page = (REFERENCE / "config.md").read_text(encoding="utf-8")
    models = [RunConfig, *VARIANT_CONFIGS.values()]
    seen: set[type] = set()
    while models:
        model = models.pop()
        if model in seen:
            continue
        seen.add(model)
        for name, field in model.model_fields.items():
            if (section := gen._section_class(field.annotation)) is not None:
                models.append(section)
            if name == "variant" and model in VARIANT_CONFIGS.values():
                continue  # "Selects this variant (x)": the page's variant table lists them
            if field.description:
                assert gen.rst_to_markdown(field.description) in page, f"{model.__name__}.{name}"


def test_every_metric_is_in_the_metrics_page():
    page = (REFERENCE / "metrics.md").read_text(encoding="utf-8")
    names = set()
    for build in (TrainingMetrics, RetrievalMetrics):
        registry = CollectorRegistry()
        build(registry)
        names |= {family.name for family in registry.collect()}
    assert {"stppo_clip_ratio", "stppo_staleness", "stppo_retrieval_requests"} <= names
    assert sorted(n for n in names if f"`{n}" not in page) == []
    assert "`stppo_dropped_stale_total`" in page  # counters as scraped


def test_every_cli_command_is_in_the_cli_page():
    page = (REFERENCE / "cli.md").read_text(encoding="utf-8")
    root = typer.main.get_command(app)
    ctx = root.context_class(root, info_name="stppo")
    commands, options = [], []

    def walk(group, ctx, path):
        for name in group.list_commands(ctx):
            command = group.get_command(ctx, name)
            commands.append(f"{path} {name}")
            options.extend(o for p in command.params for o in p.opts if o.startswith("--"))
            if hasattr(command, "list_commands"):
                walk(
                    command,
                    command.context_class(command, info_name=name, parent=ctx),
                    f"{path} {name}",
                )

    walk(root, ctx, "stppo")
    assert {"stppo train", "stppo ctl set", "stppo experiment"} <= set(commands)
    headings = set(re.findall(r"^## (stppo.*)$", page, re.M))
    assert sorted(set(commands) - headings) == []
    assert sorted({o for o in options if f"`{o}" not in page}) == []


def test_check_mode_names_a_stale_page(tmp_path, capsys):
    for name, generate in gen.PAGES.items():
        (tmp_path / name).write_text(generate(), encoding="utf-8")
    assert gen.main(["--check", "--out", str(tmp_path)]) == 0
    (tmp_path / "cli.md").write_text("# hand-edited\n", encoding="utf-8")
    assert gen.main(["--check", "--out", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "stale:" in out and "cli.md" in out and "config.md" not in out
