"""Mutation-testing report of the core modules (``make mutation``; config in pyproject.toml).

Reads the results ``mutmut run`` leaves in ``mutants/`` and prints, per module, how many
mutants were killed (a test failed), survived (every selected test passed), had no test
reaching them, or timed out, and the survival rate ``survived / (killed + survived)``.
Survivors listed in :data:`EQUIVALENT` were read one by one and judged equivalent (no input
can tell them apart from the original); they are reported apart and left out of the
adjusted rate. Every other survivor is printed with its diff (``mutmut show``).

Usage::

    .venv/bin/python benchmarks/mutation_report.py [--json out.json] [--no-diffs]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MUTANTS = ROOT / "mutants"

_JSON_MODE = "pydantic dumps in JSON mode for any mode other than 'python'"
_GET_DEFAULT = "dict.get's default is already None"
_LOGGING = "changes uvicorn's logging only"

# mutant name -> why no input can tell it from the original (read one by one)
EQUIVALENT: dict[str, str] = {
    **{f"services.control.x_changed_fields__mutmut_{i}": _JSON_MODE for i in (4, 5, 8, 9)},
    **{f"services.control.x_public_config__mutmut_{i}": _JSON_MODE for i in (3, 4)},
    **{f"services.control.x_changed_fields__mutmut_{i}": _GET_DEFAULT for i in (14, 18)},
    **{
        f"services.control.x_public_config__mutmut_{i}": "a RunConfig dump always has "
        "'control', so the default of .get('control', ...) is never used"
        for i in (7, 9)
    },
    "services.control.x_read_limited__mutmut_7": "'and' differs only for a non-numeric "
    "Content-Length, which h11 answers with 400 before the app sees it",
    "services.control.x_start_control_server__mutmut_1": "the default start-up timeout "
    "(10 vs 11 s) only matters for a server that never starts",
    "services.control.x_start_control_server__mutmut_6": "SOCK_STREAM is socket.socket's "
    "default type",
    "services.control.x_start_control_server__mutmut_13": "any nonzero value enables SO_REUSEADDR",
    **{
        f"services.control.x_start_control_server__mutmut_{i}": _LOGGING
        for i in (19, 20, 22, 23, 25, 26)
    },
    **{
        f"services.control.x_start_control_server__mutmut_{i}": "the start-up deadline "
        "boundary (or vs and, > vs >=) is not observable in time"
        for i in (42, 44)
    },
    "learner.losses.x_kl_penalty__mutmut_42": "k3 >= 0, so its lower bound -10 never acts",
    "learner.losses.x_behavior_importance_weights__mutmut_44": "raw is 0 off the mask, and "
    "0 > cap never holds (cap > 1), so the mask test is redundant",
}


def load_results(mutants_dir: Path = MUTANTS) -> dict[str, dict[str, str]]:
    """{module path: {mutant name: status}} from ``mutants/**/*.py.meta``.

    Raises:
        FileNotFoundError: no results (run ``mutmut run`` first).
    """
    from mutmut.stats import status_by_exit_code  # mutmut's own exit-code convention

    results: dict[str, dict[str, str]] = {}
    for meta in sorted(mutants_dir.rglob("*.py.meta")):
        data = json.loads(meta.read_text())
        codes = data.get("exit_code_by_key", {})
        if not codes:
            continue
        module = str(meta.relative_to(mutants_dir)).removesuffix(".meta")
        results[module] = {name: status_by_exit_code[code] for name, code in codes.items()}
    if not results:
        raise FileNotFoundError(f"no mutmut results under {mutants_dir}: run `mutmut run`")
    return results


def summarize(results: dict[str, dict[str, str]]) -> list[dict]:
    """One row per module (and a total): counts per status, survival rates in [0, 1]."""
    rows = []
    for module, statuses in [*results.items(), ("total", _all(results))]:
        counts = Counter(statuses.values())
        survivors = [n for n, s in statuses.items() if s == "survived"]
        equivalent = [n for n in survivors if n in EQUIVALENT]
        judged = counts["killed"] + counts["survived"]
        rows.append(
            {
                "module": module,
                "mutants": len(statuses),
                **{k: counts[k] for k in ("killed", "survived", "no tests", "timeout")},
                "equivalent": len(equivalent),
                "survival": counts["survived"] / judged if judged else 0.0,
                "survival_non_equivalent": (len(survivors) - len(equivalent))
                / max(judged - len(equivalent), 1),
                "survivors": [n for n in survivors if n not in EQUIVALENT],
            }
        )
    return rows


def _all(results: dict[str, dict[str, str]]) -> dict[str, str]:
    return {name: s for statuses in results.values() for name, s in statuses.items()}


def markdown(rows: list[dict]) -> str:
    lines = [
        "| module | mutants | killed | survived | equivalent | no tests | timeout | survival "
        "| survival, equivalents out |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['module']} | {r['mutants']} | {r['killed']} | {r['survived']} | "
            f"{r['equivalent']} | {r['no tests']} | {r['timeout']} | {r['survival']:.1%} | "
            f"{r['survival_non_equivalent']:.1%} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--no-diffs", action="store_true", help="list survivors without diffs")
    args = parser.parse_args(argv)
    rows = summarize(load_results())
    print(markdown(rows))
    if EQUIVALENT:
        print("\nJudged equivalent:")
        for name, why in sorted(EQUIVALENT.items()):
            print(f"- `{name}`: {why}")
    survivors = rows[-1]["survivors"]
    print(f"\n{len(survivors)} survivor(s) not judged equivalent")
    for name in survivors:
        if args.no_diffs:
            print(f"- {name}")
            continue
        show = subprocess.run(
            [str(Path(sys.executable).with_name("mutmut")), "show", name],
            cwd=ROOT, capture_output=True, text=True, check=False,
        )  # fmt: skip
        print(show.stdout.rstrip() or f"- {name}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
