"""Soak of the synthetic job on the local cluster (issue 28): memory growth per process,
errors, and steps per minute at the start and at the end.

Brings up its own :class:`local_cluster.cluster.LocalCluster` (prefix ``sts``, subnet
``10.213.11.0/24``, so it never touches ``scripts/local_cluster.sh``'s cluster), submits
``stppo train @/configs/k8s_synthetic.toml`` from the client pod (with the synthetic task's
own warm start, so that episodes search) with enough steps to outlast ``--minutes`` of
training (counted from the first learner step), and every ``--sample-s`` seconds reads the
resident set size (RSS, MiB) of every process in every pod's network namespace (``ip netns
pids``, then psutil). At the deadline it stops the job (``ray job stop``) and takes the
cluster down.

Reported per process (one series per pid; a process that restarts is a new series):

- growth after warm-up: ``(RSS_last - RSS_w) / RSS_w`` in %, with ``RSS_w`` the first sample
  at or after ``--warmup-min`` minutes of training (target: at most 5%);
- slope: least-squares fit of RSS on time over the same window, MiB per hour;

and for the job: steps per minute over the first and the last ``--rate-window-min`` minutes
of training (from ``elapsed_s`` in ``steps.jsonl``), errors (lines of the job's log that
carry ``Traceback`` or `` ERROR `` before the stop, plus trajectories excluded for a failed
retrieval and non-finite optimizer steps counted in ``steps.jsonl``).

Writes ``<out>/rss.jsonl`` (every sample), the run's ``steps.jsonl`` and ``consumed.jsonl``,
``<out>/soak.json`` (the summary) and ``<out>/soak.md`` (the table)::

    sudo PYTHONPATH=deploy .venv/bin/python -m benchmarks.cluster_soak --minutes 45 --out build/soak

Needs root (network namespaces, see :func:`local_cluster.netns.netns_unavailable`).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
from local_cluster.cluster import HEAD_SERVICE, LocalCluster

from experiments.grid import read_jsonl

ERROR_LINE = re.compile(r"Traceback|\bERROR\b")


def process_label(proc: psutil.Process) -> str:
    """A short, stable name for a pod process: Ray's proctitle (``ray::RolloutWorker``),
    else the executable and first argument that says what it runs."""
    try:
        cmd = proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "?"
    if not cmd:
        return proc.name()
    if cmd[0].startswith("ray::"):
        return cmd[0].split()[0]
    words = [Path(cmd[0]).name, *[w for w in cmd[1:] if not w.startswith("-")][:2]]
    text = " ".join(words)
    for key in ("gcs_server", "raylet", "dashboard", "log_monitor", "prometheus", "uvicorn",
                "retrieval_server", "stppo", "runtime_env", "default_worker"):  # fmt: skip
        if key in " ".join(cmd):
            return f"{key} ({Path(cmd[0]).name})" if key not in text else text[:60]
    return text[:60]


def sample(cluster: LocalCluster) -> list[dict]:
    """One RSS sample (MiB) of every process in every pod's namespace."""
    rows = []
    for name, host in cluster.network.hosts.items():
        out = subprocess.run(["ip", "netns", "pids", host.netns], capture_output=True, text=True)
        for pid in (int(p) for p in out.stdout.split()):
            try:
                proc = psutil.Process(pid)
                rss = proc.memory_info().rss / 2**20
                label = process_label(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            if label.startswith(("unshare", "ip ", "sudo", "setpriv", "bash", "sh ")):
                continue  # the harness's wrappers around a pod's container
            rows.append({"pod": name, "pid": pid, "process": label, "rss_mib": round(rss, 1)})
    return rows


def growth(series: list[tuple[float, float]], warmup_s: float) -> dict | None:
    """Growth (%) and slope (MiB/h) of one process's RSS after ``warmup_s``; None with fewer
    than 3 samples in the window."""
    window = [(t, r) for t, r in series if t >= warmup_s]
    if len(window) < 3:
        return None
    t, r = np.array(window).T
    slope = np.polyfit(t / 3600.0, r, 1)[0]
    return {
        "rss_start_mib": float(r[0]),
        "rss_end_mib": float(r[-1]),
        "rss_max_mib": float(r.max()),
        "growth_pct": float(100.0 * (r[-1] - r[0]) / r[0]),
        "slope_mib_per_h": float(slope),
        "samples": len(window),
    }


def steps_per_minute(steps: list[dict], window_s: float) -> tuple[float, float]:
    """(first window, last window) steps per minute from ``elapsed_s`` of each step."""
    times = [s["elapsed_s"] for s in steps]
    if len(times) < 2:
        return float("nan"), float("nan")
    start, end = times[0], times[-1]
    first = sum(start <= x < start + window_s for x in times)
    last = sum(end - window_s < x <= end for x in times)
    return 60.0 * first / window_s, 60.0 * last / window_s


def summarise(
    out: Path,
    job_log: Path,
    minutes: float,
    warmup_min: float = 5.0,
    rate_window_min: float = 5.0,
    ended_early: int | None = None,
    first_step_s: float | None = None,
) -> dict:
    """``soak.json`` and ``soak.md`` from ``out/rss.jsonl``, ``out/steps.jsonl`` and the
    job's log (also on its own: ``--summarise``). A process is one (pod, pid); Ray's
    proctitle names the running method (``ray::LearnerRank.call``), so the label is the
    actor's class."""
    if first_step_s is None:  # on its own: read back from the run's start marker
        marker = out / "first_step_s"
        first_step_s = float(marker.read_text()) if marker.exists() else 0.0
    (out / "first_step_s").write_text(f"{first_step_s}\n")
    series: dict[tuple[str, int], list[tuple[float, float]]] = {}
    labels: dict[tuple[str, int], str] = {}
    for line in (out / "rss.jsonl").read_text().splitlines():
        row = json.loads(line)
        key = (row["pod"], row["pid"])
        series.setdefault(key, []).append((row["t_s"], row["rss_mib"]))
        label = row["process"]
        labels[key] = label.split(".")[0] if label.startswith("ray::") else label
    steps = read_jsonl(out / "steps.jsonl", step_key="step")
    per_process = []
    for key, points in sorted(series.items()):
        g = growth(points, first_step_s + 60.0 * warmup_min)
        if g is not None:
            per_process.append({"pod": key[0], "pid": key[1], "process": labels[key], **g})
    first, last = steps_per_minute(steps, 60.0 * rate_window_min)
    log_text = job_log.read_text(errors="replace") if job_log.exists() else ""
    # what the deliberate stop at the deadline prints is not an error of the run
    log_text = log_text.split("SIGTERM received")[0]
    errors = [line for line in log_text.splitlines() if ERROR_LINE.search(line)]
    summary = {
        "minutes": minutes,
        "ended_early_rc": ended_early,
        "steps": len(steps),
        "steps_per_min_first": first,
        "steps_per_min_last": last,
        "error_lines": len(errors),
        "error_examples": errors[:5],
        "retrieval_failed_excluded": sum(s.get("num_excluded_retrieval_failed", 0) for s in steps),
        "nonfinite_skipped": sum(s.get("skipped_steps", 0) for s in steps),
        "max_growth_pct": max((p["growth_pct"] for p in per_process), default=float("nan")),
        "processes": per_process,
    }
    (out / "soak.json").write_text(json.dumps(summary, indent=2))
    lines = [
        f"soak: {minutes:g} min, {len(steps)} steps, steps/min {first:.1f} (first "
        f"{rate_window_min:g} min) -> {last:.1f} (last {rate_window_min:g} min), error lines "
        f"{len(errors)}, largest growth after {warmup_min:g} min "
        f"{summary['max_growth_pct']:+.1f}%",
        "",
        f"| pod | process | RSS at {warmup_min:g} min (MiB) | RSS at end (MiB) | growth "
        "| slope (MiB/h) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for p in sorted(per_process, key=lambda p: -p["rss_end_mib"]):
        lines.append(
            f"| {p['pod']} | {p['process']} | {p['rss_start_mib']:.0f} | {p['rss_end_mib']:.0f} "
            f"| {p['growth_pct']:+.1f}% | {p['slope_mib_per_h']:+.1f} |"
        )
    (out / "soak.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=45.0)
    parser.add_argument("--sample-s", type=float, default=60.0)
    parser.add_argument("--warmup-min", type=float, default=5.0)
    parser.add_argument("--rate-window-min", type=float, default=5.0)
    parser.add_argument("--out", type=Path, default=Path("build/soak"))
    parser.add_argument("--state-dir", type=Path, default=Path("build/soak-cluster"))
    parser.add_argument(
        "--summarise", action="store_true", help="only redo the summary from --out's files"
    )
    args = parser.parse_args(argv)
    log = args.state_dir / "logs" / "soak-job.log"
    if args.summarise:
        summarise(args.out, log, args.minutes, args.warmup_min, args.rate_window_min, None)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)

    cluster = LocalCluster(args.state_dir, prefix="sts", subnet="10.213.11.0/24")
    started = time.monotonic()
    cluster.up(timeout_s=420)
    print(f"cluster up in {time.monotonic() - started:.0f} s", flush=True)
    job_id = f"soak-{int(time.time())}"
    overrides = [
        "run.name=soak", "run.num_steps=100000", "checkpoint.every_k_steps=20",
        # the synthetic task's own warm start, so that episodes search (4 steps do not)
        "sft.num_demonstrations=512", "sft.epochs=4",
    ]  # fmt: skip
    entry = ["stppo", "train", "@/configs/k8s_synthetic.toml", *overrides]
    proc = cluster.popen("client", cluster.submit_command(entry, submission_id=job_id), log)
    samples_path = args.out / "rss.jsonl"
    job_start = time.monotonic()
    run_dir = cluster.state_dir / "shared" / "runs" / "soak"
    steps_path = run_dir / "steps.jsonl"
    deadline = first_step = None  # --minutes of training, counted from the first step
    ended_early = None
    try:
        with samples_path.open("w") as out:
            while deadline is None or time.monotonic() < deadline:
                now = time.monotonic() - job_start
                if first_step is None and steps_path.exists() and steps_path.stat().st_size:
                    first_step = now
                    deadline = time.monotonic() + 60.0 * args.minutes
                for row in sample(cluster):
                    row["t_s"] = round(now, 1)
                    out.write(json.dumps(row) + "\n")
                out.flush()
                if proc.poll() is not None:
                    ended_early = proc.returncode
                    break
                print(f"{now / 60:5.1f} min: sampled", flush=True)
                left = args.sample_s if deadline is None else deadline - time.monotonic()
                time.sleep(max(0.0, min(args.sample_s, left)))
        stop = ["ray", "job", "stop", f"--address=http://{HEAD_SERVICE}:8265", job_id]
        cluster.exec("client", stop, timeout=120)
        proc.wait(timeout=120)
    finally:
        for name in ("steps.jsonl", "consumed.jsonl"):
            if (run_dir / name).exists():
                shutil.copy(run_dir / name, args.out / name)
        cluster.down(keep_logs=True)
    summarise(
        args.out, log, args.minutes, args.warmup_min, args.rate_window_min, ended_early,
        first_step_s=first_step or 0.0,
    )  # fmt: skip
    return 0 if ended_early is None else 1


if __name__ == "__main__":
    sys.exit(main())
