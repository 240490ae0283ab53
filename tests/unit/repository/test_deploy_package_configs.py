"""The container image installs the package (not the source tree): the configs that
`stppo experiment` and the run configs name must be inside the installed package.

Builds the real wheel (``pip wheel``, as ``pip install /app`` in deploy/Dockerfile does),
unpacks it into a folder outside the source tree, and runs the experiment planning from
there, in a working directory without ``deploy/``.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from services.env import PROJECT_ROOT

_PLAN = """
import sys
from pathlib import Path
import services
from experiments.grid import experiment_path, load_experiment, plan_runs
assert Path(services.__file__).resolve().is_relative_to(Path(sys.argv[1]).resolve()), services.__file__
spec = load_experiment(experiment_path("ppo_vs_st_ppo"))
runs = plan_runs(spec, "ppo_vs_st_ppo", Path("out"))
print(len(runs), runs[0].config.learner.dtype)
"""


def test_experiment_grids_and_base_configs_are_found_in_the_installed_package(tmp_path: Path):
    wheel_dir = tmp_path / "wheel"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(wheel_dir), str(PROJECT_ROOT)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = wheel_dir.glob("st_ppo-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "services/configs/experiments/ppo_vs_st_ppo.toml" in names
    assert "services/configs/cpu_demo.toml" in names
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    work = tmp_path / "elsewhere"  # no deploy/ here: relative base_config paths miss
    work.mkdir()
    proc = subprocess.run(
        [sys.executable, "-c", _PLAN, str(site)],
        capture_output=True, text=True, timeout=120, cwd=work,
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["4", "fp32"]  # {ppo, st_ppo} x {0, 4}; the grid's dtype
