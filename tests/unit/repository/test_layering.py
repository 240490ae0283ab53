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


def import_cycles(root=PROJECT_ROOT, packages=PACKAGES) -> list[list[str]]:
    """The import circles among the modules of ``packages`` under ``root``: every strongly
    connected set of two or more modules (Tarjan), counting every import at any depth, lazy
    ones inside functions and ``TYPE_CHECKING`` ones too; ``from a import b`` counts as
    importing the module ``a.b`` where one exists."""
    files = {}
    for package in packages:
        for path in _modules(package, root):
            parts = path.relative_to(root).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in files.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                deps |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        graph[name] = sorted(d for d in deps if d in files and d != name)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


def test_no_import_circle_in_the_product():
    """No module of ours imports one that imports it back, directly or around a circle,
    even lazily inside a function or for type checking only."""
    assert import_cycles() == []


def test_an_import_circle_is_found(tmp_path):
    (tmp_path / "learner").mkdir()
    (tmp_path / "learner" / "batch.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from learner.packing import X\n"
    )
    (tmp_path / "learner" / "packing.py").write_text("from learner import batch\n")
    (tmp_path / "learner" / "other.py").write_text("from learner.batch import Y\n")
    assert import_cycles(tmp_path, ("learner",)) == [["learner.batch", "learner.packing"]]


LOOP_PARTS = sorted(p for p in (PROJECT_ROOT / "services" / "loop").glob("*.py"))
RAY_FREE_PARTS = ("report", "live_config", "checkpoint", "guard", "guard_state", "ladder",
                  "autopilot")  # fmt: skip


def test_the_loop_parts_do_not_import_the_driver():
    """The parts of ``services/loop`` never reference the orchestrator (style rule 14)."""
    offenders = [p.name for p in LOOP_PARTS if "services.driver" in _imported_modules(p)]
    assert offenders == [], offenders


def test_ray_is_imported_in_one_place_per_part_and_not_in_the_ray_free_ones():
    """A part that needs Ray imports it once, at module level; the report, live-config,
    checkpoint and stability-guard parts (and what they import from services) need none."""
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


LONG_MODULES = {
    "learner/losses.py": "the ST-PPO family's losses in one module: every variant's policy "
    "loss, the clip-bias terms and the value loss share the segment and ratio helpers, and "
    "the mutation tests take it as one unit",
    "prepare/qa.py": "the three QA sets' generators, one family of question templates per "
    "source; they share the split hash and the admission heuristics",
    "experiments/grid.py": "the experiment grid runner with its per-run summary and the "
    "statistics of its report (bootstrap intervals, Welch tests), read together",
    "experiments/arena.py": "the off-policy arena's boards: the cells' ranking, failure "
    "counts and intervals, and the figures drawn from them",
}
"""Product modules allowed over :data:`MAX_MODULE_LINES` lines, with the reason."""

MAX_MODULE_LINES = 800


def test_no_product_module_is_over_800_lines_but_the_named_ones():
    packages = ("actors", "learner", "services", "retrieval_server", "experiments", "prepare")
    long = {
        str(path.relative_to(PROJECT_ROOT)): len(path.read_text().splitlines())
        for package in packages
        for path in (PROJECT_ROOT / package).rglob("*.py")
        if len(path.read_text().splitlines()) > MAX_MODULE_LINES
    }
    assert set(long) <= set(LONG_MODULES), {k: v for k, v in long.items() if k not in LONG_MODULES}
    assert set(LONG_MODULES) <= set(long), "a named module is short now: drop it from the list"
