"""experiments.archive: a grid's finished runs and warm start, kept with the source and
written back on another machine byte for byte (records and the times that date a run)."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest

from experiments import archive as run_archive
from experiments.archive import ArchiveMismatchError
from experiments.arena import read_run
from experiments.collapse import CollapseRule
from services import run_records

DIGEST = "ab" * 32


def make_run(run_dir: Path, finished: bool = True, seed: int = 0) -> Path:
    """A run directory with the records the summaries read (two steps, start and end
    evaluations when ``finished``)."""
    run_dir.mkdir(parents=True)
    config = {"run": {"label": "ppo_tis", "seed": seed, "num_steps": 2}, "buffer": {"max_staleness": 4},
              "algorithm": {"variant": "ppo"}}  # fmt: skip
    (run_dir / "config.json").write_text(json.dumps(config))
    (run_dir / "run.json").write_text(json.dumps({"run_id": "r1", "attempts": []}))
    steps = [{"run_id": "r1", "step": i, "variant": "ppo", "success_rate": 0.1 * i, "step_s": 1.0 + i}
             for i in (1, 2)]  # fmt: skip
    (run_dir / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    evals = [{"run_id": "r1", "tag": "start", "success_rate": 0.2}]
    if finished:
        evals.append({"run_id": "r1", "tag": "end", "success_rate": 0.3, "policy_version": 2,
                      "engine_policy_version_min": 2, "engine_policy_version_max": 2})  # fmt: skip
    (run_dir / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    os.utime(run_dir / "config.json", (1_000_000.0, 1_000_000.0))
    os.utime(run_dir / "eval.jsonl", (1_000_300.5, 1_000_300.5))
    return run_dir


def test_a_restored_run_equals_the_original(tmp_path: Path):
    run = make_run(tmp_path / "here" / "method-ppo_tis_seed-0")
    path = run_archive.archive_run(run, tmp_path / "archive", DIGEST)
    assert path == tmp_path / "archive" / "method-ppo_tis_seed-0.json.gz"
    record = run_archive.read_archived_run(path)
    assert record["warm_start_sha256"] == DIGEST and record["machine"]["cpu"]
    assert len(record["machine"]["commit"].rstrip("+")) == 40  # this checkout's HEAD

    [restored] = run_archive.restore_runs(
        tmp_path / "archive", [tmp_path / "there" / run.name], DIGEST
    )
    for name in run_archive.RUN_FILES:
        assert (restored / name).read_bytes() == (run / name).read_bytes()
    for name in run_archive.DATED_FILES:
        assert (restored / name).stat().st_mtime == (run / name).stat().st_mtime
    rule = CollapseRule()
    assert read_run(restored, rule) == read_run(run, rule)
    assert read_run(restored, rule).wall_s == pytest.approx(300.5)


def test_archive_bytes_depend_on_the_content_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    a = run_archive.archive_run(make_run(tmp_path / "a" / "r"), tmp_path / "arch_a", DIGEST)
    monkeypatch.setattr(gzip.time, "time", lambda: 2e9)  # archived at another time
    b = run_archive.archive_run(make_run(tmp_path / "b" / "r"), tmp_path / "arch_b", DIGEST)
    assert a.read_bytes() == b.read_bytes()


def test_unfinished_runs_are_not_archived(tmp_path: Path):
    run = make_run(tmp_path / "r", finished=False)
    with pytest.raises(ValueError, match="has not finished"):
        run_archive.archive_run(run, tmp_path / "archive", DIGEST)
    (run / "steps.jsonl").unlink()
    with pytest.raises(ValueError, match=r"lacks steps\.jsonl"):
        run_archive.archive_run(run, tmp_path / "archive", DIGEST)
    assert run_archive.archive_finished(tmp_path / "archive", [run], DIGEST) == 0
    assert not (tmp_path / "archive").exists()


@pytest.mark.parametrize("engine", [(0, 0), (0, 2), None])
def test_a_run_whose_final_evaluation_missed_the_final_policy_is_not_archived(
    tmp_path: Path, engine: tuple[int, int] | None
):
    """The final success must be the final policy's: a run whose end evaluation answered
    with older weights (engines held behind by ``sync.fixed_lag``; or a record that does
    not say, from before the driver pushed the final policy) is refused, and so is an
    archive file of format 1, which holds such runs."""
    run = make_run(tmp_path / "method-ppo_tis_seed-0")
    evals = run_records.read_records(run / "eval.jsonl")
    for key in ("engine_policy_version_min", "engine_policy_version_max"):
        evals[-1].pop(key)
    if engine is None:  # a record that says nothing of the versions
        evals[-1].pop("policy_version")
    else:
        evals[-1]["engine_policy_version_min"], evals[-1]["engine_policy_version_max"] = engine
    (run / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    with pytest.raises(ValueError, match="final evaluation answered with policy versions"):
        run_archive.archive_run(run, tmp_path / "archive", DIGEST)
    assert not (tmp_path / "archive").exists()


def test_an_archive_file_of_format_1_is_refused_with_the_reason(tmp_path: Path):
    path = run_archive.archive_run(make_run(tmp_path / "run"), tmp_path / "archive", DIGEST)
    record = run_archive.read_archived_run(path)
    path.write_bytes(gzip.compress(json.dumps(record | {"format": 1}).encode()))
    with pytest.raises(ValueError, match="lagged weights, not the final policy"):
        run_archive.read_archived_run(path)


def test_a_run_the_time_cap_stopped_early_is_neither_archived_nor_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture
):
    """``max_run_s`` lets a run on a loaded machine stop early and still evaluate: fewer
    updates, another experiment. It is not archived, an archived complete run replaces it,
    and the grid's resume runs it again (red if any of them counts it as finished)."""
    from types import SimpleNamespace

    from experiments.grid import _unfinished

    capped = make_run(tmp_path / "out" / "r")
    steps = run_records.read_records(capped / "steps.jsonl")
    (capped / "steps.jsonl").write_text(json.dumps(steps[0]) + "\n")  # 1 of its 2 steps
    assert run_archive.is_finished(capped) and not run_archive.is_complete(capped)
    with pytest.raises(ValueError, match="stopped at 1 of its 2 learner steps"):
        run_archive.archive_run(capped, tmp_path / "archive", DIGEST)
    assert run_archive.archive_finished(tmp_path / "archive", [capped], DIGEST) == 0

    fresh = tmp_path / "out" / "r2"  # a run after it: the grid goes on labelling and planning
    planned = [SimpleNamespace(name=n, config=SimpleNamespace(run_dir=d))
               for n, d in (("r", capped), ("r2", fresh))]  # fmt: skip
    todo = _unfinished(planned, "g", True, set())
    assert [run for _, run in todo] == planned
    assert todo[1][0] == "[experiment g] 2/2 r2"
    assert "stopped by the time cap at step 1 of 2: runs again" in capsys.readouterr().out
    assert not (capped / "steps.jsonl").exists()  # cleared: it restarts

    make_run(tmp_path / "capped-again" / "r")
    (tmp_path / "capped-again" / "r" / "steps.jsonl").write_text(json.dumps(steps[0]) + "\n")
    run_archive.archive_run(make_run(tmp_path / "src" / "r"), tmp_path / "archive", DIGEST)
    [restored] = run_archive.restore_runs(
        tmp_path / "archive", [tmp_path / "capped-again" / "r"], DIGEST
    )
    assert run_archive.is_complete(restored)
    # an archive file holding a capped run (made before archive_run refused them) is named
    path = run_archive.run_archive_path(tmp_path / "archive", "r")
    record = run_archive.read_archived_run(path)
    record["files"]["steps.jsonl"] = json.dumps(steps[0]) + "\n"
    path.write_bytes(gzip.compress(json.dumps(record).encode()))
    with pytest.raises(ValueError, match="time cap stopped at 1 of its 2 learner steps"):
        run_archive.read_archived_run(path)


