"""Eval scoring on fixtures with known answers."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from services.evaluate import (
    SetScore,
    print_eval_tables,
    resolve_policy_dir,
    score_set,
    summarize_eval,
)


def traj(
    source: str, success: bool, searches: int = 1, turns: int = 2, malformed=None, failed=False
):
    return SimpleNamespace(
        data_source=source, success=success, num_searches=searches, num_turns=turns,
        malformed_reason=malformed, retrieval_failed=failed,
    )  # fmt: skip


def test_score_set_hand_computed():
    ts = [
        traj("single_hop", True, searches=1, turns=2),
        traj("single_hop", False, searches=0, turns=1, malformed="no_answer"),
        traj("single_hop", True, searches=2, turns=3),
        traj("single_hop", False, searches=1, turns=2, failed=True),
    ]
    s = score_set("single_hop", ts)
    # success 2/4; searches (1+0+2+1)/4 = 1.0; turns (2+1+3+2)/4 = 2.0; malformed 1/4
    assert (s.num_questions, s.success_rate, s.searches_mean, s.turns_mean) == (4, 0.5, 1.0, 2.0)
    assert (s.malformed_rate, s.retrieval_failed) == (0.25, 1)


def test_summarize_splits_by_set():
    ts = [traj("single_hop", True), traj("medical_mc", False), traj("medical_mc", True)]
    summary = summarize_eval(ts)
    assert summary["success_rate"] == pytest.approx(2 / 3)
    assert summary["success_rate/single_hop"] == 1.0
    assert summary["success_rate/medical_mc"] == 0.5
    assert summarize_eval([]) == {"num_questions": 0}
    with pytest.raises(ValueError, match="no trajectories"):
        score_set("x", [])


def test_resolve_policy_dir(tmp_path: Path):
    def hf_folder(path: Path) -> Path:
        path.mkdir(parents=True)
        (path / "config.json").write_text("{}")
        (path / "model.safetensors").write_bytes(b"")
        return path

    base = tmp_path / "base"
    assert resolve_policy_dir(None, base) == base
    hf = hf_folder(tmp_path / "hf")
    assert resolve_policy_dir(hf, base) == hf
    # the driver's checkpoint layout: config.json is the *run* config, weights in hf_policy/
    ckpt = tmp_path / "step_000004"
    hf_folder(ckpt / "hf_policy")
    (ckpt / "config.json").write_text('{"run": {}}')
    (ckpt / "driver_state.json").write_text("{}")
    assert resolve_policy_dir(ckpt, base) == ckpt / "hf_policy"
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    (config_only / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="neither an HF model folder"):
        resolve_policy_dir(config_only, base)
    with pytest.raises(FileNotFoundError, match="neither an HF model folder"):
        resolve_policy_dir(tmp_path / "empty", base)


def test_eval_tables_are_not_wrapped_when_piped(capsys):
    """Piped to a log (not a TTY), Rich would wrap at 80 columns and split each row over
    several lines; every set's row must stay on one line with all its cells."""
    scores = [
        SetScore(name, 8, rate, 1.25, 2.0, 0.125, 0, mode)
        for name in ("single_hop", "multi_hop", "medical_mc")
        for mode, rate in (("closed_book", 0.0), ("rag", 0.375), ("agent", 0.875))
    ]
    print_eval_tables(scores, "runs/some/rather/long/checkpoint/path/hf_policy on validation")
    lines = capsys.readouterr().out.splitlines()
    for name in ("single_hop", "multi_hop", "medical_mc"):
        (summary_row,) = [ln for ln in lines if name in ln and "1.25" not in ln]
        assert [c for c in summary_row.split() if "." in c] == ["0.000", "0.375", "0.875"]
        detail_rows = [ln for ln in lines if name in ln and "1.25" in ln]
        assert len(detail_rows) == 3 and all("0.12" in ln for ln in detail_rows)
