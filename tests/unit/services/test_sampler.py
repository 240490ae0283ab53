from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest

from services.config import DataSection
from services.sampler import QuestionSampler, entity_key, read_qa_split, warm_start_split


def recs(name: str, n: int) -> list[dict]:
    return [{"id": f"{name}-{i}", "question": f"q{i}", "golden_answers": ["a"]} for i in range(n)]


def test_round_robin_over_sets_and_full_epoch_coverage():
    s = QuestionSampler({"a": recs("a", 3), "b": recs("b", 5)}, seed=7)
    drawn = s.sample(6)
    assert [r["id"][0] for r in drawn] == ["a", "b", "a", "b", "a", "b"]
    assert sorted(r["id"] for r in drawn if r["id"][0] == "a") == [
        "a-0",
        "a-1",
        "a-2",
    ]  # one epoch of a


def test_resume_continues_the_same_sequence():
    full = QuestionSampler({"a": recs("a", 4), "b": recs("b", 3)}, seed=3).sample(20)
    first = QuestionSampler({"a": recs("a", 4), "b": recs("b", 3)}, seed=3)
    head = first.sample(9)
    resumed = QuestionSampler(
        {"a": recs("a", 4), "b": recs("b", 3)}, seed=3, num_drawn=first.num_drawn
    )
    assert [r["id"] for r in head + resumed.sample(11)] == [r["id"] for r in full]


def test_seed_changes_order():
    a = [r["id"] for r in QuestionSampler({"a": recs("a", 50)}, seed=1).sample(50)]
    b = [r["id"] for r in QuestionSampler({"a": recs("a", 50)}, seed=2).sample(50)]
    assert a != b and sorted(a) == sorted(b)


def test_read_split_errors_name_the_file(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="stppo prepare"):
        read_qa_split(tmp_path, "single_hop", "train")
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "train.jsonl").write_text(json.dumps({"question": "q"}) + "\n")
    with pytest.raises(ValueError, match=r"train\.jsonl:1"):
        read_qa_split(tmp_path, "x", "train")


def entity_recs(name: str, n: int) -> list[dict]:
    """Two questions per entity (as the synthetic task's one- and two-hop questions)."""
    return [
        {"id": f"{name}-{i}-{k}", "question": f"q{i}{k}", "golden_answers": ["a"],
         "metadata": {"entity": f"E{i}"}}
        for i in range(n) for k in (0, 1)
    ]  # fmt: skip


def test_warm_start_split_is_disjoint_by_entity_and_independent_of_order():
    records = entity_recs("a", 200)
    warm, rl = warm_start_split({"a": records}, 0.5)
    warm_entities = {r["metadata"]["entity"] for r in warm["a"]}
    rl_entities = {r["metadata"]["entity"] for r in rl["a"]}
    assert not warm_entities & rl_entities  # both questions of an entity on one side
    assert len(warm["a"]) + len(rl["a"]) == 400
    assert 0.35 < len(warm["a"]) / 400 < 0.65  # a hash, not a count: near the share
    shuffled = list(reversed(records))
    warm2, _ = warm_start_split({"a": shuffled}, 0.5)
    assert {r["id"] for r in warm2["a"]} == {r["id"] for r in warm["a"]}
    # a larger share keeps everything the smaller one kept (monotone in the share)
    warm3, _ = warm_start_split({"a": records}, 0.8)
    assert {r["id"] for r in warm["a"]} <= {r["id"] for r in warm3["a"]}


def test_warm_start_split_falls_back_to_the_id_and_names_an_empty_side():
    warm, rl = warm_start_split({"a": recs("a", 100)}, 0.3)
    assert warm["a"] and rl["a"]
    one = recs("b", 1)
    position = zlib.crc32(entity_key(one[0]).encode()) / 2**32  # its place in [0, 1)
    with pytest.raises(ValueError, match=r"QA set 'b' with 0 warm-start and 1 RL"):
        warm_start_split({"b": one}, position / 2)  # below it: the record goes to RL


def test_rl_sampler_never_draws_a_warm_start_question(tmp_path: Path):
    qa = tmp_path / "qa"
    (qa / "single_hop").mkdir(parents=True)
    with (qa / "single_hop" / "train.jsonl").open("w") as f:
        for r in entity_recs("s", 60):
            f.write(json.dumps(r) + "\n")
    data = DataSection(qa_dir=qa, datasets=["single_hop"], warm_start_share=0.5)
    rl = QuestionSampler.from_data(data, "train", seed=0, side="rl").sample(300)
    warm = QuestionSampler.from_data(data, "train", seed=1, side="warm_start").sample(300)
    assert not {r["id"] for r in rl} & {r["id"] for r in warm}
    whole = QuestionSampler.from_data(data.model_copy(update={"warm_start_share": 0.0}),
                                      "train", seed=0, side="rl").sample(120)  # fmt: skip
    assert len({r["id"] for r in whole}) == 120  # share 0: the whole split
