"""``stppo plot``: training curves from per-step logs, several runs overlaid.

Reads ``<run_dir>/steps.jsonl`` (one record per learner step, written by the driver) and
draws one panel per metric, one line per run, labelled ``<run name> (<variant>)``, so PPO
vs ST-PPO is one picture.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from services.run_records import read_records

PANELS: tuple[tuple[str, str], ...] = (
    ("success_rate", "success rate"),
    ("reward_mean", "reward (mean)"),
    ("clip_ratio", "clip ratio"),
    ("approx_kl", "approx KL (k1, nats/token)"),
    ("clip_bias_norm", "clipping-bias norm ||C||"),
    ("clip_bias_scale", "clipping-bias scale s"),
    ("staleness_mean", "staleness (mean, steps)"),
    ("value_loss", "value loss"),
    ("entropy", "entropy (nats/token)"),
)
"""(steps.jsonl key, axis title), in figure order."""


@dataclass
class RunCurves:
    """The per-step series of one run: ``series[key]`` aligned with ``steps`` (NaN = missing)."""

    label: str
    steps: list[int]
    series: dict[str, list[float]]


def read_run(run_dir: Path) -> RunCurves:
    """Load ``steps.jsonl`` of one run.

    Raises:
        FileNotFoundError: the run has no ``steps.jsonl``.
        ValueError: it is empty, mixes runs or repeats a step.
    """
    path = run_dir / "steps.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: is {run_dir} a run directory?")
    records = read_records(path, "step")  # one run, each step once (a resume supersedes)
    if not records:
        raise ValueError(f"{path} has no steps")
    variants = sorted(
        {r.get("variant", "?") for r in records}, key=[r.get("variant") for r in records].index
    )
    label = f"{run_dir.name} ({'->'.join(variants)})"
    series = {
        key: [float(r[key]) if isinstance(r.get(key), int | float) else math.nan for r in records]
        for key, _ in PANELS
    }
    return RunCurves(label=label, steps=[int(r["step"]) for r in records], series=series)


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average over ``window`` points, ignoring NaN (NaN if all are NaN)."""
    out = []
    for i in range(len(values)):
        chunk = [v for v in values[max(0, i - window + 1) : i + 1] if not math.isnan(v)]
        out.append(sum(chunk) / len(chunk) if chunk else math.nan)
    return out


def plot_runs(run_dirs: list[Path], out_path: Path, window: int = 1) -> Path:
    """Draw every panel of :data:`PANELS` with one line per run and save a PNG.

    Args:
        run_dirs: run directories (each with ``steps.jsonl``).
        out_path: PNG file to write (parents are created).
        window: moving-average window in steps (1 = raw).

    Returns:
        ``out_path``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [read_run(Path(d)) for d in run_dirs]
    cols = 3
    rows = math.ceil(len(PANELS) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.4 * rows), squeeze=False)
    for ax, (key, title) in zip(axes.flat, PANELS, strict=False):
        for run in runs:
            ax.plot(
                run.steps,
                smooth(run.series[key], window),
                label=run.label,
                marker="." if len(run.steps) < 30 else None,
            )
        ax.set_title(title)
        ax.set_xlabel("learner step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(PANELS) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return out_path
