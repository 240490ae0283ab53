from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console

from services.progress import Progress


def test_step_line_keeps_its_bracketed_header(tmp_path: Path):
    buf = io.StringIO()
    progress = Progress(total_steps=20, run_dir=tmp_path, console=Console(file=buf, width=200))
    progress.step(
        {
            "step": 3,
            "policy_version": 15,
            "variant": "st_ppo",
            "reward_mean": 0.25,
            "clip_ratio": 0.0125,
        }
    )
    line = buf.getvalue()
    assert "[step 3/20 v15 st_ppo]" in line
    assert "reward=0.250" in line and "clip=0.013" in line


def test_step_line_gives_the_time_left_from_the_recent_steps(tmp_path: Path):
    buf = io.StringIO()
    progress = Progress(total_steps=10, run_dir=tmp_path, console=Console(file=buf, width=300))
    for step, wall in ((1, 100.0), (2, 60.0), (3, 60.0), (4, 60.0), (5, 60.0), (6, 60.0)):
        progress.step({"step": step, "policy_version": step, "wall_s": wall})
    lines = buf.getvalue().splitlines()
    assert lines[0].endswith(", ETA 15m00s for 9 more step(s)")  # 100 s x 9
    assert lines[-1].endswith(", ETA 4m00s for 4 more step(s)")  # the last five: 60 s
    progress.step({"step": 10, "policy_version": 10, "wall_s": 60.0})
    assert "ETA" not in buf.getvalue().splitlines()[-1]
