"""Corpus builders on tiny hand-made records: chunking, ids, order, Search-R1 format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prepare import sources as S
from prepare.corpus import (
    Passage,
    airport_passages,
    chunk_text,
    country_answer_aliases,
    factbook_passages,
    iso_to_country_name,
    write_passages,
)
from prepare.sources import clean_html


def _factbook(code: str, name: str, fields: dict) -> S.FactbookCountry:
    flat = {k: v for k, v in fields.items()}
    return S.FactbookCountry(code, name, "", flat)


def test_chunk_text_packs_sentences_up_to_the_limit() -> None:
    # 3 sentences of 4, 4 and 3 words; limit 8 -> [4+4] then [3].
    text = "One two three four. Five six seven eight. Nine ten eleven."
    assert chunk_text(text, max_words=8) == [
        "One two three four. Five six seven eight.",
        "Nine ten eleven.",
    ]


def test_chunk_text_splits_a_long_sentence_and_keeps_every_word() -> None:
    words = [f"w{i}" for i in range(25)]
    chunks = chunk_text(" ".join(words), max_words=10)
    assert [len(c.split()) for c in chunks] == [10, 10, 5]
    assert " ".join(chunks).split() == words
    assert chunk_text("   ") == []


def test_clean_html_strips_factbook_markup() -> None:
    raw = "<strong>metropolitan France:</strong> Paris<br><br>Bogot&aacute; &amp; more\xa0"
    assert clean_html(raw) == "metropolitan France: Paris; Bogotá & more"


def test_factbook_passages_ids_titles_and_chunk_lead() -> None:
    long_text = " ".join(f"word{i}." for i in range(150))  # 150 one-word sentences
    fb = [
        _factbook(
            "fr",
            "France",
            {("Government", "Capital"): "name: Paris", ("Geography", "Climate"): long_text},
        ),
        _factbook("cg", "DRC", {("Government", "Capital"): "name: Kinshasa"}),
    ]
    got = list(factbook_passages(fb))
    ids = [p.id for p in got]
    # sorted by (section, field) within a country; the long field makes two chunks
    assert ids == [
        "factbook:fr:Geography/Climate:0",
        "factbook:fr:Geography/Climate:1",
        "factbook:fr:Government/Capital:0",
        "factbook:cg:Government/Capital:0",
    ]
    assert got[2].contents == '"France: Capital"\nFrance, Capital: name: Paris'
    # the second chunk repeats its subject so it is retrievable on its own
    assert got[1].text.startswith("France, Climate: word")
    assert all(len(p.text.split()) <= 100 for p in got)
    # Factbook's "DRC" reads as the full name
    assert got[3].title == "Democratic Republic of the Congo: Capital"


def test_country_join_by_fips_and_aliases() -> None:
    fb = [_factbook("uk", "United Kingdom", {}), _factbook("cg", "DRC", {})]
    geo = [
        S.GeoCountry("GB", "UK", "United Kingdom of GB", "London", "Pound", (), 1, 1.0),
        S.GeoCountry("CD", "CG", "DR Congo", "Kinshasa", "Franc", (), 1, 1.0),
        S.GeoCountry("ZZ", "", "Nowhere", "", "", (), 1, 1.0),
    ]
    assert iso_to_country_name(fb, geo) == {
        "GB": "United Kingdom",
        "CD": "Democratic Republic of the Congo",
        "ZZ": "Nowhere",
    }
    assert country_answer_aliases("United Kingdom", "United Kingdom of GB")[:3] == [
        "United Kingdom",
        "United Kingdom of GB",
        "UK",
    ]


def test_airport_passage_names_country_and_codes() -> None:
    a = S.Airport("EGLL", "LHR", "Heathrow Airport", "London", "England", "GB", 83, "Europe/London")
    (p,) = airport_passages([a], {"GB": "United Kingdom"})
    assert p.id == "airports:EGLL:0"
    assert p.text.startswith(
        "Heathrow Airport (IATA code LHR, ICAO code EGLL) is an airport serving London, "
        "England, United Kingdom."
    )


def test_write_passages_is_search_r1_jsonl_and_rejects_duplicate_ids(tmp_path: Path) -> None:
    items = [("a", Passage("x:1:0", "T", "text one")), ("b", Passage("y:2:0", "U", "two"))]
    counts = write_passages(items, tmp_path / "p.jsonl")
    lines = (tmp_path / "p.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == [
        {"id": "x:1:0", "contents": '"T"\ntext one'},
        {"id": "y:2:0", "contents": '"U"\ntwo'},
    ]
    assert dict(counts) == {"a": 1, "b": 1}
    with pytest.raises(ValueError, match="duplicate passage id 'x:1:0'"):
        write_passages([*items, ("a", Passage("x:1:0", "T", "again"))], tmp_path / "q.jsonl")


def test_corrupt_package_stops_corpus_build_without_a_corpus_folder(tmp_path: Path) -> None:
    from prepare.corpus import SOURCE_PACKAGES, build_corpus
    from prepare.packages import PACKAGES, PackageError

    first = PACKAGES[SOURCE_PACKAGES["wikipedia"]]
    (tmp_path / "packages").mkdir()
    bad = tmp_path / "packages" / first.filename
    bad.write_bytes(b"truncated download")
    with pytest.raises(PackageError, match="sha256 mismatch") as err:
        build_corpus(tmp_path)
    assert first.filename in str(err.value)
    assert not (tmp_path / "corpus").exists()


def test_run_prepare_rejects_unknown_steps(tmp_path: Path) -> None:
    from prepare.run import run_prepare

    with pytest.raises(ValueError, match=r"unknown prepare step\(s\) \['index'\]"):
        run_prepare(tmp_path, only=["corpus", "index"])
