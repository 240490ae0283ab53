"""Live progress on the terminal: one line per learner step, plus notable events."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

STEP_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("reward_mean", "reward", "{:.3f}"),
    ("success_rate", "success", "{:.2f}"),
    ("clip_ratio", "clip", "{:.3f}"),
    ("approx_kl", "kl", "{:.4f}"),
    ("clip_bias_scale", "scale", "{:.2f}"),
    ("staleness_mean", "stale", "{:.2f}"),
    ("num_turns_mean", "turns", "{:.1f}"),
    ("wall_s", "step_s", "{:.1f}"),
)
"""(record key, column label, format) of the per-step line."""


@dataclass
class Progress:
    """Prints ``[step 3/20 v3 st_ppo] reward=0.250 success=0.25 clip=0.012 ...`` lines."""

    total_steps: int
    run_dir: Path
    console: Console = field(default_factory=lambda: Console(stderr=True, highlight=False))
    _start_s: float = field(default_factory=time.perf_counter)
    _step_walls: list[float] = field(default_factory=list)

    def say(self, message: str) -> None:
        """An event line with the elapsed wall time."""
        self.console.print(f"[dim]{time.perf_counter() - self._start_s:7.1f}s[/dim] {message}")

    def step(self, record: dict[str, Any]) -> None:
        """The per-step line from a ``steps.jsonl`` record."""
        cells = []
        for key, label, fmt in STEP_COLUMNS:
            value = record.get(key)
            if isinstance(value, int | float):
                cells.append(f"{label}={fmt.format(value)}")
        # escape: "[step 3/20 ...]" would otherwise be parsed (and dropped) as a rich markup tag
        label = escape(
            f"[step {record['step']}/{self.total_steps} v{record['policy_version']} {record.get('variant', '')}]"
        )
        head = f"[bold]{label}[/bold]"
        self.say(f"{head} {' '.join(cells)}{self._eta(record)}")

    def _eta(self, record: dict[str, Any]) -> str:
        """``", ETA 6m20s"``: the steps left at the mean wall time of the last five (the
        final evaluation and checkpoint come after); empty after the last step."""
        wall = record.get("wall_s")
        if isinstance(wall, int | float):
            self._step_walls.append(float(wall))
        left = self.total_steps - int(record["step"])
        if left <= 0 or not self._step_walls:
            return ""
        recent = self._step_walls[-5:]
        seconds = round(sum(recent) / len(recent) * left)
        text = f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"
        return f", ETA {text} for {left} more step(s)"
