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
