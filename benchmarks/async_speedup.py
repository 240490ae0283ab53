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
    python benchmarks/async_speedup.py --interrupt N [--staleness S] [dotted.key=value ...]
    python benchmarks/async_speedup.py --calls-per-actor K [--staleness S] [--warm-start]
        [dotted.key=value ...]

``--interrupt N`` instead compares, at the same ``buffer.max_staleness`` (S, default 2),
weight updates applied after the whole rollout batch (``rollout.interrupt_every_tokens = 0``,
the behaviour before interruptible generation) with updates landing mid-batch (every N
tokens and between turns). Per run: trained trajectories/s (steady state), engine idle
fraction (1 actor: wall time with no rollout running, from the per-step rollout counts
and mean durations), mean / max token staleness of consumed tokens, in-flight updates, and
the waste fraction.

``--calls-per-actor K`` compares one rollout call per actor at a time (``1``, the loop
before continuous batching) with ``K`` calls whose episodes share each turn's engine call
(:class:`actors.rollout.ContinuousBatcher`), same columns (engine idle: no call running on
the actor). ``--warm-start`` first runs the config's warm-start SFT once (0 learner steps,
``sft.enabled = true``; reused by a later benchmark with the same overrides) and starts
both runs from its policy: an untrained SmolLM2 rarely
searches, so its episodes are one turn long and there is nothing to batch across calls.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.env import PROJECT_ROOT, configure_local_caches

CONFIG = PROJECT_ROOT / "deploy" / "configs" / "bench_async.toml"


def run_once(
    max_staleness: int, overrides: list[str], name: str | None = None
) -> tuple[list[dict], object]:
    from services.config import load_config
    from services.driver import run_training

    name = name or f"bench_async_s{max_staleness}"
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


def engine_idle_fraction(steps: list[dict], num_actors: int) -> float:
    """Share of the steady-state wall time (end of step 1 to the end of the last) in which
    the rollout actors ran no rollout call: ``1 - busy / (actors * span)``, busy from the
    per-step ``rollout_busy_s`` of ``steps.jsonl`` (wall seconds with at least one call
    running on an actor, summed over actors)."""
    span = steps[-1]["elapsed_s"] - steps[0]["elapsed_s"]
    busy = sum(s["rollout_busy_s"] for s in steps[1:])
    return max(0.0, 1.0 - busy / (num_actors * span))


def generated_per_busy_s(steps: list[dict]) -> float:
    """Trajectories generated per actor-second with a rollout call running, over the steady
    state: the engines' own throughput, whatever the learner does."""
    made = steps[-1]["trajectories_generated"] - steps[0]["trajectories_generated"]
    return made / max(sum(s["rollout_busy_s"] for s in steps[1:]), 1e-9)


def token_staleness(steps: list[dict]) -> tuple[float, int]:
    """(mean, max) per-token staleness over the consumed tokens of every step (each step's
    mean weighted equally: the batches are the same size in trajectories)."""
    means = [s["staleness_token_mean"] for s in steps]
    return sum(means) / len(means), max(s["staleness_token_max"] for s in steps)


def warm_start_policy(overrides: list[str]) -> str:
    """Run the config's warm-start SFT once (0 learner steps, no evaluation) and return the
    folder of the policy it exported (the run's step-0 checkpoint). The run is named by a
    hash of ``overrides``, and a policy already there (an earlier benchmark with the same
    overrides) is reused."""
    import hashlib

    from services.config import load_config
    from services.driver import run_training

    digest = hashlib.sha256("\n".join(overrides).encode()).hexdigest()[:8]
    fixed = ["sft.enabled=true", "run.num_steps=0", f'run.name="bench_async_warm_start_{digest}"']
    cfg = load_config(CONFIG, [*overrides, *fixed])
    policy = cfg.run_dir / "checkpoints" / "step_000000" / "hf_policy"
    if not policy.is_dir():
        run_training(cfg, overwrite=True)
    return str(policy)


def main_compare(
    option: str, values: tuple[int, int], max_staleness: int, overrides: list[str]
) -> None:
    """Side by side at the same ``max_staleness``: ``rollout.<option>`` = each of ``values``
    (``interrupt_every_tokens``: updates after the batch (0) vs mid-batch (N);
    ``calls_per_actor``: one call at a time (1) vs continuous batching (K))."""
    rows = []
    for n in values:
        steps, cfg = run_once(
            max_staleness,
            [*overrides, f"rollout.{option}={n}"],
            name=f"bench_{option}_s{max_staleness}_{n}",
        )
        batch = cfg.learner.train_batch_size
        mean_tok, max_tok = token_staleness(steps)
        rows.append(
            dict(
                n=n,
                rate=trained_per_s(steps, batch),
                idle=engine_idle_fraction(steps, cfg.rollout.num_actors),
                gen_rate=generated_per_busy_s(steps),
                step_s=sorted(s["wall_s"] for s in steps)[len(steps) // 2],
                stale_mean=sum(s["staleness_mean"] for s in steps) / len(steps),
                tok_mean=mean_tok,
                tok_max=max_tok,
                inflight=steps[-1].get("inflight_weight_updates", 0),
                **waste(steps),
            )
        )
    print(f"\nmax_staleness = {max_staleness} in both runs")
    print(f"| {option} | trained traj/s | learner step s (median) | engine idle | generated "
          "traj per busy engine-s | trajectory staleness "
          "mean | token staleness mean | token staleness max | in-flight updates | "
          "generated | dropped stale | waste |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['n']} | {r['rate']:.3f} | {r['step_s']:.1f} | {r['idle']:.2f} | "
            f"{r['gen_rate']:.3f} | {r['stale_mean']:.2f} | "
            f"{r['tok_mean']:.2f} | {r['tok_max']} | {r['inflight']} | "
            f"{r['trajectories_generated']:.0f} | {r['trajectories_dropped_stale']:.0f} | "
            f"{r['waste_fraction']:.3f} |"
        )
    print(f"\nspeed-up {option} {values[1]} / {values[0]}: "
          f"{rows[1]['rate'] / rows[0]['rate']:.2f}x (target >= 1.2x)")  # fmt: skip


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] in (["--interrupt"], ["--calls-per-actor"]):
        option = {"--interrupt": "interrupt_every_tokens", "--calls-per-actor": "calls_per_actor"}
        name, value, args = option[args[0]], int(args[1]), args[2:]
        staleness = 2
        if args[:1] == ["--staleness"]:
            staleness, args = int(args[1]), args[2:]
        configure_local_caches()
        if args[:1] == ["--warm-start"]:
            args = [*args[1:], f'model.path="{warm_start_policy(args[1:])}"']
        baseline = 0 if name == "interrupt_every_tokens" else 1
        main_compare(name, (baseline, value), staleness, args)
    else:
        main(args)
