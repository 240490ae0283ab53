"""The stability benchmark's pieces without Ray: the synthetic task's records and QA sets,
the ``sync.fixed_lag`` config check, the per-cell statistics and the seed-major run order."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from services.config import ConfigError, load_config
from services.experiment import CollapseRule, ExperimentSpec, plan_runs
from services.stability import cell_summaries, run_stats, welch_p
from services.synthetic_task import make_records, qa_records


def test_records_are_seeded_unique_and_link_elsewhere():
    a, b = make_records(200, seed=3), make_records(200, seed=3)
    assert a == b and a != make_records(200, seed=4)
    ids = [r.rid for r in a]
    assert len(set(ids)) == 200
    assert all(r.link != r.rid and r.link in set(ids) for r in a)
    assert all(len(r.code) == 3 and r.code.isdigit() for r in a)


def test_qa_answers_follow_the_corpus_and_splits_are_disjoint():
    records = make_records(100, seed=0)
    by_id = {r.rid: r for r in records}
    qa = qa_records(records, seed=0)
    for name in ("single_hop", "multi_hop"):
        assert sum(len(v) for v in qa[name].values()) == 100
    seen: dict[str, set[str]] = {}
    for split, rows in qa["multi_hop"].items():
        seen[split] = {r["metadata"]["entity"] for r in rows}
        for row in rows:
            first, second = row["metadata"]["search_queries"]
            assert by_id[first].link == second
            assert row["golden_answers"] == [by_id[second].code]
    for row in qa["single_hop"]["train"]:
        rid = row["metadata"]["entity"]
        assert row["golden_answers"] == [by_id[rid].code] and rid in row["question"]
    assert not seen["train"] & seen["validation"] and not seen["train"] & seen["test"]


def test_fixed_lag_needs_sync_every_step():
    load_config(None, ["sync.fixed_lag=true", "buffer.max_staleness=4"])
    with pytest.raises(ConfigError, match=r"sync: .*fixed_lag needs every_k_steps = 1"):
        load_config(None, ["sync.fixed_lag=true", "buffer.max_staleness=4", "sync.every_k_steps=2"])


def test_seed_major_order_covers_every_point_first():
    grid = {"algorithm.variant": ["ppo", "st_ppo"], "buffer.max_staleness": [0, 2]}
    spec = ExperimentSpec(grid=grid, seeds=[0, 1], seed_major=True)
    runs = plan_runs(spec, "x", Path("/tmp/none"))
    assert [r.seed for r in runs] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert len({r.name for r in runs}) == 8
    default = plan_runs(ExperimentSpec(grid=grid, seeds=[0, 1]), "x", Path("/tmp/none"))
    assert [r.seed for r in default] == [0, 1, 0, 1, 0, 1, 0, 1]


def test_welch_p():
    assert welch_p([0.1, 0.2, 0.3], [0.1, 0.2, 0.3]) == pytest.approx(1.0)
    assert welch_p([0.0, 0.01, 0.02], [0.9, 0.91, 0.92]) < 1e-4
    assert math.isnan(welch_p([0.1], [0.2, 0.3]))


def _fake_run(root: Path, name: str, variant: str, lag: int, success: list[float]) -> Path:
    run = root / name
    run.mkdir(parents=True)
    cfg = {"algorithm": {"variant": variant}, "buffer": {"max_staleness": lag}, "run": {}}
    (run / "config.json").write_text(json.dumps(cfg))
    steps = [{"step": i + 1, "success_rate": s, "reward_mean": s, "malformed_rate": 0.0,
              "clip_ratio": 0.1, "approx_kl": 0.01, "token_log_ratio_abs_max": 0.5 + i,
              "clip_bias_scale": 0.9} for i, s in enumerate(success)]  # fmt: skip
    (run / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    consumed = [{"step": i + 1, "staleness": [min(i, lag)] * 2} for i in range(len(success))]
    consumed[-1]["staleness"][0] = lag + 1  # one trajectory off the promised lag
    (run / "consumed.jsonl").write_text("".join(json.dumps(c) + "\n" for c in consumed))
    (run / "eval.jsonl").write_text(json.dumps({"tag": "end", "success_rate": success[-1]}) + "\n")
    return run


def test_cell_summaries(tmp_path: Path):
    rule = CollapseRule(drop=0.3, last_k=2, window=1)
    stable = [0.2, 0.5, 0.6, 0.6, 0.6]
    collapsed = [0.2, 0.8, 0.8, 0.3, 0.2]
    runs = [
        run_stats(_fake_run(tmp_path, "a0", "ppo", 2, stable), rule, final_window=2),
        run_stats(_fake_run(tmp_path, "a1", "ppo", 2, [0.2, 0.4, 0.4, 0.4, 0.4]), rule, 2),
        run_stats(_fake_run(tmp_path, "b0", "st_ppo", 2, collapsed), rule, final_window=2),
    ]
    cells = {c.variant: c for c in cell_summaries(runs)}
    ppo, st = cells["ppo"], cells["st_ppo"]
    assert ppo.runs == 2 and ppo.final_success_mean == pytest.approx(0.5)
    assert ppo.final_success_sd == pytest.approx(math.sqrt(0.02))
    assert (ppo.collapsed, ppo.judged, st.collapsed, st.judged) == (0, 2, 1, 1)
    assert st.final_success_mean == pytest.approx(0.25) and math.isnan(st.p_vs_ppo)
    assert ppo.token_log_ratio_max == pytest.approx(4.5)
    assert ppo.exact_staleness_share == pytest.approx(9 / 10)
    assert st.clip_bias_scale_min == pytest.approx(0.9)


def test_tokenizer_ids_and_codes_are_single_tokens_and_round_trip():
    from services.synthetic_task import SPECIAL_TOKENS, tokenizer_texts, train_tokenizer

    records = make_records(40, seed=1)
    whole = [r.rid for r in records] + [f"{c:03d}" for c in range(1000)]
    tok = train_tokenizer(tokenizer_texts(records, qa_records(records, 1)), 400, whole)
    assert [tok.convert_ids_to_tokens(i) for i in range(3)] == list(SPECIAL_TOKENS)
    r = records[0]
    text = f"<search> {r.rid} </search>\n{r.text}"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    pieces = tok.convert_ids_to_tokens(ids)
    assert pieces.count(r.rid) == 2 and r.code in pieces and r.link in pieces
