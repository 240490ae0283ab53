"""The docs name only commands, flags and repository files that exist
(scripts/check_docs_refs.py, also run by `make docs`), and the results and benchmarks pages
stay short: their headline tables, with the full record under docs/results/."""

from __future__ import annotations

import pytest
from script_modules import load_script

from services.env import PROJECT_ROOT

refs = load_script(PROJECT_ROOT / "scripts" / "check_docs_refs.py", "check_docs_refs")


def test_the_docs_name_only_existing_commands_flags_and_files():
    found, counts = refs.check()
    problems = [str(p) for p in found]
    assert [p for p in problems if p not in refs.KNOWN] == []
    # a known problem that was fixed leaves its entry stale: remove it from KNOWN
    assert sorted(refs.KNOWN - set(problems)) == []
    assert counts["commands"] > 100 and counts["paths"] > 200  # the docs were read


def write_docs(root, text: str) -> None:
    (root / "docs").mkdir()
    (root / "docs" / "page.md").write_text(text)
    (root / "learner").mkdir()
    (root / "learner" / "losses.py").write_text("")
    (root / "deploy" / "configs").mkdir(parents=True)
    (root / "deploy" / "configs" / "cpu_demo.toml").write_text("")


GOOD = """# A page

```bash
.venv/bin/stppo train @deploy/configs/cpu_demo.toml --overwrite   # a comment: stppo frob
stppo prepare-synthetic && stppo experiment arena --summary-only
kubectl -n stppo logs deploy/stppo-retrieval
```

The loss is in `learner/losses.py::ppo_loss`; run `stppo ctl set buffer.max_staleness=4`,
or `stppo ctl COMMAND [ARGS]...`; results land in `runs/<name>/` and `learner/*.py`.
"""


def test_a_page_with_real_commands_and_files_passes(tmp_path):
    write_docs(tmp_path, GOOD)
    found, counts = refs.check(tmp_path)
    assert [str(p) for p in found] == []
    assert counts["commands"] == 5
    assert counts["paths"] == 2  # the config and learner/losses.py; no placeholder, no kubectl


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("```bash\nstppo trian @x.toml\n```", "`stppo` has no command 'trian'"),
        ("Run `stppo train --max-steps 3`.", "`stppo train` has no option --max-steps"),
        ("```\nSTPPO_X=1 stppo ctl frob\n```", "`stppo ctl` has no command 'frob'"),
        ("```\nstppo experiment arena --sumary-only\n```", "has no option --sumary-only"),
        ("See `learner/lossess.py`.", "learner/lossess.py: no such file"),
        ("```\npython scripts/missing.py\n```", "scripts/missing.py: no such file"),
    ],
    ids=["command", "inline-flag", "subcommand", "flag", "inline-path", "code-path"],
)
def test_a_wrong_command_flag_or_path_fails(tmp_path, text, expected):
    write_docs(tmp_path, text)
    found, _ = refs.check(tmp_path)
    assert len(found) == 1 and expected in str(found[0]), found


@pytest.mark.parametrize("page", ["results.md", "benchmarks.md"])
def test_results_and_benchmarks_pages_stay_short(page):
    lines = (PROJECT_ROOT / "docs" / page).read_text().count("\n")
    assert lines < 250, f"docs/{page}: move the record to docs/results/*_log.md"
