"""Weight-sync seconds, learner -> engine, of both transports side by side in one run.

A real Ray local cluster, the real DeepSpeed learner group and one real rollout actor
(``--engine vllm`` or ``hf``) on the main job's model (SmolLM2-135M). Each transport pushes
the learner's weights ``--repeats`` times; a push is timed from its start until the engine
has loaded the weights (every acknowledgement resolved). ``collective``'s first push also
forms the process group: reported apart.

    .venv/bin/python benchmarks/weight_sync.py --engine vllm --out runs/bench/weight_sync.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import ray

from services.config import load_config
from services.learner_group import create_learner_group
from services.ray_actors import create_rollout_actor
from services.weight_sync import CollectiveWeightSync, ObjectStoreWeightSync


def timed_push(sync, learner, engines) -> float:
    """Seconds from the push until every engine acknowledged the load."""
    started = time.perf_counter()
    handle = sync.push(learner, engines, 0)
    ray.get(handle.acks)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="deploy/configs/cpu_demo.toml")
    parser.add_argument("--engine", choices=["vllm", "hf"], default="vllm")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    cfg = load_config(args.config, [f'rollout.engine="{args.engine}"', "ray.num_cpus=2"])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    learner = create_learner_group(cfg)
    engine = create_rollout_actor(cfg, "http://127.0.0.1:9", 0)  # never retrieves here
    ray.get(engine.get_policy_version.remote())
    results: dict[str, object] = {"engine": args.engine, "model": str(cfg.model.path)}
    store = ObjectStoreWeightSync()
    results["object_store_s"] = [timed_push(store, learner, [engine]) for _ in range(args.repeats)]
    collective = CollectiveWeightSync("gloo", timeout_s=600.0)
    results["collective_first_s"] = timed_push(collective, learner, [engine])
    results["collective_s"] = [
        timed_push(collective, learner, [engine]) for _ in range(args.repeats)
    ]
    for key in ("object_store_s", "collective_s"):
        print(f"{key:16s} median {statistics.median(results[key]):.2f} s  {results[key]}")
    print(f"collective_first_s (forms the group) {results['collective_first_s']:.2f} s")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    learner.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
