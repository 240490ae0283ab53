"""Asynchronous vs synchronous actor-learner throughput, measured side by side in one run.

Runs ``deploy/configs/bench_async.toml`` twice, identical except ``buffer.max_staleness``
(0 = synchronous: generation waits for each learner step and weight sync; 2 = actors keep
generating while the learner trains). Reports trajectories *trained* per second over the
steady state (from the end of step 1 to the end of the last step) and the ideal speed-up
bound ``(gen + train) / max(gen, train)`` from the synchronous run's own timings, where
``gen`` = wall time to generate one training batch and ``train`` = one learner step.

Also reports, per run, trajectories generated, consumed and dropped as stale and the waste
fraction (dropped / generated; from the last ``steps.jsonl`` record). Staleness-aware
admission (``learner.admission``) makes it 0 at a constant bound. A run that wastes a
fraction ``w`` must generate ``gen / (1 - w)`` per trained batch, so its bound is
``(gen + train) / max(gen / (1 - w), train)``; with ``w = 0`` it is the plain bound above.

Usage::

    python benchmarks/async_speedup.py [dotted.key=value ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.env import PROJECT_ROOT, configure_local_caches

CONFIG = PROJECT_ROOT / "deploy" / "configs" / "bench_async.toml"


def run_once(max_staleness: int, overrides: list[str]) -> tuple[list[dict], object]:
    from services.config import load_config
    from services.driver import run_training

    name = f"bench_async_s{max_staleness}"
    cfg = load_config(
        CONFIG, [*overrides, f"buffer.max_staleness={max_staleness}", f'run.name="{name}"']
    )
    steps_path = cfg.run_dir / "steps.jsonl"
    run_training(cfg, overwrite=True)  # an earlier run of the benchmark is moved aside
    return [json.loads(line) for line in steps_path.read_text().splitlines()], cfg


def trained_per_s(steps: list[dict], batch: int) -> float:
    """Trajectories trained per second between the end of step 1 and the end of the last."""
    span = steps[-1]["elapsed_s"] - steps[0]["elapsed_s"]
    return batch * (len(steps) - 1) / span


def ideal_bound(steps: list[dict], cfg) -> tuple[float, float, float]:
    """(gen_s per batch, train_s per step, bound) from a synchronous run's records."""
    per_call = cfg.rollout.prompts_per_batch * cfg.rollout.group_size
    calls_per_batch = cfg.learner.train_batch_size / per_call
    rollout_s = [s["rollout_s_mean"] for s in steps[1:] if s["rollouts_completed"]]
    gen = calls_per_batch * (sum(rollout_s) / len(rollout_s)) / cfg.rollout.num_actors
    train = sum(s["wall_s"] for s in steps[1:]) / (len(steps) - 1)
    return gen, train, (gen + train) / max(gen, train)


def waste(steps: list[dict]) -> dict[str, float]:
    """Run totals from the last step record: generated, consumed, dropped, waste fraction."""
    last = steps[-1]
    keys = ("trajectories_generated", "trajectories_consumed", "trajectories_dropped_stale")
    out = {k: float(last.get(k, 0)) for k in keys}
    out["waste_fraction"] = out["trajectories_dropped_stale"] / max(
        out["trajectories_generated"], 1.0
    )
    return out


def bound_with_waste(gen: float, train: float, waste_fraction: float) -> float:
    """Ideal async speed-up when a fraction of the generated trajectories is thrown away."""
    return (gen + train) / max(gen / max(1.0 - waste_fraction, 1e-9), train)


def main(argv: list[str]) -> None:
    configure_local_caches()
    sync_steps, cfg = run_once(0, argv)
    async_steps, _ = run_once(2, argv)
    batch = cfg.learner.train_batch_size
    sync_rate, async_rate = trained_per_s(sync_steps, batch), trained_per_s(async_steps, batch)
    gen, train, bound = ideal_bound(sync_steps, cfg)
    stale = [s["staleness_mean"] for s in async_steps]
    print("\n| mode | max_staleness | trained traj/s | mean staleness |")
    print("|---|---|---|---|")
    print(
        f"| synchronous | 0 | {sync_rate:.3f} | {sum(s['staleness_mean'] for s in sync_steps) / len(sync_steps):.2f} |"
    )
    print(f"| asynchronous | 2 | {async_rate:.3f} | {sum(stale) / len(stale):.2f} |")
    print(f"\nspeed-up async/sync: {async_rate / sync_rate:.2f}x  (target >= 1.3x)")
    print(
        f"ideal bound (gen + train) / max(gen, train) = ({gen:.1f} + {train:.1f}) / {max(gen, train):.1f} = {bound:.2f}x"
    )
    print("\n| mode | generated | consumed | dropped stale | waste fraction |")
    print("|---|---:|---:|---:|---:|")
    for mode, steps in (("synchronous", sync_steps), ("asynchronous", async_steps)):
        w = waste(steps)
        print(
            f"| {mode} | {w['trajectories_generated']:.0f} | {w['trajectories_consumed']:.0f} | "
            f"{w['trajectories_dropped_stale']:.0f} | {w['waste_fraction']:.3f} |"
        )
    w_async = waste(async_steps)["waste_fraction"]
    print(
        f"ideal bound at the async run's waste {w_async:.3f}: "
        f"{bound_with_waste(gen, train, w_async):.2f}x (no waste: {bound:.2f}x)"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
