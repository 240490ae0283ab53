"""Retrievers on hand-checked corpora: BM25 scores by hand, known rankings on the 36-passage
fixture corpus, dense and hybrid rankings, RRF arithmetic, index build/load/mismatch."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from fixture_paths import FIXTURE_CORPUS

from retrieval_server.config import RetrievalServerConfig
from retrieval_server.index import IndexMismatchError, build_index, load_retriever
from retrieval_server.passages import CorpusError, Passages, load_passages
from retrieval_server.retrievers import (
    BM25Retriever,
    DenseRetriever,
    HybridRetriever,
    Retriever,
    SearchHits,
    load_encoder,
    reciprocal_rank_fusion,
)


@pytest.fixture(scope="module")
def passages() -> Passages:
    return load_passages(FIXTURE_CORPUS)


@pytest.fixture(scope="module")
def bm25(passages: Passages) -> BM25Retriever:
    return BM25Retriever.build(passages)


@pytest.fixture(scope="module")
def dense(passages: Passages) -> DenseRetriever:
    """all-MiniLM-L6-v2 over the fixture corpus (loading the encoder takes a few seconds)."""
    encoder = load_encoder(None, max_seq_tokens=128, torch_threads=1)
    return DenseRetriever.build(passages, encoder, batch_size=64)


def ids(passages: Passages, hits: SearchHits) -> list[str]:
    return [passages.ids[i] for i in hits.passage_indices]


# ------------------------------------------------------------------------------------ BM25


def test_bm25_scores_match_hand_computed_lucene_formula() -> None:
    # Tokens after stemming: d0 [appl, banana], d1 [appl, appl, cherri], d2 [cherri, date].
    # N=3, avgdl=7/3, k1=1.5, b=0.75; Lucene BM25 (no (k1+1) factor):
    # idf(appl) = ln(1 + (3 - 2 + 0.5) / (2 + 0.5)) = ln(1.6) = 0.470004
    # d0: tf=1, dl/avgdl=6/7: 1 / (1 + 1.5 * (0.25 + 0.75 * 6/7)) = 0.427481 -> 0.200918
    # d1: tf=2, dl/avgdl=9/7: 2 / (2 + 1.5 * (0.25 + 0.75 * 9/7)) = 0.523364 -> 0.245983
    corpus = Passages(
        ids=["d0", "d1", "d2"], contents=["apple banana", "apple apple cherry", "cherry date"]
    )
    [hits] = BM25Retriever.build(corpus).search(["Apples!"], topk=5)
    assert hits.passage_indices.tolist() == [1, 0]  # d2 has no "appl": left out, not score 0
    idf = math.log(1.6)
    expected = [
        idf * 2 / (2 + 1.5 * (0.25 + 0.75 * 9 / 7)),
        idf * 1 / (1 + 1.5 * (0.25 + 0.75 * 6 / 7)),
    ]
    np.testing.assert_allclose(hits.scores, expected, rtol=1e-6)


@pytest.mark.parametrize(
    ("query", "expected_top"),
    [
        ("capital of Peru", ["0", "1"]),  # Peru, Lima: both say "capital" and "Peru"
        ("who discovered polonium", ["15"]),  # Polonium
        ("IATA code of the airport serving Nairobi", ["19"]),  # Jomo Kenyatta Airport
        ("gene on chromosome band 4p16.3", ["23", "21"]),  # HTT, then CFTR (band, gene)
        ("Discovering RADIUM", ["16"]),  # case and stemming: discovering -> discov
    ],
)
def test_bm25_known_rankings(
    bm25: BM25Retriever, passages: Passages, query: str, expected_top: list[str]
) -> None:
    [hits] = bm25.search([query], topk=3)
    assert ids(passages, hits)[: len(expected_top)] == expected_top
    assert np.all(np.diff(hits.scores) <= 0)


def test_bm25_stopword_and_unknown_queries_get_no_hits(bm25: BM25Retriever) -> None:
    hits = bm25.search(["the of and", "zzzqqq xyzzy", "Lima"], topk=3)
    assert [len(h.passage_indices) for h in hits[:2]] == [0, 0]
    assert len(hits[2].passage_indices) > 0


def test_bm25_topk_larger_than_corpus_is_clamped(bm25: BM25Retriever, passages: Passages) -> None:
    [hits] = bm25.search(["capital"], topk=100)
    # "capital" occurs in exactly these 10 passages: Peru, Lima, Chile, Santiago, France,
    # Paris, Japan, Tokyo, Kenya, Nairobi.
    assert sorted(ids(passages, hits), key=int) == [
        "0",
        "1",
        "2",
        "3",
        "4",
        "5",
        "6",
        "7",
        "8",
        "9",
    ]


def test_bm25_matches_bm25s_reference_pipeline(bm25: BM25Retriever, passages: Passages) -> None:
    """Identity: our read-only tokenizer + bincount scoring == bm25s.tokenize + retrieve
    (np.add.at) on the same index, up to float32 rounding and the order of tied passages."""
    import bm25s
    import Stemmer

    queries = ["capital of Peru", "who discovered polonium", "highest mountain in Africa"]
    stemmer = Stemmer.Stemmer("english")
    reference = bm25s.tokenize(queries, stopwords="en", stemmer=stemmer, show_progress=False)
    # k = whole corpus, so both sides hold every matching passage (no cut inside a tie).
    ref_docs, ref_scores = bm25._model.retrieve(reference, k=36, show_progress=False)
    for row, hits in enumerate(bm25.search(queries, topk=36)):
        positive = ref_scores[row] > 0
        np.testing.assert_allclose(hits.scores, ref_scores[row][positive], rtol=1e-6)
        ref_pairs = sorted(
            zip(-np.round(ref_scores[row][positive], 5), ref_docs[row][positive], strict=True)
        )
        assert hits.passage_indices.tolist() == [int(d) for _, d in ref_pairs]


def test_bm25_ties_broken_by_smaller_index_at_the_cutoff() -> None:
    # Four identical passages tie on "apple"; topk=2 must return the two smallest indices.
    corpus = Passages(ids=list("abcde"), contents=["pear"] + ["apple"] * 4)
    [hits] = BM25Retriever.build(corpus).search(["apple"], topk=2)
    assert hits.passage_indices.tolist() == [1, 2]


def test_bm25_sparse_and_dense_aggregation_agree(bm25: BM25Retriever) -> None:
    # "capital" has 10 postings in 36 passages: 10 * 32 >= 36 takes the dense bincount path;
    # a 1-posting term takes the np.unique path. Both must equal a plain loop.
    for query in ["capital of Peru", "Pizarro"]:
        rows = bm25.query_rows(query)
        candidates, scores = bm25.score_rows(rows)
        expected: dict[int, float] = {}
        for r in rows:
            for j in range(bm25._indptr[r], bm25._indptr[r + 1]):
                doc = int(bm25._indices[j])
                expected[doc] = expected.get(doc, 0.0) + float(bm25._data[j])
        assert candidates.tolist() == sorted(expected)
        np.testing.assert_allclose(scores, [expected[d] for d in sorted(expected)], rtol=1e-12)


def test_bm25_query_tokenizer_does_not_grow_vocabulary(bm25: BM25Retriever) -> None:
    before = len(bm25._stem_to_row)
    bm25.search([f"neverseenword{i}" for i in range(50)], topk=3)
    assert len(bm25._stem_to_row) == before


def test_bm25_save_load_mmap_roundtrip(
    bm25: BM25Retriever, passages: Passages, tmp_path: Path
) -> None:
    bm25.save(tmp_path)
    loaded = BM25Retriever.load(tmp_path, passages, mmap=True)
    queries = ["capital of Japan", "autosomal dominant disorder"]
    for a, b in zip(bm25.search(queries, 5), loaded.search(queries, 5), strict=True):
        assert a.passage_indices.tolist() == b.passage_indices.tolist()
        np.testing.assert_array_equal(a.scores, b.scores)


# ----------------------------------------------------------------------------- dense/hybrid


@pytest.mark.parametrize(
    ("query", "expected_top1"),
    [
        ("tallest peak on the planet", "10"),  # Everest: no shared content word with BM25's pick
        ("drug for wheezing and shortness of breath", "27"),  # Salbutamol (asthma)
        ("capital of Peru", "0"),
    ],
)
def test_dense_known_rankings(
    dense: DenseRetriever, passages: Passages, query: str, expected_top1: str
) -> None:
    [hits] = dense.search([query], topk=3)
    assert ids(passages, hits)[0] == expected_top1
    assert len(hits.passage_indices) == 3
    assert np.all(np.diff(hits.scores) <= 0)
    assert hits.scores.min() >= -1.0 and hits.scores.max() <= 1.0 + 1e-6  # cosine


def test_reciprocal_rank_fusion_hand_computed() -> None:
    # lists [7, 3, 5] and [3, 9], k=60:
    # 3: 1/62 + 1/61 = 0.032522; 7: 1/61 = 0.016393; 9: 1/62 = 0.016129; 5: 1/63 = 0.015873
    fused = reciprocal_rank_fusion([np.array([7, 3, 5]), np.array([3, 9])], rrf_k=60.0, topk=3)
    assert fused.passage_indices.tolist() == [3, 7, 9]
    np.testing.assert_allclose(fused.scores, [1 / 62 + 1 / 61, 1 / 61, 1 / 62], rtol=1e-6)


def test_reciprocal_rank_fusion_breaks_ties_by_index() -> None:
    # 4 and 2 are both first in one list: equal score 1/61, smaller index first.
    fused = reciprocal_rank_fusion([np.array([4]), np.array([2])], rrf_k=60.0, topk=2)
    assert fused.passage_indices.tolist() == [2, 4]


def test_hybrid_fuses_bm25_and_dense(
    bm25: BM25Retriever, dense: DenseRetriever, passages: Passages
) -> None:
    hybrid = HybridRetriever(bm25, dense, candidates=50, rrf_k=60.0)
    assert isinstance(hybrid, Retriever)
    queries = ["who discovered polonium", "tallest peak on the planet"]
    fused = hybrid.search(queries, topk=3)
    # Both retrievers rank Polonium first: 2/61.
    assert ids(passages, fused[0])[0] == "15"
    np.testing.assert_allclose(fused[0].scores[0], 2 / 61, rtol=1e-6)
    # Each fused list equals RRF of the two rankings at depth 50.
    for query, hits in zip(queries, fused, strict=True):
        [s], [d] = bm25.search([query], 50), dense.search([query], 50)
        expected = reciprocal_rank_fusion([s.passage_indices, d.passage_indices], 60.0, 3)
        assert hits.passage_indices.tolist() == expected.passage_indices.tolist()


# ------------------------------------------------------------------------------ index files


def test_build_then_load_bm25_index(tmp_path: Path) -> None:
    config = RetrievalServerConfig(corpus_path=FIXTURE_CORPUS, index_dir=tmp_path)
    [report] = build_index(config)
    assert report.num_passages == 36 and report.build_time_s > 0 and report.index_bytes > 0
    manifest = json.loads((tmp_path / "bm25" / "manifest.json").read_text())
    assert manifest["num_passages"] == 36 and manifest["method"] == "bm25"
    assert build_index(config) == []  # up to date: not rebuilt
    loaded = load_retriever(config)
    assert loaded.retriever.method == "bm25" and loaded.load_time_s > 0
    [hits] = loaded.retriever.search(["who discovered polonium"], 1)
    assert loaded.retriever.passages.ids[hits.passage_indices[0]] == "15"


def test_load_rejects_missing_and_stale_index(tmp_path: Path) -> None:
    corpus = tmp_path / "passages.jsonl"
    corpus.write_text(FIXTURE_CORPUS.read_text())
    config = RetrievalServerConfig(corpus_path=corpus, index_dir=tmp_path / "index")
    with pytest.raises(IndexMismatchError, match="no bm25 index"):
        load_retriever(config)
    build_index(config)
    with corpus.open("a") as f:  # corpus changes after the build
        f.write(json.dumps({"id": "new", "contents": '"New"\nA new passage.'}) + "\n")
    with pytest.raises(IndexMismatchError, match="37"):
        load_retriever(config)


def test_build_missing_index_on_load(tmp_path: Path) -> None:
    config = RetrievalServerConfig(
        corpus_path=FIXTURE_CORPUS, index_dir=tmp_path, build_missing_index=True
    )
    assert len(load_retriever(config).retriever.passages) == 36


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "not JSON"),
        ('{"id": 1, "contents": "x"}', "string"),
        ('["a"]', "expected an object"),
    ],
)
def test_corpus_errors_name_the_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": "a", "contents": "ok"}\n' + line + "\n")
    with pytest.raises(CorpusError, match=rf"bad.jsonl:2: .*{message}"):
        load_passages(path)


def test_dense_build_resumes_from_saved_chunks(
    dense: DenseRetriever, passages: Passages, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import retrieval_server.retrievers as retrievers

    monkeypatch.setattr(retrievers, "_ENCODE_CHUNK", 16)  # 36 passages -> chunks of 16, 16, 4
    lock = tmp_path / "heavy.lock"
    first = DenseRetriever.build(passages, dense._encoder, 64, tmp_path, lock_path=lock)
    assert sorted(p.name for p in tmp_path.glob("chunk_*.npy")) == [
        "chunk_00000.npy", "chunk_00001.npy", "chunk_00002.npy",
    ]  # fmt: skip
    np.save(tmp_path / "chunk_00001.npy", np.zeros((16, 384), np.float32))
    resumed = DenseRetriever.build(passages, dense._encoder, 64, tmp_path)
    vectors = resumed._index.reconstruct_n(0, 36)
    np.testing.assert_array_equal(vectors[16:32], 0.0)  # read back, not re-encoded
    np.testing.assert_allclose(vectors[:16], first._index.reconstruct_n(0, 16), atol=1e-6)


@pytest.mark.parametrize(("chosen", "seen"), [(None, "cpu"), ("cuda", "cuda")])
def test_bm25_keeps_jax_off_the_gpu(tmp_path: Path, chosen: str | None, seen: str) -> None:
    """Where JAX is installed, ``import bm25s`` runs a JAX top-k, and JAX's first computation
    on a CUDA machine takes 75% of the GPU (the whole job on an H200: 105 GiB in the
    retrieval server). A stand-in ``jax`` records the platform it was given at that call:
    the CPU, unless the environment chose one."""
    import os
    import subprocess
    import sys

    fake = tmp_path / "site" / "jax"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "lax.py").write_text(
        "import os\n"
        "def top_k(scores, k):\n"
        "    with open(os.environ['JAX_SEEN'], 'w') as f:\n"
        "        f.write(os.environ.get('JAX_PLATFORMS', '<unset>'))\n"
        "    return scores[:k], list(range(k))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    if chosen is not None:
        env["JAX_PLATFORMS"] = chosen
    root = Path(__file__).resolve().parents[3]
    env["PYTHONPATH"] = os.pathsep.join([str(fake.parent), str(root)])
    env["JAX_SEEN"] = str(tmp_path / "seen.txt")
    code = (
        "from retrieval_server.passages import load_passages\n"
        "from retrieval_server.retrievers import BM25Retriever\n"
        "from pathlib import Path\n"
        f"BM25Retriever.build(load_passages(Path({str(FIXTURE_CORPUS)!r})))\n"
    )
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
    assert (tmp_path / "seen.txt").read_text() == seen
