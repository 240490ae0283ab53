"""Peak memory of a whole job: every process it starts (Ray, learner, engines, retrieval).

Runs the command, samples the proportional set size (PSS: shared pages split between the
processes that share them, so the sum is what the job really holds) of the command's whole
process tree once a second, and reports the peak of the sum, with the processes that made
it up at that moment, and the wall time. The main job must stay under 20 GiB on a 24 GiB
machine (README, "The main job").

    .venv/bin/python benchmarks/job_memory.py --out runs/bench/main_job_memory.json -- \\
        .venv/bin/stppo train @deploy/configs/cpu_demo.toml
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import psutil


def tree_pss(root: psutil.Process) -> dict[str, int]:
    """PSS in bytes of ``root`` and each live descendant, keyed ``"<pid> <name>"``."""
    out: dict[str, int] = {}
    for proc in [root, *root.children(recursive=True)]:
        try:
            label = f"{proc.pid} {' '.join(proc.cmdline()[:3])[:80] or proc.name()}"
            out[label] = proc.memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="JSON report path")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --")
    start = time.perf_counter()
    child = subprocess.Popen(command)
    root = psutil.Process(child.pid)
    peak_total, peak_at, peak_parts = 0, 0.0, {}
    while child.poll() is None:
        parts = tree_pss(root)
        total = sum(parts.values())
        if total > peak_total:
            peak_total, peak_at, peak_parts = total, time.perf_counter() - start, parts
        time.sleep(args.interval)
    wall = time.perf_counter() - start
    gib = 2**30
    top = sorted(peak_parts.items(), key=lambda kv: -kv[1])[:12]
    print(f"[job_memory] exit {child.returncode}, wall {wall:.0f} s")
    print(
        f"[job_memory] peak PSS of the process tree: {peak_total / gib:.2f} GiB at {peak_at:.0f} s"
    )
    for label, pss in top:
        print(f"    {pss / gib:6.2f} GiB  {label}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "command": command,
            "exit_code": child.returncode,
            "wall_s": wall,
            "peak_pss_gib": peak_total / gib,
            "peak_at_s": peak_at,
            "peak_processes_gib": {label: pss / gib for label, pss in top},
        }
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return child.returncode


if __name__ == "__main__":
    sys.exit(main())
