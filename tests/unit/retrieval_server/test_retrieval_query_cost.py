"""BM25 query cost: a repeated query term is scored once, weighted by its count.

The issue: 256 queries of 4,096 characters of a few common words re-read (and re-summed)
the postings of every repetition, 7.9 s of CPU for one request. Scores must not change:
bm25s counts a repeated term again, and so must we.
"""

from __future__ import annotations

import numpy as np
import pytest
from fixture_paths import FIXTURE_CORPUS

from retrieval_server.passages import load_passages
from retrieval_server.retrievers import BM25Retriever


class CountingArray(np.ndarray):
    """An ndarray view that counts slicing calls (how often postings are read)."""

    reads = 0

    def __getitem__(self, key):
        CountingArray.reads += 1
        return np.asarray(super().__getitem__(key))


@pytest.fixture(scope="module")
def retriever() -> BM25Retriever:
    return BM25Retriever.build(load_passages(FIXTURE_CORPUS))


def _naive_scores(r: BM25Retriever, rows: list[int]) -> np.ndarray:
    """Every passage's score, one postings read per query token (the pre-dedupe sum)."""
    scores = np.zeros(r._num_docs)
    for row in rows:
        a, b = int(r._indptr[row]), int(r._indptr[row + 1])
        np.add.at(scores, r._indices[a:b], r._data[a:b].astype(np.float64))
    return scores


def _dense(r: BM25Retriever, rows: list[int]) -> np.ndarray:
    candidates, scores = r.score_rows(rows)
    out = np.zeros(r._num_docs)
    out[candidates] = scores
    return out


def test_normal_query_scores_are_unchanged(retriever: BM25Retriever) -> None:
    rows = retriever.query_rows("capital of Peru founded by Pizarro")
    assert len(rows) == len(set(rows)) >= 3  # no repeats: the common case
    np.testing.assert_array_equal(_dense(retriever, rows), _naive_scores(retriever, rows))
    # and bm25s itself agrees (float32 scores there)
    reference = retriever._model.get_scores(rows)
    np.testing.assert_allclose(_dense(retriever, rows), reference, rtol=1e-6)


def test_repeated_terms_keep_bm25s_multiplicity(retriever: BM25Retriever) -> None:
    rows = retriever.query_rows("lima lima lima peru capital lima peru")
    assert len(rows) == 7 and len(set(rows)) == 3
    # lima x4, peru x2, capital x1: bm25s adds a term's contribution once per occurrence
    np.testing.assert_allclose(_dense(retriever, rows), _naive_scores(retriever, rows), rtol=1e-12)
    np.testing.assert_allclose(
        _dense(retriever, rows), retriever._model.get_scores(rows), rtol=1e-6
    )


def test_postings_of_a_repeated_term_are_read_once(retriever: BM25Retriever) -> None:
    """The cost of the hostile request, without a clock: 1,000 repetitions of two words read
    the postings of two words."""
    query = " ".join(["capital peru"] * 1000)
    rows = retriever.query_rows(query)
    assert len(rows) == 2000
    original = retriever._indices
    retriever._indices = original.view(CountingArray)
    CountingArray.reads = 0
    try:
        [hits] = retriever.search([query], topk=3)
    finally:
        retriever._indices = original
    assert CountingArray.reads == 2
    assert len(hits.passage_indices) == 3
