"""Build indexes once, save them under ``index_dir/<method>/``, load them on start.

Layout::

    index_dir/bm25/   bm25s files (CSC score arrays .npy, vocab JSON) + manifest.json
    index_dir/dense/  faiss.index (flat / IVF / HNSW inner product, float32 x 384) + manifest.json
    hybrid            has no folder of its own: it loads bm25/ and dense/

``manifest.json`` records the corpus sha256 and passage count (dense: also the encoder, the
prefixes and the faiss index type, :func:`dense_build_fields`); loading an index built from
another corpus or with other dense settings raises :class:`IndexMismatchError` instead of
serving wrong passages. A faiss index built elsewhere (e.g. Search-R1's ``e5_Flat.index``)
is taken in by :func:`register_prebuilt_dense_index`, which checks it and writes the manifest.

Example::

    (report,) = build_index(RetrievalServerConfig(method="bm25"))  # [] when up to date
    print(report.summary)
    loaded = load_retriever(RetrievalServerConfig(method="bm25"))
    loaded.retriever.search(["capital of france"], topk=3)
"""

from __future__ import annotations

import json
import logging
import resource
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from retrieval_server.config import RetrievalServerConfig
from retrieval_server.passages import Passages, file_sha256, load_passages
from retrieval_server.retrievers import (
    BM25Retriever,
    DenseRetriever,
    HybridRetriever,
    Retriever,
    faiss_index_type,
    load_encoder,
    write_json,
)

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
_BASE_METHODS = {"bm25": ("bm25",), "dense": ("dense",), "hybrid": ("bm25", "dense")}


class IndexMismatchError(RuntimeError):
    """The saved index is missing or was built from a different corpus (message says which)."""


@dataclass(frozen=True)
class IndexBuildReport:
    """One built index (``method`` is ``bm25`` or ``dense``)."""

    method: str
    directory: Path
    num_passages: int
    build_time_s: float
    """Wall time of tokenizing/encoding and indexing, excluding reading the corpus."""
    peak_rss_gib: float
    """Peak resident set size of this process so far (GiB)."""
    index_bytes: int
    """Size of the saved index files on disk (bytes)."""

    @property
    def summary(self) -> str:
        """One line for people, e.g. ``bm25 over 330,890 passages, 152.3 MiB in data/index/bm25,
        peak RSS 2.41 GiB`` (what ``stppo prepare`` prints after ``built in N s:``)."""
        return (
            f"{self.method} over {self.num_passages:,} passages, "
            f"{self.index_bytes / 2**20:.1f} MiB in {self.directory}, "
            f"peak RSS {self.peak_rss_gib:.2f} GiB"
        )


@dataclass(frozen=True)
class LoadedRetriever:
    """A ready retriever and what loading it cost."""

    retriever: Retriever
    load_time_s: float
    """Wall time of reading the corpus and opening the index files (and encoder)."""
    rss_gib: float
    """Resident set size of this process after loading (GiB)."""
    index_bytes: int
    """Size of the loaded index files on disk (bytes)."""


