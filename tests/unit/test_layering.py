"""The one-way import rule: ``learner/`` and ``actors/`` import nothing from ``services``
and run without Ray (the GPU machine has neither Ray nor the services' dependencies)."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from services.env import PROJECT_ROOT

LOWER = ("learner", "actors")


def _modules(package: str) -> list:
    return sorted((PROJECT_ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", LOWER)
def test_no_services_imports(package):
    offenders = []
    for path in _modules(package):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            offenders += [
                f"{path.relative_to(PROJECT_ROOT)}:{node.lineno} {n}"
                for n in names
                if n == "services" or n.startswith("services.")
            ]
    assert offenders == [], offenders


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
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
    return found


def test_no_import_cycle_among_services_modules():
    """No ``services`` module imports another that imports it back, even lazily inside a
    function (``services.experiment`` and ``services.stability`` did)."""
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
