#!/usr/bin/env python3
"""Fail when the docs name a command, flag or repository file that does not exist.

Usage: ``python scripts/check_docs_refs.py`` (from anywhere; `make test` runs it through
``tests/unit/repository/test_docs_refs.py``). Exit 0 with a summary, or 1 with one line per
problem (``file:line: ...``).

What it reads: every Markdown page under ``docs/`` (the generated reference included) and
``README.md``, ``CONTRIBUTING.md`` and ``deploy/README.md`` (not ``CHANGELOG.md``, which
names removed commands and moved files on purpose).

- **Commands.** In fenced code blocks and in inline code, every command that runs
  ``stppo`` (also ``.venv/bin/stppo``, after ``VAR=value``, ``sudo``, ``time``, ``timeout
  N``, ``flock FILE``; a line is split at ``&&``, ``||``, ``|`` and ``;``, and a ``#``
  comment is dropped) must walk the CLI's command tree (``services.cli.app``, a typer app):
  each word after ``stppo`` that names a subcommand of a group must exist, and each
  ``--flag`` / ``-f`` must be an option of the command reached. Arguments (configs,
  ``key=value`` overrides, run directories) are not checked; ``...``, ``<placeholders>``
  and ``UPPERCASE`` words stand for omitted ones.
- **Files.** Every path of this repository named in inline code, in a code block or as a
  link target must exist: a path whose first part is one of the repository's top-level
  folders (``learner/losses.py``, ``deploy/configs/cpu_demo.toml``,
  ``docs/results/arena_grid_summary.md``) or a top-level file (``pyproject.toml``). A path
  with a placeholder (``<name>``, ``*``, ``{a,b}``, ``...``), a file a command creates
  (``> path``), a Kubernetes resource in a ``kubectl`` line (``deploy/stppo-retrieval``)
  and the folders runs write (``runs/``, ``data/``, ``.cache/``, ``artifacts/``) are not
  checked; ``::name`` and ``:line`` suffixes are dropped. A path that names another
  project's file is listed in :data:`OTHER_PROJECTS` with its project.

:data:`KNOWN` lists the problems that sit in generated pages whose source this check's
author could not change; the test asserts the list is still accurate, so fixing one fails
the test until its entry goes.
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PAGES = ("README.md", "CONTRIBUTING.md", "deploy/README.md")
# the top-level folders whose paths are checked (what a run or a build writes is not)
REPO_DIRS = (
    "actors",
    "benchmarks",
    "deploy",
    "docs",
    "experiments",
    "learner",
    "prepare",
    "retrieval_server",
    "scripts",
    "services",
    "tests",
    ".ci",
)
REPO_FILES = (
    "pyproject.toml",
    "Makefile",
    "mkdocs.yml",
    "README.md",
    "CONTRIBUTING.md",
    "CHANGELOG.md",
    "LICENSE",
)
# paths the docs name that are another project's files, not this repository's
OTHER_PROJECTS = {
    "docs/algorithms/prox_approx.md": "AReaL",
}
# found problems whose fix is in code docstrings (docs/reference/ is generated from them)
KNOWN: set[str] = set()
PREFIX_WORDS = {"sudo", "time", "exec", "env", "nohup"}
FENCE = re.compile(r"^(\s*)(```+|~~~+)(.*)$")
INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
LINK = re.compile(r"\]\(([^)\s]+)\)")
PATH = re.compile(r"(?:^|(?<=[\s@=(\"'\[]))(\.?[A-Za-z_][\w.-]*(?:/[\w.@+-]+)+/?)")


@dataclass(frozen=True)
class Problem:
    where: str
    text: str

    def __str__(self) -> str:
        return f"{self.where}: {self.text}"


def doc_files(root: Path = ROOT) -> list[Path]:
    files = sorted((root / "docs").rglob("*.md"))
    return files + [root / p for p in PAGES if (root / p).is_file()]


def code_and_text(text: str) -> list[tuple[int, str, bool]]:
    """(line number, text, in a fenced block) for every line; inline code is found later."""
    out: list[tuple[int, str, bool]] = []
    fence: str | None = None
    for n, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if m and (fence is None or m.group(2).startswith(fence)):
            fence = None if fence else m.group(2)[:3]
            continue
        out.append((n, line, fence is not None))
    return out


# ---- commands ----------------------------------------------------------------------------


def cli_tree(app: Any = None) -> Any:
    """The root click command of the typer app (``services.cli.app`` by default)."""
    import typer

    if app is None:
        sys.path.insert(0, str(ROOT))
        from services.cli import app
    return typer.main.get_command(app)


def _options(command: Any) -> set[str]:
    names = {"--help"}
    for param in command.params:
        names |= set(param.opts) | set(param.secondary_opts)
    return names


def _command_words(part: str) -> list[str]:
    try:
        return shlex.split(part, comments=False)
    except ValueError:
        return part.split()


def command_lines(line: str) -> list[str]:
    """The arguments of each ``stppo`` command on one line of shell code (or one inline
    code span): the word that runs must be ``stppo``, after any prefix."""
    line = re.sub(r"(^|\s)#.*$", "", line)  # a shell comment
    out = []
    for part in re.split(r"&&|\|\||[|;]", line):
        words = _command_words(part.strip().lstrip("$ ").strip("()"))
        while words:
            word = words[0]
            if re.match(r"^[A-Z_][A-Z0-9_]*=", word) or word in PREFIX_WORDS:
                words = words[1:]
            elif word in ("timeout", "flock") and len(words) > 1:
                words = words[2:]
            else:
                break
        if words and (words[0] == "stppo" or words[0].endswith("/stppo")):
            out.append(shlex.join(words[1:]))
    return out


def check_command(args: str, root: Any) -> list[str]:
    """What is wrong with ``stppo <args>`` (empty when it names a real command and flags)."""
    words = _command_words(args)
    ctx = root.context_class(root, info_name="stppo")
    command, path = root, ["stppo"]
    problems = []
    for word in words:
        if word in ("...", "…") or word.startswith(("<", "$", "[")) or word.isupper():
            continue
        if word.startswith("-") and len(word) > 1 and not re.match(r"-\d", word):
            flag = word.split("=", 1)[0]
            if flag not in _options(command):
                problems.append(f"`{' '.join(path)}` has no option {flag}")
            continue
        if hasattr(command, "list_commands"):
            sub = command.get_command(ctx, word)
            if sub is None:
                problems.append(f"`{' '.join(path)}` has no command {word!r}")
                return problems
            ctx = sub.context_class(sub, info_name=word, parent=ctx)
            command, path = sub, [*path, word]
    return problems


# ---- files -------------------------------------------------------------------------------


def repo_paths(text: str) -> list[str]:
    """Candidate repository paths named in a piece of code or a link target."""
    out = []
    kubectl = re.match(r"\s*(\$\s*)?(kubectl|helm)\b", text) is not None
    for m in PATH.finditer(text):
        path = m.group(1)
        path = re.split(r"::|:(?=\d)", path)[0].rstrip(".,;:)")
        first = path.split("/", 1)[0]
        if first not in REPO_DIRS:
            continue
        after = text[m.end() : m.end() + 1]
        before = text[: m.start()].rstrip()
        if after in ("*", "<", "{", "$") or re.search(r"\.\.\.|\bN\b|_N\b", path):
            continue  # a placeholder
        if before.endswith(">"):
            continue  # a file the command writes
        if kubectl and first == "deploy" and path.count("/") == 1 and "." not in path:
            continue  # a Kubernetes Deployment (kubectl's deploy/NAME)
        out.append(path)
    return out


def path_exists(path: str, root: Path = ROOT) -> bool:
    return path in OTHER_PROJECTS or (root / path).exists()


def check_link(target: str, page: Path, root: Path = ROOT) -> str | None:
    """A relative link to a repository file outside docs/ (README's links) must resolve."""
    if re.match(r"[a-z]+:|#|/", target):
        return None
    path = target.split("#", 1)[0]
    if not path:
        return None
    resolved = (page.parent / path).resolve()
    try:
        resolved.relative_to(root)
    except ValueError:
        return f"link {target} leaves the repository"
    return None if resolved.exists() else f"link {target}: no such file"


# ---- the check ---------------------------------------------------------------------------


def check(root: Path = ROOT, app: Any = None) -> tuple[list[Problem], dict[str, int]]:
    tree = cli_tree(app)
    problems: list[Problem] = []
    counts = {"commands": 0, "paths": 0, "links": 0}
    for page in doc_files(root):
        rel = page.relative_to(root).as_posix()
        check_commands = rel != "CHANGELOG.md"
        text = page.read_text(encoding="utf-8")
        for n, line, fenced in code_and_text(text):
            where = f"{rel}:{n}"
            codes = [line] if fenced else INLINE.findall(line)
            for code in codes:
                if check_commands:
                    for args in command_lines(code):
                        counts["commands"] += 1
                        problems += [Problem(where, p) for p in check_command(args, tree)]
                for path in repo_paths(code):
                    counts["paths"] += 1
                    if not path_exists(path, root):
                        problems.append(Problem(where, f"{path}: no such file in the repository"))
            if fenced:
                continue
            for target in LINK.findall(INLINE.sub("", line)):
                counts["links"] += 1
                if rel.startswith("docs/"):
                    continue  # mkdocs build --strict checks the site's links
                issue = check_link(target, page, root)
                if issue:
                    problems.append(Problem(where, issue))
    return problems, counts


def main() -> int:
    found, counts = check()
    problems = [p for p in found if str(p) not in KNOWN]
    if problems:
        print("\n".join(map(str, problems)), file=sys.stderr)
        print(f"[check_docs_refs] {len(problems)} problem(s)", file=sys.stderr)
        return 1
    print(
        f"[check_docs_refs] {counts['commands']} stppo commands, {counts['paths']} file paths "
        f"and {counts['links']} links checked: all exist"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
