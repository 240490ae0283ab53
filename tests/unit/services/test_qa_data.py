"""QA sets from your own files (services.qa_data): Search-R1 records in JSON Lines / Parquet."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from actors.prompts import MULTIPLE_CHOICE_SUFFIX, user_message
from actors.scoring import score_answer
from services.config import ConfigError, load_config
from services.qa_data import QADataError, load_qa_file
from services.sampler import QuestionSampler, evaluation_questions, qa_sets

OWN = Path(__file__).resolve().parents[2] / "fixtures" / "own_task"
NQ, HOTPOT = OWN / "nq", OWN / "hotpotqa"


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_nq_and_hotpotqa_parquet_fixtures_load_and_score() -> None:
    nq = load_qa_file(NQ / "train.parquet")
    assert len(nq) == 8
    assert nq[0] == {
        "id": "train_0",
        "question": "what is the capital of peru",
        "golden_answers": ["Lima"],
        "data_source": "nq",
        "metadata": {},
    }
    hotpot = load_qa_file(HOTPOT / "validation.parquet")
    assert [r["data_source"] for r in hotpot] == ["hotpotqa", "hotpotqa"]
    assert hotpot[0]["metadata"] == {"type": "bridge", "level": "medium"}
    # Search-R1 normalised exact match, for data sources the project never heard of
    assert score_answer("the Lima!", nq[0])
    assert not score_answer("Santiago", nq[0])
    assert score_answer("nbo", hotpot[0])
    river = load_qa_file(HOTPOT / "train.parquet")[3]
    assert score_answer("The Seine", river) and not score_answer("Loire", river)


def test_files_in_the_config_feed_the_sampler_and_evaluation() -> None:
    cfg = load_config(
        None,
        [
            f'data.train_files=["{NQ / "train.parquet"}", "{HOTPOT / "train.parquet"}"]',
            f'data.validation_files=["{NQ / "validation.parquet"}", "{HOTPOT / "validation.parquet"}"]',
        ],
    )
    sets = qa_sets(cfg.data, "train")
    assert [len(v) for v in sets.values()] == [8, 4]
    drawn = QuestionSampler.from_data(cfg.data, "train", seed=0).sample(8)
    # round robin over the two files: four of each
    assert sorted(r["data_source"] for r in drawn) == ["hotpotqa"] * 4 + ["nq"] * 4
    assert len({r["id"] for r in drawn}) == 8
    val = evaluation_questions(cfg.data, "validation", 4)
    assert {r["data_source"] for r in val} == {"nq", "hotpotqa"}
    with pytest.raises(QADataError, match=r"data\.test_files is empty"):
        qa_sets(cfg.data, "test")


def test_config_checks_qa_files_at_load() -> None:
    with pytest.raises(
        ConfigError,
        match=r"data\.train_files: .*qa\.csv: a QA file must end in \.jsonl or \.parquet",
    ):
        load_config(None, ['data.train_files=["qa.csv"]'])
    with pytest.raises(ConfigError, match=r"data\.validation_files: required"):
        load_config(None, ['data.train_files=["qa.parquet"]'])
    cfg = load_config(None, ['data.train_files=["qa.parquet"]', "run.eval_questions=0"])
    assert cfg.data.uses_files
    with pytest.raises(ConfigError, match="need train_files"):
        load_config(None, ['data.validation_files=["v.jsonl"]'])


def test_verl_parquet_answers_from_reward_model(tmp_path: Path) -> None:
    # Search-R1 / verl processed rows that keep the answers only in reward_model
    rows = [
        {
            "question": "who discovered polonium",
            "data_source": "nq",
            "reward_model": {"style": "rule", "ground_truth": {"target": ["Marie Curie"]}},
        }
    ]
    path = tmp_path / "verl.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    (rec,) = load_qa_file(path)
    assert rec["golden_answers"] == ["Marie Curie"]
    assert rec["id"] == "verl-0"


def test_multiple_choice_options_letters_and_prompt(tmp_path: Path) -> None:
    path = _jsonl(
        tmp_path / "mc.jsonl",
        [
            # list options, golden as a 0-based index; the question does not show them
            {
                "question": "Which gene is mutated in cystic fibrosis?",
                "golden_answers": [4],
                "data_source": "medqa",
                "options": ["HTT", "FBN1", "BRCA1", "TP53", "CFTR"],
            },
            # letter -> text in metadata, golden as the option text
            {
                "question": "Pick the antibiotic.",
                "golden_answers": ["Amoxicillin"],
                "data_source": "medqa",
                "metadata": {"options": {"A": "Metformin", "B": "Amoxicillin"}},
            },
        ],
    )
    first, second = load_qa_file(path)
    assert first["golden_answers"] == ["E"]
    assert first["metadata"]["options"]["E"] == "CFTR"
    assert first["question"].endswith("\nD. TP53\nE. CFTR")
    assert user_message(first).endswith(MULTIPLE_CHOICE_SUFFIX)
    assert score_answer("E", first) and score_answer("CFTR", first)
    assert not score_answer("A", first)
    assert second["golden_answers"] == ["B"]
    assert score_answer("(b)", second) and not score_answer("Metformin", second)


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"question": "q", "golden_answers": ["a"], "data_source": "nq"}, "{not json"], "line 2: not JSON"),
        ([{"question": "q", "data_source": "nq"}], "line 1: field 'golden_answers' is missing"),
        ([{"question": "q", "golden_answers": "a", "data_source": "nq"}], "line 1: field 'golden_answers': expected a list"),
        ([{"question": "q", "golden_answers": [], "data_source": "nq"}], "field 'golden_answers' is empty"),
        ([{"question": "q", "golden_answers": [""], "data_source": "nq"}], "every answer must be non-empty text"),
        ([{"question": " ", "golden_answers": ["a"], "data_source": "nq"}], "line 1: field 'question'"),
        ([{"question": "q", "golden_answers": ["a"]}], "line 1: field 'data_source'"),
        ([[1, 2]], "line 1: expected a JSON object"),
        ([{"question": "q", "golden_answers": ["Z"], "data_source": "mc", "options": ["x", "y"]}], "'Z' is not an option letter"),
        ([{"question": "q", "golden_answers": ["A"], "data_source": "mc", "options": ["x"]}], "field 'options': needs at least 2"),
        ([{"question": "q", "golden_answers": ["a"], "data_source": "nq", "id": 1}, {"question": "q", "golden_answers": ["a"], "data_source": "nq", "id": "1"}], "line 2: field 'id': '1' repeats"),
    ],
)  # fmt: skip
def test_malformed_jsonl_names_file_line_and_field(
    tmp_path: Path, rows: list, message: str
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    with pytest.raises(QADataError, match=f"^{path}: ") as err:
        load_qa_file(path)
    assert message in str(err.value)


def test_malformed_parquet_names_row_and_field(tmp_path: Path) -> None:
    path = tmp_path / "bad.parquet"
    rows = [
        {"question": "q0", "golden_answers": ["a"], "data_source": "nq"},
        {"question": "q1", "golden_answers": None, "data_source": "nq"},
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(QADataError, match=rf"^{path}: row 1: field 'golden_answers' is missing"):
        load_qa_file(path)
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(QADataError, match="not a readable Parquet file"):
        load_qa_file(tmp_path / "junk.parquet")


def test_missing_empty_and_unsupported_files(tmp_path: Path) -> None:
    with pytest.raises(QADataError, match="does not exist"):
        load_qa_file(tmp_path / "none.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(QADataError, match="holds no QA records"):
        load_qa_file(tmp_path / "empty.jsonl")
    with pytest.raises(QADataError, match="unsupported QA file type"):
        load_qa_file(tmp_path / "qa.csv")
