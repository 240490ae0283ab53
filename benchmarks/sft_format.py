"""Format adherence of SmolLM2 before and after the warm-start SFT.

1. start the real BM25 retrieval server on the built corpus/index;
2. build demonstrations from the training splits (search the gold entity / bridge entity,
   answer with the gold answer; :mod:`learner.sft`);
3. greedy rollouts (HF engine, the actors' multi-turn loop) on validation questions:
   well-formed rate (exactly one non-empty ``<answer>``), searches per episode, success;
4. warm start with the DeepSpeed :class:`learner.trainer.Learner`;
5. ship the exported weights to the same engine (``load_weights``) and evaluate again.

Run (shared machine: take the heavy lock)::

    flock .cache/heavy.lock .venv/bin/python benchmarks/sft_format.py --demos 64 \\
        --eval-questions 24 --out runs/benchmarks/sft_format.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.env import configure_local_caches

configure_local_caches()

from actors.config import RolloutConfig  # noqa: E402
from actors.demonstrations import build_demonstrations  # noqa: E402
from actors.engines.hf import HFEngine  # noqa: E402
from actors.retrieval_client import RetrievalClient  # noqa: E402
from actors.rollout import RolloutWorker  # noqa: E402
from learner.config import LearnerConfig, PPOConfig, SFTConfig  # noqa: E402
from learner.sft import run_warm_start  # noqa: E402
from learner.trainer import Learner  # noqa: E402
from retrieval_server.config import RetrievalServerConfig  # noqa: E402
from retrieval_server.launcher import start_server, stop_server  # noqa: E402


def _records(qa_dir: Path, datasets: list[str], split: str, n: int, seed: int) -> list[dict]:
    """``n`` records spread evenly over ``datasets`` (seeded sample of each split)."""
    rng = random.Random(seed)
    out: list[dict] = []
    per = -(-n // len(datasets))
    for name in datasets:
        lines = (qa_dir / name / f"{split}.jsonl").read_text().splitlines()
        rows = [json.loads(x) for x in lines if x.strip()]
        out += rng.sample(rows, min(per, len(rows)))
    rng.shuffle(out)
    return out[:n]


def _evaluate(worker: RolloutWorker, records: list[dict]) -> dict:
    start = time.perf_counter()
    trajectories = worker.rollout(records, greedy=True)
    n = len(trajectories)
    malformed: dict[str, int] = {}
    for t in trajectories:
        if t.malformed_reason is not None:
            malformed[t.malformed_reason] = malformed.get(t.malformed_reason, 0) + 1
    return {
        "questions": n,
        "well_formed_rate": sum(t.malformed_reason is None for t in trajectories) / n,
        "searched_rate": sum(t.num_searches > 0 for t in trajectories) / n,
        "searches_mean": sum(t.num_searches for t in trajectories) / n,
        "success_rate": sum(t.success for t in trajectories) / n,
        "retrieval_failed": sum(t.retrieval_failed for t in trajectories),
        "malformed": malformed,
        "wall_s": time.perf_counter() - start,
        "examples": [worker.tokenizer.decode(t.response_ids)[:400] for t in trajectories[:2]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="data/model/smollm2-135m-instruct")
    parser.add_argument("--qa-dir", type=Path, default=Path("data/qa"))
    parser.add_argument("--datasets", default="single_hop,multi_hop,medical_mc")
    parser.add_argument("--demos", type=int, default=64, help="training records tried")
    parser.add_argument("--eval-questions", type=int, default=24)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    datasets = args.datasets.split(",")
    rollout_cfg = RolloutConfig(max_turns=4, max_new_tokens_per_turn=96, group_size=1)
    tmp = Path(".cache/tmp/sft_format")
    tmp.mkdir(parents=True, exist_ok=True)
    server = start_server(RetrievalServerConfig(method="bm25", port=0), tmp / "server.log")
    result: dict = {"args": {k: str(v) for k, v in vars(args).items()}}
    try:
        engine = HFEngine(args.model, seed=args.seed)
        worker = RolloutWorker(args.model, rollout_cfg, server.url, seed=args.seed, engine=engine)
        with RetrievalClient(server.url, rollout_cfg.retrieval) as client:
            train = _records(args.qa_dir, datasets, "train", args.demos, args.seed)
            built = build_demonstrations(
                train,
                worker.tokenizer,
                client.retrieve,
                max_information_tokens=rollout_cfg.max_information_tokens,
            )
        result["demonstrations"] = {
            "records": built.num_records,
            "kept": len(built.demonstrations),
            "answer_not_retrieved": built.num_answer_not_retrieved,
            "invalid": built.num_invalid,
        }
        print("demonstrations", result["demonstrations"], flush=True)
        validation = _records(args.qa_dir, datasets, "validation", args.eval_questions, args.seed)
        result["before"] = _evaluate(worker, validation)
        print("before", {k: v for k, v in result["before"].items() if k != "examples"}, flush=True)

        learner = Learner(
            args.model,
            LearnerConfig(train_batch_size=8, mini_batch_size=8, micro_batch_size=4),
            PPOConfig(),
            seed=args.seed,
        )
        sft = SFTConfig(epochs=args.epochs, lr=args.lr, batch_size=args.batch_size)
        report = run_warm_start(learner, built.demonstrations, sft, seed=args.seed)
        result["warm_start"] = {
            "steps": report.num_steps,
            "skipped": report.num_skipped,
            "loss_first": report.losses[0],
            "loss_last": report.losses[-1],
            "wall_s": report.wall_s,
        }
        print("warm start", result["warm_start"], flush=True)
        export = learner.export_weights()
        engine.load_weights(export.state_dict, export.policy_version)
        del learner
        result["after"] = _evaluate(worker, validation)
        print("after", {k: v for k, v in result["after"].items() if k != "examples"}, flush=True)
        for line in result["after"]["examples"]:
            print("---\n" + line)
    finally:
        stop_server(server)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