def test_the_first_archived_run_is_kept(tmp_path: Path):
    first = make_run(tmp_path / "a" / "r", seed=0)
    second = make_run(tmp_path / "b" / "r", seed=7)
    path = run_archive.archive_run(first, tmp_path / "archive", DIGEST)
    before = path.read_bytes()
    run_archive.archive_run(second, tmp_path / "archive", DIGEST)
    assert path.read_bytes() == before


def test_restore_replaces_a_partial_run_and_keeps_a_finished_one(tmp_path: Path):
    archive = tmp_path / "archive"
    run_archive.archive_run(make_run(tmp_path / "src" / "partial"), archive, DIGEST)
    run_archive.archive_run(make_run(tmp_path / "src" / "done", seed=1), archive, DIGEST)
    partial = make_run(tmp_path / "out" / "partial", finished=False)
    (partial / "consumed.jsonl").write_text('{"step": 1}\n')  # a record of the partial run
    (partial / "checkpoints" / "step_000001").mkdir(parents=True)  # and its checkpoint
    done = make_run(tmp_path / "out" / "done", seed=5)  # finished here: this one stays

    restored = run_archive.restore_runs(archive, [partial, done, tmp_path / "out" / "new"], DIGEST)

    assert restored == [partial]
    assert not (partial / "consumed.jsonl").exists() and not (partial / "checkpoints").exists()
    assert run_archive.is_finished(partial)
    assert json.loads((done / "config.json").read_text())["run"]["seed"] == 5


