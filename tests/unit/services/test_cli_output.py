"""What people read from ``stppo``: every command's ``--help`` is plain text (no
reStructuredText markup, no Python reprs), and ``stppo prepare`` ends its index step with a
summary line like its other steps, not a dataclass repr."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import typer
from fixture_paths import FIXTURE_CORPUS
from typer.testing import CliRunner

from services.cli import app

# RST inline literals and roles, and a repr such as IndexBuildReport(method='bm25', ...) or
# PosixPath('data'): a capitalised name, "(", then a keyword or a quoted string.
MARKUP = re.compile(r"``|:(?:func|class|mod|meth|data|attr):`")
REPR = re.compile(r"\b[A-Z]\w*\((?:\w+=|['\"])")


def command_paths() -> list[list[str]]:
    """Every command and group of the CLI, as argument lists (``[]`` is ``stppo`` itself)."""
    paths: list[list[str]] = []

    def walk(command, path: list[str]) -> None:
        paths.append(path)
        # a group has .commands (typer ships its own click: no isinstance on click.Group)
        for name, sub in (getattr(command, "commands", None) or {}).items():
            walk(sub, [*path, name])

    walk(typer.main.get_command(app), [])
    return paths


def test_command_walk_finds_every_command() -> None:
    names = {" ".join(p) for p in command_paths()}
    # a sample, so a broken walk cannot make the next test pass on nothing
    assert {"", "train", "prepare", "index", "eval", "ctl", "ctl set"} <= names


@pytest.mark.parametrize("path", command_paths(), ids=lambda p: " ".join(p) or "stppo")
def test_help_has_no_markup_or_reprs(path: list[str]) -> None:
    result = CliRunner().invoke(app, [*path, "--help"], terminal_width=100)
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output
    assert not MARKUP.search(result.output), result.output
    assert not REPR.search(result.output), result.output


def test_command_summaries_are_one_line() -> None:
    # Typer's rich help keeps the line breaks of a docstring's first paragraph in the
    # command list ("... QA sets, BM25" / "index and ..."): the summary must be one line,
    # details go after a blank line.
    def walk(command, name: str) -> list[tuple[str, str]]:
        subs = (getattr(command, "commands", None) or {}).items()
        own = [(name, command.help or "")] if name else []
        return own + [pair for n, sub in subs for pair in walk(sub, f"{name} {n}".strip())]

    multi = [
        name
        for name, text in walk(typer.main.get_command(app), "")
        if "\n" in text.strip().split("\n\n")[0]
    ]
    assert not multi, f"commands whose help summary spans lines: {multi}"


def test_markup_and_repr_patterns_catch_what_they_should() -> None:
    assert MARKUP.search("Serve the retrieval server (``retrieval.server`` section)")
    assert MARKUP.search("see :func:`actors.scoring.score_answer`")
    assert REPR.search("[index] IndexBuildReport(method='bm25', directory=PosixPath('x'))")
    assert REPR.search("directory=PosixPath('data/index')")
    assert not REPR.search("Build the model, corpus, QA sets (model, corpus, qa, index).")


def test_prepare_index_step_prints_summary_lines(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus" / "passages.jsonl"
    corpus.parent.mkdir()
    shutil.copy(FIXTURE_CORPUS, corpus)
    args = ["prepare", "--data-dir", str(tmp_path), "--only", "index"]

    built = CliRunner().invoke(app, args)
    assert built.exit_code == 0, built.output
    (line,) = built.output.splitlines()
    assert re.fullmatch(
        rf"index built in \d+\.\d s: bm25 over 36 passages, \d+\.\d MiB in "
        rf"{re.escape(str(tmp_path / 'index' / 'bm25'))}, peak RSS \d+\.\d\d GiB",
        line,
    ), line

    verified = CliRunner().invoke(app, args)
    assert verified.exit_code == 0, verified.output
    (line,) = verified.output.splitlines()
    assert re.fullmatch(
        rf"index verified in \d+\.\d s: bm25 in {re.escape(str(tmp_path / 'index'))} "
        "matches the corpus",
        line,
    ), line
