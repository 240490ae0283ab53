"""Your own task end to end: a real tiny run (Ray, retrieval server, DeepSpeed learner) on the
NQ- and HotpotQA-style Parquet fixtures, logging to TensorBoard, MLflow and W&B (offline);
the values the driver logged are read back from each tracker and compared with its JSON logs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_driver import RunInThread, read_jsonl, tiny_run_config
from tracking_readers import history, mlflow_run, read_tensorboard, read_wandb_history

from services.env import PROJECT_ROOT

pytestmark = pytest.mark.integration

OWN = PROJECT_ROOT / "tests" / "fixtures" / "own_task"


def test_run_on_parquet_sets_logs_to_every_tracker(
    tmp_path: Path, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = tiny_run_config(
        tmp_path,
        tiny_llama_dir,
        **{
            "run.num_steps": 3,
            "rollout.num_actors": 1,
            "data.train_files": [
                str(OWN / "nq/train.parquet"),
                str(OWN / "hotpotqa/train.parquet"),
            ],
            "data.validation_files": [
                str(OWN / "nq/validation.parquet"),
                str(OWN / "hotpotqa/validation.parquet"),
            ],
            "tracking.backends": ["tensorboard", "mlflow", "wandb"],
        },
    )
    run = RunInThread(cfg)
    run_dir = cfg.run_dir
    run.wait_for(lambda: len(read_jsonl(run_dir / "steps.jsonl")) >= 1, 600, "step 1")
    run.driver.control.request_change({"buffer": {"max_staleness": 2}})
    run.thread.join(900)
    assert not run.thread.is_alive(), "run did not finish"
    if run.error is not None:
        raise run.error

    steps = read_jsonl(run_dir / "steps.jsonl")
    evals = read_jsonl(run_dir / "eval.jsonl")
    (change,) = read_jsonl(run_dir / "config_changes.jsonl")
    assert [s["step"] for s in steps] == [1, 2, 3]
    # evaluation questions came from both Parquet sets, scored by golden_answers
    assert {"success_rate/nq", "success_rate/hotpotqa"} <= set(evals[-1])

    tracking = run_dir / "tracking"
    scalars, texts = read_tensorboard(tracking / "tensorboard")
    client, mlrun = mlflow_run(tracking)
    (wandb_file,) = (tracking / "wandb").glob("offline-run-*/run-*.wandb")
    wandb_rows = read_wandb_history(wandb_file)
    for key in ("policy_version", "staleness_max", "trajectories_consumed", "pg_loss"):
        expected = [(s["step"], pytest.approx(float(s[key]))) for s in steps]
        assert scalars[f"train/{key}"] == expected
        assert history(client, mlrun, f"train/{key}") == expected
        got = [(r["learner_step"], r[f"train/{key}"]) for r in wandb_rows if f"train/{key}" in r]
        assert got == expected
    expected_eval = [(e["learner_step"], pytest.approx(e["success_rate"])) for e in evals]
    assert scalars["eval/success_rate"] == expected_eval
    assert history(client, mlrun, "eval/success_rate") == expected_eval
    change_point = [(change["learner_step"], 2.0)]
    assert scalars["config/buffer.max_staleness"] == change_point
    assert history(client, mlrun, "config/buffer.max_staleness") == change_point
    # the per-question records reach every tracker too
    assert [step for step, _ in texts["samples/train"]] == [1, 2, 3]
    assert [step for step, _ in texts["eval_samples/end"]] == [3]
    artifacts = [a.path for a in client.list_artifacts(mlrun.info.run_id, "eval_samples")]
    assert artifacts == ["eval_samples/end_step000003.jsonl", "eval_samples/start_step000000.jsonl"]
    assert [r["learner_step"] for r in wandb_rows if "samples/train/path" in r] == [1, 2, 3]