def test_runs_from_another_warm_start_are_refused(tmp_path: Path):
    run_archive.archive_run(make_run(tmp_path / "src" / "r"), tmp_path / "archive", DIGEST)
    with pytest.raises(ArchiveMismatchError, match="started from warm start"):
        run_archive.restore_runs(tmp_path / "archive", [tmp_path / "out" / "r"], "cd" * 32)


def make_policy(warm_dir: Path, weights: bytes) -> Path:
    warm_dir.mkdir(parents=True)
    (warm_dir / "config.json").write_text('{"run": {}}')
    (warm_dir / "sft.jsonl").write_text('{"epoch": 1, "loss": 0.4}\n')
    policy = warm_dir / "checkpoints" / "step_000000" / "hf_policy"
    policy.mkdir(parents=True)
    (policy / run_archive.POLICY_WEIGHTS).write_bytes(weights)
    (policy / "tokenizer.json").write_text("{}")
    (policy / "config.json").write_text('{"model_type": "llama"}')
    return policy


def test_the_warm_start_round_trips_and_is_checked(tmp_path: Path):
    archive = tmp_path / "archive"
    policy = make_policy(tmp_path / "a" / "warm_start", b"\x00weights\x01" * 100)
    path = run_archive.archive_warm_start(policy.parents[2], policy, archive)
    assert run_archive.archived_warm_start_digest(archive) == run_archive.policy_digest(policy)
    before = path.read_bytes()
    run_archive.archive_warm_start(policy.parents[2], policy, archive)  # archived already
    assert path.read_bytes() == before

    warm_b = tmp_path / "b" / "warm_start"
    policy_b = warm_b / "checkpoints" / "step_000000" / "hf_policy"
    assert run_archive.restore_warm_start(archive, warm_b, policy_b)
    for name in ("config.json", "tokenizer.json", run_archive.POLICY_WEIGHTS):
        assert (policy_b / name).read_bytes() == (policy / name).read_bytes()
    assert (warm_b / "sft.jsonl").read_text() == (policy.parents[2] / "sft.jsonl").read_text()
    assert not run_archive.restore_warm_start(archive, warm_b, policy_b)  # complete: kept

    # a half-written policy (no config.json) is written again
    (policy_b / "config.json").unlink()
    (policy_b / run_archive.POLICY_WEIGHTS).write_bytes(b"torn")
    assert run_archive.restore_warm_start(archive, warm_b, policy_b)
    assert run_archive.policy_digest(policy_b) == run_archive.policy_digest(policy)

    other = make_policy(tmp_path / "c" / "warm_start", b"other weights")
    with pytest.raises(ArchiveMismatchError, match="one grid, one warm start"):
        run_archive.restore_warm_start(archive, other.parents[2], other)
    with pytest.raises(ArchiveMismatchError, match="one grid, one warm start"):
        run_archive.archive_warm_start(other.parents[2], other, archive)