def rss_gib() -> float:
    """Current resident set size of this process in GiB (from /proc/self/statm)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize() / 2**30


def peak_rss_gib() -> float:
    """Peak resident set size of this process in GiB (``ru_maxrss`` is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def directory_bytes(directory: Path) -> int:
    """Total size of the files under ``directory`` (bytes)."""
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def index_directory(config: RetrievalServerConfig, base_method: str) -> Path:
    """``index_dir/<base_method>`` (``bm25`` or ``dense``)."""
    return config.index_dir / base_method


def build_index(
    config: RetrievalServerConfig, force: bool = False, lock_path: Path | None = None
) -> list[IndexBuildReport]:
    """Build and save the index(es) ``config.method`` needs (hybrid: bm25 and dense).

    An existing index whose manifest matches the corpus is kept unless ``force``. The dense
    build saves its embeddings chunk by chunk under ``index_dir/dense.partial-<corpus sha>``
    and resumes from there after an interruption; ``lock_path`` (the shared heavy-job lock)
    is held per chunk, not for the whole hour-long build.

    Returns:
        One report per index built (empty when every index was already up to date).

    Raises:
        CorpusError: the corpus file is missing or malformed.
    """
    passages = load_passages(config.corpus_path)
    corpus_sha256 = file_sha256(config.corpus_path)
    reports = []
    for base in _BASE_METHODS[config.method]:
        directory = index_directory(config, base)
        if not force and _manifest_matches(directory, base, corpus_sha256, len(passages), config):
            log.info("index %s is up to date, not rebuilding", directory)
            continue
        reports.append(_build_one(config, base, passages, corpus_sha256, lock_path))
    return reports


def _build_one(
    config: RetrievalServerConfig,
    base: str,
    passages: Passages,
    corpus_sha256: str,
    lock_path: Path | None,
) -> IndexBuildReport:
    directory = index_directory(config, base)
    staging = directory.with_name(directory.name + ".building")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    start = time.perf_counter()
    if base == "bm25":
        BM25Retriever.build(passages).save(staging)
    else:
        encoder = load_encoder(
            config.dense_model_dir, config.dense_max_seq_tokens, config.torch_threads
        )
        chunks = directory.with_name(f"{directory.name}.partial-{corpus_sha256[:12]}")
        chunks.mkdir(parents=True, exist_ok=True)
        dense = DenseRetriever.build(
            passages, encoder, config.dense_batch_size, chunks, lock_path,
            passage_prefix=config.dense_passage_prefix, index_type=config.dense_index_type,
            nlist=config.dense_ivf_nlist, hnsw_m=config.dense_hnsw_m,
            ef_construction=config.dense_hnsw_ef_construction,
        )  # fmt: skip
        dense.save(staging)
    build_time_s = time.perf_counter() - start
    report = IndexBuildReport(
        method=base,
        directory=directory,
        num_passages=len(passages),
        build_time_s=build_time_s,
        peak_rss_gib=peak_rss_gib(),
        index_bytes=directory_bytes(staging),
    )
    manifest = {k: v for k, v in asdict(report).items() if k != "directory"}
    manifest.update(
        corpus_path=str(config.corpus_path),
        corpus_sha256=corpus_sha256,
        dense_max_seq_tokens=config.dense_max_seq_tokens if base == "dense" else None,
    )
    if base == "dense":
        manifest.update(dense_build_fields(config))
    write_json(staging / MANIFEST, manifest)
    # Swap in whole so a crash mid-build never leaves a half-written index in place.
    shutil.rmtree(directory, ignore_errors=True)
    staging.rename(directory)
    if base == "dense":
        shutil.rmtree(chunks, ignore_errors=True)
    log.info("built %s index: %s", base, manifest)
    return report


def dense_build_fields(config: RetrievalServerConfig) -> dict[str, object]:
    """What a dense index depends on besides the corpus (recorded in its manifest; a
    different value in the config means another index): the encoder folder, the prefixes,
    the faiss index type and its build parameters."""
    fields: dict[str, object] = {
        "dense_model_dir": str(config.dense_model_dir) if config.dense_model_dir else None,
        "dense_query_prefix": config.dense_query_prefix,
        "dense_passage_prefix": config.dense_passage_prefix,
        "dense_index_type": config.dense_index_type,
    }
    if config.dense_index_type == "ivf":
        fields["dense_ivf_nlist"] = config.dense_ivf_nlist
    if config.dense_index_type == "hnsw":
        fields["dense_hnsw_m"] = config.dense_hnsw_m
    return fields


# what an index built before these fields existed was built with
_DENSE_DEFAULTS = {
    "dense_model_dir": None,
    "dense_query_prefix": "",
    "dense_passage_prefix": "",
    "dense_index_type": "flat",
}


def _dense_mismatches(config: RetrievalServerConfig, manifest: dict) -> list[str]:
    """``field: index has X, config has Y`` for each dense build field that differs."""
    out = []
    for key, wanted in dense_build_fields(config).items():
        have = manifest.get(key, _DENSE_DEFAULTS.get(key))
        if have != wanted:
            out.append(f"{key}: index has {have!r}, config has {wanted!r}")
    return out


def _read_manifest(directory: Path) -> dict | None:
    path = directory / MANIFEST
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def _manifest_matches(
    directory: Path,
    base: str,
    corpus_sha256: str,
    num_passages: int,
    config: RetrievalServerConfig | None = None,
) -> bool:
    manifest = _read_manifest(directory)
    return (
        manifest is not None
        and manifest.get("method") == base
        and manifest.get("corpus_sha256") == corpus_sha256
        and manifest.get("num_passages") == num_passages
        and not (base == "dense" and config is not None and _dense_mismatches(config, manifest))
    )


def _check_index(config: RetrievalServerConfig, base: str, passages: Passages) -> Path:
    directory = index_directory(config, base)
    manifest = _read_manifest(directory)
    hint = f"build it with `python -m retrieval_server --method {config.method} --build-only`"
    if manifest is None:
        raise IndexMismatchError(f"no {base} index at {directory}: {hint}")
    if manifest.get("num_passages") != len(passages):
        raise IndexMismatchError(
            f"{base} index at {directory} has {manifest.get('num_passages')} passages but "
            f"{config.corpus_path} has {len(passages)}: rebuild ({hint} --force-build)"
        )
    if manifest.get("corpus_sha256") != file_sha256(config.corpus_path):
        raise IndexMismatchError(
            f"{base} index at {directory} was built from another version of "
            f"{config.corpus_path}: rebuild ({hint} --force-build)"
        )
    mismatches = _dense_mismatches(config, manifest) if base == "dense" else []
    if mismatches:
        raise IndexMismatchError(
            f"dense index at {directory} was built with other settings ("
            + "; ".join(mismatches)
            + f"): rebuild ({hint} --force-build) or change the config"
        )
    return directory


def load_retriever(config: RetrievalServerConfig) -> LoadedRetriever:
    """Load the corpus and the saved index(es) of ``config.method`` (memory-mapped).

    Builds missing indexes first when ``config.build_missing_index``.

    Raises:
        CorpusError: the corpus file is missing or malformed.
        IndexMismatchError: an index is missing or belongs to another corpus.
    """
    if config.build_missing_index:
        build_index(config)
    start = time.perf_counter()
    passages = load_passages(config.corpus_path)
    directories = {
        base: _check_index(config, base, passages) for base in _BASE_METHODS[config.method]
    }
    retriever: Retriever
    bm25 = BM25Retriever.load(directories["bm25"], passages) if "bm25" in directories else None
    dense = None
    if "dense" in directories:
        encoder = load_encoder(
            config.dense_model_dir, config.dense_max_seq_tokens, config.torch_threads
        )
        dense = DenseRetriever.load(
            directories["dense"], passages, encoder,
            query_prefix=config.dense_query_prefix, nprobe=config.dense_ivf_nprobe,
            ef_search=config.dense_hnsw_ef_search,
        )  # fmt: skip
    if bm25 is not None and dense is not None:
        retriever = HybridRetriever(bm25, dense, config.hybrid_candidates, config.rrf_k)
    else:
        retriever = bm25 if bm25 is not None else dense  # type: ignore[assignment]
    return LoadedRetriever(
        retriever=retriever,
        load_time_s=time.perf_counter() - start,
        rss_gib=rss_gib(),
        index_bytes=sum(directory_bytes(d) for d in directories.values()),
    )


def register_prebuilt_dense_index(
    config: RetrievalServerConfig, faiss_path: Path, link: bool = False
) -> IndexBuildReport:
    """Adopt a faiss index built elsewhere as ``index_dir/dense`` and write its manifest.

    The index must hold one vector per passage of ``config.corpus_path``, in file order, made
    by the encoder of ``config.dense_model_dir`` (with ``dense_passage_prefix``) and
    L2-normalised (inner product = cosine). Its type (flat / IVF / HNSW) is read from the file
    and must be ``config.dense_index_type``.

    Args:
        link: hard-link the file instead of copying it (same file system only).

    Raises:
        CorpusError: the corpus is missing or malformed.
        IndexMismatchError: not a faiss index, a passage-count, dimension or index-type
            mismatch (each message names the numbers).
    """
    import faiss

    passages = load_passages(config.corpus_path)
    try:
        index = faiss.read_index(str(faiss_path), faiss.IO_FLAG_MMAP)
    except Exception as e:  # faiss raises RuntimeError with its C++ message
        raise IndexMismatchError(f"{faiss_path}: not a readable faiss index ({e})") from None
    if index.ntotal != len(passages):
        raise IndexMismatchError(
            f"{faiss_path} holds {index.ntotal} vectors but {config.corpus_path} has "
            f"{len(passages)} passages (one vector per passage, in file order)"
        )
    kind = faiss_index_type(index)
    if kind != config.dense_index_type:
        raise IndexMismatchError(
            f"{faiss_path} is a {kind} index but dense_index_type is "
            f"{config.dense_index_type!r}: set it to match"
        )
    encoder = load_encoder(
        config.dense_model_dir, config.dense_max_seq_tokens, config.torch_threads
    )
    if index.d != encoder.get_embedding_dimension():
        raise IndexMismatchError(
            f"{faiss_path} holds {index.d}-dimensional vectors but the encoder "
            f"({config.dense_model_dir or 'all-MiniLM-L6-v2'}) makes "
            f"{encoder.get_embedding_dimension()}: set dense_model_dir to the index's encoder"
        )
    directory = index_directory(config, "dense")
    staging = directory.with_name(directory.name + ".building")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    target = staging / DenseRetriever.INDEX_FILE
    if link:
        target.hardlink_to(faiss_path)
    else:
        shutil.copyfile(faiss_path, target)
    report = IndexBuildReport(
        method="dense",
        directory=directory,
        num_passages=len(passages),
        build_time_s=0.0,
        peak_rss_gib=peak_rss_gib(),
        index_bytes=directory_bytes(staging),
    )
    manifest = {k: v for k, v in asdict(report).items() if k != "directory"}
    manifest.update(
        corpus_path=str(config.corpus_path),
        corpus_sha256=file_sha256(config.corpus_path),
        dense_max_seq_tokens=config.dense_max_seq_tokens,
        prebuilt_from=str(faiss_path),
        prebuilt_sha256=file_sha256(faiss_path),
        **dense_build_fields(config),
    )
    write_json(staging / MANIFEST, manifest)
    shutil.rmtree(directory, ignore_errors=True)
    staging.rename(directory)
    log.info("registered prebuilt dense index: %s", manifest)
    return report
