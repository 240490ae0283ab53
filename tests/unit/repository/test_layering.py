"""The one-way import rules between the packages (CONTRIBUTING, "Layout").

- ``learner/`` and ``actors/`` import nothing of ``services``, ``experiments`` or
  ``prepare``, and run without Ray (the GPU machine has neither Ray nor the services'
  dependencies);
- ``retrieval_server/`` stands alone: none of the other packages;
- ``prepare/`` (offline assets) never imports ``services`` or ``experiments``, nor Ray;
- ``services/`` imports ``experiments`` and ``prepare`` only in ``services/cli.py``, the
  composition root: the process layer holds no grid statistics and no asset building;
- ``experiments/`` depends on the product, the product never on it (the rules above);
- no installed package imports the namespace cluster tool (``deploy/local_cluster``).
"""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from services.env import PROJECT_ROOT

LOWER = ("learner", "actors")
PACKAGES = ("services", "learner", "actors", "retrieval_server", "prepare", "experiments")
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "learner": ("services", "experiments", "prepare", "ray"),
    "actors": ("services", "experiments", "prepare", "ray"),
    "retrieval_server": ("services", "learner", "actors", "experiments", "prepare", "ray"),
    "prepare": ("services", "experiments", "ray"),
    "services": ("experiments", "prepare"),
    "experiments": (),
}
COMPOSITION_ROOT = "services/cli.py"  # the one module of services that imports the two above
TOOLS = ("local_cluster",)  # deploy/local_cluster: a tool, never imported by a package


def _modules(package: str, root=PROJECT_ROOT) -> list:
    return sorted((root / package).rglob("*.py"))


def _imports(path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import of a file, at any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def layering_violations(package: str, root=PROJECT_ROOT) -> list[str]:
    """``path:line module`` for every import of ``package`` (under ``root``) that the rules
    forbid."""
    offenders = []
    for path in _modules(package, root):
        rel = path.relative_to(root).as_posix()
        forbidden = FORBIDDEN[package] + TOOLS
        if rel == COMPOSITION_ROOT:
            forbidden = TOOLS
        offenders += [
            f"{rel}:{line} {name}"
            for line, name in _imports(path)
            if any(name == f or name.startswith(f + ".") for f in forbidden)
        ]
    return offenders


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_follow_the_layering(package):
    assert layering_violations(package) == []


def test_the_layering_rule_names_each_violation(tmp_path):
    """Grid statistics in a service, the driver or Ray in an asset builder, the cluster tool
    anywhere: named by file and line; the composition root may import experiments."""
    files = {
        "services/cli.py": "from experiments.grid import run_experiment\n",
        "services/driver.py": "import json\n\ndef f():\n    from experiments.stability import iqm\n",
        "prepare/qa.py": "import ray\nfrom services.driver import run_training\n",
        "learner/x.py": "from local_cluster.netns import Network\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert layering_violations("services", tmp_path) == [
        "services/driver.py:4 experiments.stability"
    ]
    assert layering_violations("prepare", tmp_path) == [
        "prepare/qa.py:1 ray",
        "prepare/qa.py:2 services.driver",
    ]
    assert layering_violations("learner", tmp_path) == ["learner/x.py:1 local_cluster.netns"]


def test_importable_without_ray():
    modules = [
        f"{p}.{m.stem}" for p in LOWER for m in _modules(p)
        if m.stem != "__init__" and m.parent.name == p
    ]  # fmt: skip
    code = (
        "import sys; sys.modules['ray'] = None\n"  # `import ray` raises ImportError
        f"import importlib\nfor m in {modules!r}: importlib.import_module(m)\n"
        "assert not any(k.startswith('services') for k in sys.modules), "
        "[k for k in sys.modules if k.startswith('services')]\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=PROJECT_ROOT, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]


def _imported_modules(path) -> set[str]:
    """Every absolute module a file imports, at any depth (function-level imports too)."""
    return {name for _, name in _imports(path)}


def test_no_import_cycle_among_services_modules():
    """No ``services`` module imports another that imports it back, even lazily inside a
    function (the experiment grid and its statistics did, when they lived in services)."""
    graph = {
        ".".join(p.relative_to(PROJECT_ROOT).with_suffix("").parts): {
            m for m in _imported_modules(p) if m.startswith("services.")
        }
        for p in _modules("services")
        if p.parent.name in ("services", "loop") and p.stem != "__init__"
    }
    cycles = sorted(f"{a} <-> {b}" for a, deps in graph.items() for b in deps
                    if a < b and a in graph.get(b, set()))  # fmt: skip
    assert cycles == [], cycles


LOOP_PARTS = sorted(p for p in (PROJECT_ROOT / "services" / "loop").glob("*.py"))
RAY_FREE_PARTS = ("report", "live_config", "checkpoint")


def test_the_loop_parts_do_not_import_the_driver():
    """The parts of ``services/loop`` never reference the orchestrator (style rule 14)."""
    offenders = [p.name for p in LOOP_PARTS if "services.driver" in _imported_modules(p)]
    assert offenders == [], offenders


def test_ray_is_imported_in_one_place_per_part_and_not_in_the_ray_free_ones():
    """A part that needs Ray imports it once, at module level; the report, live-config and
    checkpoint parts (and what they import from services) need none."""
    for path in LOOP_PARTS:
        imports = [
            node
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Import) and any(a.name == "ray" for a in node.names)
        ]
        if path.stem in RAY_FREE_PARTS:
            assert imports == [], f"{path.name} imports ray"
        else:
            assert len(imports) <= 1, f"{path.name} imports ray {len(imports)} times"
    modules = [f"services.loop.{name}" for name in RAY_FREE_PARTS]
    code = (
        "import sys; sys.modules['ray'] = None\n"
        f"import importlib\nfor m in {modules!r}: importlib.import_module(m)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=PROJECT_ROOT, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]


def test_the_driver_and_its_parts_stay_small():
    """services/driver.py at most 300 lines with a main loop of at most 50; no part over 300."""
    driver = (PROJECT_ROOT / "services" / "driver.py").read_text()
    assert len(driver.splitlines()) <= 300
    loop = next(
        n for n in ast.walk(ast.parse(driver))
        if isinstance(n, ast.FunctionDef) and n.name == "_train_loop"
    )  # fmt: skip
    assert loop.end_lineno - loop.lineno + 1 <= 50
    for path in LOOP_PARTS:
        assert len(path.read_text().splitlines()) <= 300, path.name