def test_no_archive_restores_nothing(tmp_path: Path):
    assert run_archive.archived_warm_start_digest(tmp_path / "none") is None
    assert not run_archive.restore_warm_start(tmp_path / "none", tmp_path / "w", tmp_path / "p")
    assert run_archive.restore_runs(tmp_path / "none", [tmp_path / "r"], None) == []


def test_a_damaged_archive_file_is_named(tmp_path: Path):
    (tmp_path / "r.json.gz").write_bytes(b"not gzip")
    with pytest.raises(ValueError, match=r"r\.json\.gz is not an archived run"):
        run_archive.read_archived_run(tmp_path / "r.json.gz")


def test_dry_run_counts_the_archived_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from typer.testing import CliRunner

    from services.cli import app

    monkeypatch.chdir(tmp_path)  # the arena's archive_dir is relative to the working dir
    archive = tmp_path / "experiments" / "runs" / "arena"
    name = "method-gspo_max_staleness-4_seed-0"
    run_archive.archive_run(make_run(tmp_path / "runs" / name), archive, DIGEST)
    result = CliRunner().invoke(app, ["experiment", "arena", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "archive experiments/runs/arena: 1 of these 160 runs archived" in result.output
    result = CliRunner().invoke(app, ["experiment", "arena", "--dry-run", "--no-archive"])
    assert result.exit_code == 0 and "archive " not in result.output


def archived_tiny_grid(tmp_path: Path) -> tuple[Path, str]:
    """A one-run grid ``tiny`` (under ``tmp_path/experiments``) whose only run is already in
    its archive (``tmp_path/archive``); returns (the experiments folder, the run's name)."""
    from tiny_experiment import write_experiment

    experiments = tmp_path / "experiments"
    write_experiment(
        experiments,
        "tiny",
        {"seeds": [0], "num_steps": 2, "archive_dir": str(tmp_path / "archive")},
        {"grid": {"method": ["a"], "buffer.max_staleness": [4]},
         "methods.a": {"algorithm.variant": "ppo"}},
    )  # fmt: skip
    name = "method-a_max_staleness-4_seed-0"
    run_archive.archive_run(make_run(tmp_path / "elsewhere" / name), tmp_path / "archive", None)
    return experiments, name


def test_summary_restores_archived_runs_unless_told_not_to(tmp_path: Path):
    from experiments.grid import summarize_experiment

    experiments, name = archived_tiny_grid(tmp_path)

    alone = summarize_experiment("tiny", tmp_path / "out", experiments_dir=experiments,
                                 use_archive=False)  # fmt: skip
    assert alone.summaries == [] and not (tmp_path / "out" / "tiny" / name).exists()
    assert json.loads(alone.summary_json.read_text())["archived"] is None
    restored = summarize_experiment("tiny", tmp_path / "out", experiments_dir=experiments)
    [row] = restored.summaries
    assert (row.run, row.val_success_final, row.num_steps) == (name, 0.3, 2)
    assert json.loads(restored.summary_json.read_text())["archived"]["runs"] == 1


def test_provenance_counts_the_machines_and_days_of_the_named_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    archive = tmp_path / "archive"
    for i, cpu in enumerate(("Xeon", "EPYC", "Xeon")):
        monkeypatch.setattr(run_archive, "_machine", lambda cpu=cpu: {"cpu": cpu})
        run = make_run(tmp_path / f"r{i}")
        os.utime(run / "eval.jsonl", (1_000_000_000 + i * 86_400,) * 2)  # 2001-09-09 01:46 UTC
        run_archive.archive_run(run, archive, DIGEST)
    names = ["r0", "r1", "r2", "not-archived"]
    assert run_archive.provenance(archive, names) == run_archive.Provenance(
        runs=3, cpus={"Xeon": 2, "EPYC": 1}, first_day="2001-09-09", last_day="2001-09-11"
    )
    assert run_archive.provenance(archive, ["r1"]).cpus == {"EPYC": 1}
    assert run_archive.provenance(archive, ["not-archived"]) is None


def test_a_summary_of_a_slice_reads_only_its_runs(tmp_path: Path):
    from tiny_experiment import write_experiment

    from experiments.grid import summarize_experiment

    experiments = tmp_path / "experiments"
    write_experiment(
        experiments,
        "tiny",
        {"seeds": [0, 1], "num_steps": 2, "archive_dir": str(tmp_path / "archive")},
        {"grid": {"method": ["a"], "buffer.max_staleness": [4]},
         "methods.a": {"algorithm.variant": "ppo"}},
    )  # fmt: skip
    for seed in (0, 1):
        name = f"method-a_max_staleness-4_seed-{seed}"
        run = make_run(tmp_path / "elsewhere" / name, seed=seed)
        run_archive.archive_run(run, tmp_path / "archive", None)

    both = summarize_experiment("tiny", tmp_path / "out", experiments_dir=experiments)
    assert [s.seed for s in both.summaries] == [0, 1]
    first = summarize_experiment("tiny", tmp_path / "out", experiments_dir=experiments,
                                 only={"seed": [0]})  # fmt: skip
    assert [s.seed for s in first.summaries] == [0]
    record = json.loads(first.summary_json.read_text())
    assert record["archived"]["runs"] == 1 and record["only"] == {"seed": [0]}


def test_a_fresh_summary_restores_both_stages_of_a_grid_with_more_seeds(tmp_path: Path):
    """The second stage's runs are planned from the first stage's results: a summary into
    an empty output directory restores the first stage, plans the second from it, and must
    restore that too (it once summarised the first stage alone: 160 of the arena's 290)."""
    from tiny_experiment import write_experiment

    from experiments.grid import summarize_experiment

    experiments = tmp_path / "experiments"
    write_experiment(
        experiments,
        "tiny",
        {"seeds": [0, 1], "num_steps": 2, "archive_dir": str(tmp_path / "archive")},
        {"grid": {"method": ["a"], "buffer.max_staleness": [4]},
         "methods.a": {"algorithm.variant": "ppo"}, "more_seeds": {"seeds": [2]}},
    )  # fmt: skip
    for seed in (0, 1, 2):
        name = f"method-a_max_staleness-4_seed-{seed}"
        run = make_run(tmp_path / "elsewhere" / name, seed=seed)
        run_archive.archive_run(run, tmp_path / "archive", None)

    result = summarize_experiment("tiny", tmp_path / "fresh", experiments_dir=experiments)
    assert sorted(s.seed for s in result.summaries) == [0, 1, 2]


def test_a_grid_run_without_the_archive_summarises_without_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """``run_experiment(use_archive=False)``: its summary does not restore the archived runs
    either (they would overwrite the grid's own runs of the same name)."""
    import experiments.grid as grid

    experiments, name = archived_tiny_grid(tmp_path)
    monkeypatch.setattr(grid, "_run_all", lambda *args, **kwargs: None)  # no training here
    result = grid.run_experiment(
        "tiny", tmp_path / "out", experiments_dir=experiments, use_archive=False
    )
    assert result.summaries == [] and not (tmp_path / "out" / "tiny" / name).exists()
