"""The assets built by ``stppo prepare`` meet their contract (counts, splits, format)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from actors.scoring import score_answer
from prepare.packages import PACKAGES
from prepare.qa import SETS, SPLITS

pytestmark = pytest.mark.integration


def _read_jsonl(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


@pytest.fixture(scope="module")
def corpus_ids(data_dir: Path) -> set[str]:
    ids = []
    with (data_dir / "corpus" / "passages.jsonl").open(encoding="utf-8") as fh:
        for line in fh:
            ids.append(json.loads(line)["id"])
    assert len(ids) == len(set(ids)), "duplicate passage ids"
    return set(ids)


@pytest.fixture(scope="module")
def qa_sets(data_dir: Path) -> dict[str, dict[str, list[dict]]]:
    return {
        name: {split: _read_jsonl(data_dir / "qa" / name / f"{split}.jsonl") for split in SPLITS}
        for name in SETS
    }


def test_corpus_matches_manifest(data_dir: Path, corpus_ids: set[str]) -> None:
    manifest = json.loads((data_dir / "corpus" / "manifest.json").read_text())
    assert manifest["num_passages"] == len(corpus_ids) >= 250_000
    assert sum(manifest["counts_by_source"].values()) == len(corpus_ids)
    for entry in manifest["packages"]:
        assert PACKAGES[entry["name"]].sha256 == entry["sha256"]
    attribution = (data_dir / "corpus" / "ATTRIBUTION").read_text()
    assert "CC BY-SA" in attribution and "Human Phenotype Ontology" in attribution


def test_qa_counts_and_entity_disjoint_splits(qa_sets: dict, corpus_ids: set[str]) -> None:
    minimum = {"single_hop": 10_000, "multi_hop": 5_000, "medical_mc": 10_000}
    entity_split: dict[str, str] = {}
    all_ids: set[str] = set()
    for name, splits in qa_sets.items():
        assert sum(len(v) for v in splits.values()) >= minimum[name]
        for split, records in splits.items():
            assert len(records) > 0
            for r in records:
                assert r["data_source"] == name
                assert r["golden_answers"] and all(isinstance(a, str) for a in r["golden_answers"])
                assert r["id"] not in all_ids
                all_ids.add(r["id"])
                meta = r["metadata"]
                # same entity -> same split, across all three sets
                assert entity_split.setdefault(meta["entity"], split) == split, meta["entity"]
                assert len(meta["search_queries"]) == (2 if name == "multi_hop" else 1)
                assert meta["answer_passage_id"] in corpus_ids
                if name == "medical_mc":
                    assert sorted(meta["options"]) == ["A", "B", "C", "D"]
                    assert r["golden_answers"] == [meta["answer_letter"]]
                    assert f"\n{meta['answer_letter']}. {meta['answer_text']}" in r["question"]
                    assert score_answer(meta["answer_letter"], r)
                else:
                    assert score_answer(r["golden_answers"][0], r)


def test_report_meets_contract(data_dir: Path) -> None:
    report = json.loads((data_dir / "qa" / "report.json").read_text())
    assert report["retrieval"]["multi_hop"]["recall_raw_question"] < 0.15
    assert report["retrieval"]["multi_hop"]["recall_second_query"] > 0.5
    heuristics = report["medical_mc_heuristics"]["all"]
    assert abs(heuristics["longest_option"] - 0.25) <= 0.05
    assert abs(heuristics["most_overlap"] - 0.25) <= 0.05


def test_model_folder_is_plain_bf16(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["dtype"] == "bfloat16" and config["vocab_size"] == 49152
    info = json.loads((model_dir / "prepare_info.json").read_text())
    assert info["num_params"] == 134_515_008
    assert "Paris" in info["verify_answer"]
    assert "<|im_start|>" in (model_dir / "chat_template.jinja").read_text()


def test_the_committed_test_tokenizer_is_the_one_prepare_builds(
    model_dir: Path, tokenizer_dir: Path
) -> None:
    """tests/assets/smollm2-tokenizer (what unit tests load) is byte for byte the
    tokenizer of the model folder ``stppo prepare`` builds."""
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tokenizer_dir / name).read_bytes() == (model_dir / name).read_bytes(), name


def test_second_prepare_only_verifies(data_dir: Path) -> None:
    from prepare.run import run_prepare

    report = run_prepare(data_dir)
    assert [s.name for s in report.steps] == ["model", "corpus", "qa"]
    assert not any(s.built for s in report.steps)  # verified, nothing rebuilt (no timing:
    # a wall-clock bound fails on a loaded machine without saying anything about the code)
