"""``stppo eval`` modes over a real retrieval server (BM25 on the fixture corpus).

1. Known outputs: a scripted policy behind a real :class:`RolloutWorker` (real HTTP
   retrieval), all three modes on the fixture QA set; scores and the passages the RAG
   prompt received are checked against the fixture's known BM25 ranking.
2. The CLI end to end on the tiny random Llama: ``stppo eval --mode all`` writes one score
   per (mode, set) with the right counts.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from scripted_engine import ScriptedEngine
from transformers import AutoTokenizer

from actors.config import RolloutConfig
from actors.hardware import FORCE_ENV
from actors.rollout import RolloutWorker
from services.env import PROJECT_ROOT
from services.evaluate import evaluate_records, score_set
from services.records import recount
from services.sampler import read_qa_split

pytestmark = pytest.mark.integration

FIXTURE_QA = PROJECT_ROOT / "tests" / "fixtures" / "qa"
NARITA = "What is the IATA code of Narita International Airport?"
CF = "Which gene is mutated in cystic fibrosis?"


def test_three_modes_score_known_outputs_over_real_retrieval(model_dir, retrieval_server_url):
    tok = AutoTokenizer.from_pretrained(model_dir)
    records = read_qa_split(FIXTURE_QA, "single_hop", "validation")
    assert [r["question"] for r in records] == [NARITA, CF]
    cfg = RolloutConfig(max_turns=2, max_new_tokens_per_turn=48, max_information_tokens=200)
    scripts = {
        # agent: search, then answer; right for Narita, wrong for CF
        "agent": {
            NARITA: ["<search> Narita International Airport </search>", "<answer> NRT </answer>"],
            CF: ["<search> cystic fibrosis gene </search>", "<answer> BRCA1 </answer>"],
        },
        # closed book: one wrong answer, one malformed
        "closed_book": {NARITA: ["<answer> HND </answer>"], CF: ["I do not know."]},
        # rag: both right
        "rag": {NARITA: ["<answer> nrt </answer>"], CF: ["<answer> CFTR </answer>"]},
    }
    worker = RolloutWorker(
        "unused", cfg, retrieval_server_url, engine=ScriptedEngine(tok, scripts["agent"])
    )
    scores = {}
    engines = {}
    for mode, script in scripts.items():
        engines[mode] = worker.engine = ScriptedEngine(tok, script)
        scores[mode] = score_set("single_hop", evaluate_records(worker, records, 16, mode), mode)
    worker.close()

    # success: agent 1/2, closed book 0/2, rag 2/2
    assert [scores[m].success_rate for m in ("agent", "closed_book", "rag")] == [0.5, 0.0, 1.0]
    assert [scores[m].searches_mean for m in ("agent", "closed_book", "rag")] == [1.0, 0.0, 1.0]
    assert [scores[m].turns_mean for m in ("agent", "closed_book", "rag")] == [2.0, 1.0, 1.0]
    assert scores["closed_book"].malformed_rate == 0.5
    assert all(s.retrieval_failed == 0 for s in scores.values())

    # the RAG prompt got the real server's top-3 for the raw question: the Narita passage
    # (id 18, the only one naming Narita) and both cystic fibrosis passages (20, 21)
    rag_prompts = [tok.decode(p) for p in engines["rag"].calls[0]]
    assert (
        "Doc 1 (Title: Narita International Airport) Narita International Airport (IATA: NRT)"
        in rag_prompts[0]
    )
    assert "(Title: Cystic fibrosis)" in rag_prompts[1] and "(Title: CFTR)" in rag_prompts[1]
    assert [p.count("(Title: ") for p in rag_prompts] == [3, 3]  # top-k = 3 (client default)
    # the closed-book prompt has no passages at all
    assert "Doc 1" not in tok.decode(engines["closed_book"].calls[0][0])


def test_cli_eval_all_modes_on_tiny_llama(
    tmp_path: Path, tiny_llama_dir: Path, retrieval_server_url
):
    out = tmp_path / "eval.json"
    overrides = {
        "model.path": str(tiny_llama_dir),
        "data.qa_dir": str(FIXTURE_QA),
        "data.datasets": ["single_hop"],
        "retrieval.url": retrieval_server_url,
        "rollout.max_turns": 2,
        "rollout.max_new_tokens_per_turn": 8,
        "rollout.max_response_tokens": 128,
        "rollout.max_information_tokens": 48,
        "run.output_dir": str(tmp_path / "runs"),
    }
    cmd = [str(PROJECT_ROOT / ".venv" / "bin" / "stppo"), "eval", "--mode", "all",
           "--limit", "2", "--out", str(out)]  # fmt: skip
    cmd += [f"{k}={json.dumps(v)}" for k, v in overrides.items()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=PROJECT_ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["modes"] == ["closed_book", "rag", "agent"]
    assert report["policy"] == str(tiny_llama_dir)
    assert report["answer_normalization"] == "folded"  # the default, named in the report
    rows = {s["mode"]: s for s in report["scores"]}
    assert [s["mode"] for s in report["scores"]] == ["closed_book", "rag", "agent"]
    assert all(s["data_source"] == "single_hop" and s["num_questions"] == 2 for s in rows.values())
    # one-turn baselines: one retrieval per question for rag, none closed book
    assert (rows["closed_book"]["searches_mean"], rows["closed_book"]["turns_mean"]) == (0.0, 1.0)
    assert (rows["rag"]["searches_mean"], rows["rag"]["turns_mean"]) == (1.0, 1.0)
    # random 2-layer weights do not write "<answer>...</answer>" in 8 tokens: all malformed
    assert all(s["malformed_rate"] == 1.0 and s["success_rate"] == 0.0 for s in rows.values())
    assert "closed_book" in proc.stdout and "rag" in proc.stdout and "agent" in proc.stdout
    md = out.with_suffix(".md").read_text().splitlines()
    assert md[:3] == [
        "| set | n | closed_book | rag | agent |",
        "|---|---|---|---|---|",
        "| single_hop | 2 | 0.000 | 0.000 | 0.000 |",
    ]
    assert md[5:7] == [
        "|---|---|---|---|---|---|---|---|",
        "| single_hop | closed_book | 2 | 0.000 | 0.00 | 1.00 | 1.00 | 0 |",
    ]
    # one record per question and mode, recounting to the report's rows
    records = [json.loads(line) for line in (tmp_path / "eval_samples.jsonl").open()]
    assert [r["mode"] for r in records] == ["closed_book"] * 2 + ["rag"] * 2 + ["agent"] * 2
    for mode, row in rows.items():
        mine = [r for r in records if r["mode"] == mode]
        assert recount(mine)["success_rate"] == row["success_rate"]
        assert recount(mine)["malformed_rate"] == row["malformed_rate"]
        assert all(r["tag"] == "eval_validation" and r["malformed_reason"] for r in mine)
    rag = [r for r in records if r["mode"] == "rag"]
    assert all(r["turns"][0]["search_query"] == r["question"] for r in rag)
    assert all(len(r["turns"][0]["passages"]) == 3 for r in rag)  # top-3 by default
    assert all(r["turns"][0]["passages"] == [] for r in records if r["mode"] == "closed_book")


@pytest.mark.cpu_isa
@pytest.mark.parametrize(("native_bf16", "auto_dtype"), [("1", "bfloat16"), ("0", "float32")])
def test_rollout_dtype_selects_the_engine_dtype(
    tiny_llama_dir: Path, monkeypatch, native_bf16, auto_dtype
):
    """An explicit dtype is what the engine gets; ``auto`` (the default) follows the CPU:
    bf16 with native bf16 matmuls, fp32 where bf16 would be emulated. The detection is
    forced both ways (``STPPO_CPU_BF16``), so both branches run on every CPU."""
    import torch

    from actors.engines.build import build_engine

    monkeypatch.setenv(FORCE_ENV, native_bf16)
    for dtype, want in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        assert build_engine(str(tiny_llama_dir), RolloutConfig(dtype=dtype), 0).model.dtype == want
    auto = build_engine(str(tiny_llama_dir), RolloutConfig(), 0)
    assert auto.model.dtype == getattr(torch, auto_dtype)
