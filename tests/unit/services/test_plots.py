"""stppo plot: figures hold the expected series (checked on the drawn data, not the file size)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib
import pytest

matplotlib.use("Agg")

from services.plots import PANELS, plot_runs, read_run, smooth


def write_run(root: Path, name: str, variant: str, clip: list[float]) -> Path:
    run = root / name
    run.mkdir(parents=True)
    with (run / "steps.jsonl").open("w") as f:
        for i, c in enumerate(clip, 1):
            rec = {
                "step": i,
                "variant": variant,
                "clip_ratio": c,
                "success_rate": i / 10,
                "staleness_mean": 1,
            }
            f.write(json.dumps(rec) + "\n")
    return run


def test_read_run_labels_variant_and_marks_missing_as_nan(tmp_path: Path):
    curves = read_run(write_run(tmp_path, "a", "ppo", [0.1, 0.2]))
    assert curves.label == "a (ppo)"
    assert curves.steps == [1, 2]
    assert curves.series["clip_ratio"] == [0.1, 0.2]
    assert all(math.isnan(v) for v in curves.series["value_loss"])


def test_smooth_is_trailing_mean_ignoring_nan():
    assert smooth([1.0, 3.0, math.nan, 5.0], window=2) == [1.0, 2.0, 3.0, 5.0]


def test_plot_overlays_runs_with_their_data(tmp_path: Path, monkeypatch):
    import matplotlib.pyplot as plt

    a = write_run(tmp_path, "ppo_run", "ppo", [0.1, 0.3, 0.5])
    b = write_run(tmp_path, "st_run", "st_ppo", [0.05, 0.04, 0.03])
    captured = {}
    real_close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig: captured.setdefault("fig", fig))
    out = plot_runs([a, b], tmp_path / "fig" / "curves.png")
    real_close(captured["fig"])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    axes = captured["fig"].axes
    clip_ax = axes[[k for k, _ in PANELS].index("clip_ratio")]
    lines = {line.get_label(): list(line.get_ydata()) for line in clip_ax.get_lines()}
    assert lines == {"ppo_run (ppo)": [0.1, 0.3, 0.5], "st_run (st_ppo)": [0.05, 0.04, 0.03]}


def test_missing_run_is_a_clear_error(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match=r"is .* a run directory"):
        read_run(tmp_path / "nope")
