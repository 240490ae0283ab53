"""Dense retrieval settings (real all-MiniLM-L6-v2 + faiss over the fixture corpus): faiss
index types (flat, IVF, HNSW), query / passage prefixes recorded in the manifest, a prebuilt
faiss index adopted with a manifest, and ``stppo index`` over a FlashRAG-format corpus."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from fixture_paths import FIXTURE_CORPUS
from typer.testing import CliRunner

from retrieval_server.config import RetrievalServerConfig
from retrieval_server.index import (
    IndexMismatchError,
    build_index,
    load_retriever,
    register_prebuilt_dense_index,
)
from retrieval_server.passages import load_passages
from retrieval_server.retrievers import encode, faiss_index_type, load_encoder, make_faiss_index

# known rankings of the fixture corpus (tests/fixtures/retrieval/README.md)
KNOWN = {"who discovered polonium": "15", "IATA code of the airport serving Nairobi": "19"}


def _config(tmp_path: Path, **fields) -> RetrievalServerConfig:
    base = {"method": "dense", "corpus_path": FIXTURE_CORPUS, "index_dir": tmp_path / "index"}
    return RetrievalServerConfig(**{**base, **fields})


def _top1(config: RetrievalServerConfig) -> dict[str, str]:
    loaded = load_retriever(config)
    retriever = loaded.retriever
    hits = retriever.search(list(KNOWN), topk=3)
    return {
        q: retriever.passages.ids[int(h.passage_indices[0])]
        for q, h in zip(KNOWN, hits, strict=True)
    }


@pytest.mark.parametrize(
    ("index_type", "extra"),
    [("flat", {}), ("ivf", {"dense_ivf_nlist": 4, "dense_ivf_nprobe": 4}), ("hnsw", {})],
)
def test_faiss_index_types_find_the_known_passages(
    tmp_path: Path, index_type: str, extra: dict
) -> None:
    config = _config(tmp_path, dense_index_type=index_type, **extra)
    (report,) = build_index(config)
    manifest = json.loads((report.directory / "manifest.json").read_text())
    assert manifest["dense_index_type"] == index_type
    assert faiss_index_type(load_retriever(config).retriever._index) == index_type
    assert _top1(config) == KNOWN
    # another index type is another index: rebuilt, never served from the old one
    other = "hnsw" if index_type != "hnsw" else "flat"
    with pytest.raises(IndexMismatchError, match=f"dense_index_type: index has '{index_type}'"):
        load_retriever(_config(tmp_path, dense_index_type=other))
    assert len(build_index(_config(tmp_path, dense_index_type=other))) == 1


def test_ivf_needs_as_many_passages_as_clusters(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="dense_ivf_nlist=64 clusters need at least"):
        build_index(_config(tmp_path, dense_index_type="ivf", dense_ivf_nlist=64))


def test_query_and_passage_prefixes(tmp_path: Path) -> None:
    config = _config(tmp_path, dense_query_prefix="query: ", dense_passage_prefix="passage: ")
    build_index(config)
    loaded = load_retriever(config).retriever
    encoder = load_encoder(None, config.dense_max_seq_tokens, 1)
    first = load_passages(FIXTURE_CORPUS).contents[0]
    stored = loaded._index.reconstruct(0)
    assert np.allclose(stored, encode(encoder, ["passage: " + first], 8)[0], atol=1e-5)
    assert not np.allclose(stored, encode(encoder, [first], 8)[0], atol=1e-3)
    assert loaded.query_prefix == "query: "
    assert _top1(config) == KNOWN
    with pytest.raises(IndexMismatchError, match="dense_passage_prefix: index has 'passage: '"):
        load_retriever(_config(tmp_path, dense_query_prefix="query: "))


def test_prebuilt_faiss_index_is_adopted_with_a_manifest(tmp_path: Path) -> None:
    passages = load_passages(FIXTURE_CORPUS)
    encoder = load_encoder(None, 128, 1)
    vectors = encode(encoder, passages.contents, 16)
    import faiss

    index = make_faiss_index("hnsw", vectors.shape[1], hnsw_m=16)
    index.add(vectors)
    prebuilt = tmp_path / "e5_HNSW.index"
    faiss.write_index(index, str(prebuilt))
    config = _config(tmp_path, dense_index_type="hnsw")
    report = register_prebuilt_dense_index(config, prebuilt)
    manifest = json.loads((report.directory / "manifest.json").read_text())
    assert manifest["prebuilt_from"] == str(prebuilt)
    assert manifest["num_passages"] == len(passages) == 36
    assert build_index(config) == []  # the manifest makes it up to date: nothing re-encoded
    assert _top1(config) == KNOWN

    with pytest.raises(IndexMismatchError, match="is a hnsw index but dense_index_type is 'flat'"):
        register_prebuilt_dense_index(_config(tmp_path), prebuilt)
    short = make_faiss_index("flat", vectors.shape[1])
    short.add(vectors[:35])
    faiss.write_index(short, str(tmp_path / "short.index"))
    with pytest.raises(IndexMismatchError, match=r"holds 35 vectors but .* has 36 passages"):
        register_prebuilt_dense_index(_config(tmp_path), tmp_path / "short.index")


def test_stppo_index_builds_a_flashrag_corpus(tmp_path: Path) -> None:
    from services.cli import app

    # FlashRAG / Search-R1 corpus lines: {"id", "contents": "title\ntext"}
    corpus = tmp_path / "corpus.jsonl"
    rows = [{"id": str(i), "contents": f"Title {i}\nText about topic {i}."} for i in range(5)]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = [
        f"retrieval.server.corpus_path={json.dumps(str(corpus))}",
        f"retrieval.server.index_dir={json.dumps(str(tmp_path / 'idx'))}",
    ]
    result = CliRunner().invoke(app, ["index", *args])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output.splitlines()[-1])["num_passages"] == 5
    again = CliRunner().invoke(app, ["index", *args])
    assert "is up to date (bm25)" in again.output
    bad = CliRunner().invoke(app, ["index", "retrieval.server.corpus_path='nope.jsonl'"])
    assert bad.exit_code == 2 and "nope.jsonl does not exist" in bad.output
