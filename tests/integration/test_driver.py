"""The whole service end to end: real Ray local cluster, real retrieval server, real DeepSpeed
learner, 2 rollout actors on the tiny Llama; a live variant change and an actor crash mid-run.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest
from fixture_paths import FIXTURE_CORPUS

from services.config import load_config
from services.env import PROJECT_ROOT

pytestmark = pytest.mark.integration

FIXTURE_QA = PROJECT_ROOT / "tests" / "fixtures" / "qa"


def tiny_run_config(tmp_path: Path, model_dir: Path, **extra: str):
    overrides = {
        "run.name": "tiny",
        "run.output_dir": str(tmp_path / "runs"),
        "run.num_steps": 4,
        "run.eval_questions": 2,
        "model.path": str(model_dir),
        "data.qa_dir": str(FIXTURE_QA),
        "data.datasets": ["single_hop"],
        "retrieval.server.corpus_path": str(FIXTURE_CORPUS),
        "retrieval.server.index_dir": str(tmp_path / "index"),
        "retrieval.server.port": 0,
        "rollout.num_actors": 2,
        "rollout.prompts_per_batch": 1,
        "rollout.group_size": 2,
        "rollout.max_turns": 2,
        "rollout.max_new_tokens_per_turn": 12,
        "rollout.max_response_tokens": 160,
        "rollout.max_information_tokens": 48,
        "algorithm.variant": "st_ppo",
        "learner.train_batch_size": 4,
        "learner.mini_batch_size": 2,
        "learner.micro_batch_size": 2,
        "learner.zero_stage": 1,
        "learner.dtype": "fp32",
        "learner.actor_lr": 1e-3,
        "sft.enabled": False,
        "buffer.max_staleness": 1,
        "buffer.capacity": 12,
        "checkpoint.every_k_steps": 2,
        "ray.num_cpus": 2,
        "ray.rollout_actor_cpus": 0.5,
        "ray.learner_cpus": 1.0,
        "control.port": 0,
        "metrics.port": 0,
    }
    overrides.update(extra)
    return load_config(None, [f"{k}={json.dumps(v)}" for k, v in overrides.items()])


class RunInThread:
    """Runs ``Driver.run`` in a thread, keeping its result or exception."""

    def __init__(self, cfg):
        from services.driver import Driver

        self.driver = Driver(cfg)
        self.error: BaseException | None = None
        self.state = None
        self.thread = threading.Thread(target=self._target, daemon=True)
        self.thread.start()

    def _target(self):
        try:
            self.state = self.driver.run()
        except BaseException as e:
            self.error = e

    def wait_for(self, predicate, timeout_s: float, what: str):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.error is not None:
                raise self.error
            value = predicate()
            if value:
                return value
            time.sleep(0.2)
        raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _control_client(run: RunInThread, run_dir: Path) -> tuple[dict, httpx.Client]:
    """The run's control.json (once the control plane is up) and an authorised client."""
    control = run.wait_for(
        lambda: (run_dir / "control.json").exists() and json.loads((run_dir / "control.json").read_text()),
        300, "control plane",
    )  # fmt: skip
    client = httpx.Client(
        base_url=control["url"], headers={"Authorization": f"Bearer {control['token']}"}, timeout=30
    )
    return control, client


def test_async_run_with_live_variant_change_and_actor_crash(tmp_path: Path, tiny_llama_dir: Path):
    import ray

    cfg = tiny_run_config(tmp_path, tiny_llama_dir, **{"run.eval_every": 2})
    run = RunInThread(cfg)
    run_dir = cfg.run_dir
    control, client = _control_client(run, run_dir)
    run.wait_for(lambda: len(read_jsonl(run_dir / "steps.jsonl")) >= 1, 600, "step 1")

    # live change of the variant: accepted now, applied at the next step boundary
    resp = client.patch("/config", json={"algorithm": {"variant": "ppo"}})
    assert resp.status_code == 202, resp.text
    assert "algorithm.variant" in resp.json()["accepted"]
    assert client.patch("/config", json={"buffer": {"max_staleness": -1}}).status_code == 422
    assert httpx.get(f"{control['url']}/status").status_code == 401

    # crash one rollout actor; Ray restarts it and the run goes on
    ray.kill(run.driver.fleet.slots[0].handle, no_restart=False)

    run.wait_for(
        lambda: client.get("/status").json()["config"]["algorithm"]["variant"] == "ppo",
        600,
        "variant applied",
    )
    metrics_text = httpx.get(f"{control['url']}/metrics/").text
    assert 'stppo_algorithm_variant_info{variant="ppo"} 1.0' in metrics_text
    assert 'stppo_config_changes_total{field="algorithm.variant"} 1.0' in metrics_text
    assert "stppo_clip_ratio " in metrics_text

    run.thread.join(900)
    assert not run.thread.is_alive(), "run did not finish"
    if run.error is not None:
        raise run.error

    steps = read_jsonl(run_dir / "steps.jsonl")
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert [s["policy_version"] for s in steps] == [1, 2, 3, 4]
    assert all(s["staleness_max"] <= 1 for s in steps)  # the bound held at every take
    variants = [s["variant"] for s in steps]
    assert variants[0] == "st_ppo" and variants[-1] == "ppo"
    switch = variants.index("ppo")
    assert all(v == "ppo" for v in variants[switch:])
    assert all(0.0 <= s["clip_ratio"] <= 1.0 for s in steps)

    assert run.state.actor_restarts >= 1
    assert run.state.learner_step == 4 and run.state.policy_version == 4

    # checkpoints every 2 steps (+ the final one), keep_last=2, driver state inside
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    saved = json.loads((run_dir / "checkpoints" / latest / "driver_state.json").read_text())
    assert saved["learner_step"] == 4 and saved["policy_version"] == 4
    # run.eval_every = 2 of 4 steps: one evaluation between steps, after step 2 (step 4 is
    # the end's), on step 2's weights, its waits and seconds recorded
    evals = read_jsonl(run_dir / "eval.jsonl")
    assert [e["tag"] for e in evals] == ["start", "step_2", "end"]
    midway = evals[1]
    assert (midway["learner_step"], midway["policy_version"]) == (2, 2)
    assert midway["engine_policy_version_min"] == midway["engine_policy_version_max"] == 2
    assert midway["num_questions"] == cfg.run.eval_questions
    assert midway["wall_s"] > 0 and midway["wait_s"] >= 0
    tags = {(r["tag"], r["learner_step"]) for r in read_jsonl(run_dir / "eval_samples.jsonl")}
    assert tags == {("start", 0), ("step_2", 2), ("end", 4)}
    # the rollouts in flight at step 2 finished into the buffer, none thrown away: each step
    # trained on a full batch (4 x 4, each trajectory once) and the buffer never overflowed
    assert run.state.trajectories_consumed == 4 * cfg.learner.train_batch_size
    consumed = [i for rec in read_jsonl(run_dir / "consumed.jsonl") for i in rec["ids"]]
    assert len(set(consumed)) == len(consumed) == 4 * cfg.learner.train_batch_size
    stats = run.driver.pipeline.buffer_stats()
    assert stats.rejected_full_total == 0
    assert run.state.trajectories_generated == (
        stats.taken_total + stats.dropped_stale_total + stats.dropped_retrieval_failed_total
        + stats.depth
    )  # fmt: skip
    assert (run_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_evaluation_reruns_the_shard_of_an_actor_that_crashed(tmp_path: Path, tiny_llama_dir: Path):
    """CI once failed here: an actor killed while the end-of-run evaluation was in flight
    raised RayActorError out of ``Driver.run``. Now the shard is re-run on the restarted actor
    (the evaluation phase over a real fleet of Ray actors; the weight sync is a fake)."""
    import os
    from types import SimpleNamespace

    import ray

    from services.env import ray_temp_dir
    from services.loop.fleet import Fleet, RolloutActorLost, RolloutSlot
    from services.loop.phases import Phases
    from services.loop.sync import SyncCoordinator

    marker = tmp_path / "crashed-once"

    class CrashOnceWorker:
        """Dies (process exit) on its first rollout; answers one record per question after."""

        def rollout(self, records, greedy=False):
            try:  # atomic: of two actors starting at once, exactly one dies
                os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                pass
            else:
                os._exit(1)
            return [SimpleNamespace(question=r["question"], policy_version_min=0) for r in records]

    class NoSync:
        def on_member_lost(self, handle, reason):
            pass

    cfg = tiny_run_config(tmp_path, tiny_llama_dir)
    lines: list[str] = []
    ray.init(address="local", num_cpus=2, include_dashboard=False, _temp_dir=str(ray_temp_dir()))
    try:
        actor = ray.remote(CrashOnceWorker).options(max_restarts=1, max_task_retries=0, num_cpus=0)
        fleet = Fleet(cfg, lambda i: actor.remote())
        fleet.resize(2)
        sync = SyncCoordinator(lambda: cfg, fleet, None, NoSync(), lines.append)
        report = SimpleNamespace(say=lines.append)
        phases = Phases(lambda: cfg, fleet, sync, None, "", report)
        shards = [[{"question": "a"}, {"question": "b"}], [{"question": "c"}]]
        out, crashes = phases.rollout_shards(shards, "end")
        assert sorted(t.question for t in out) == ["a", "b", "c"]  # nothing lost, nothing doubled
        assert crashes == 1 and sum("crashed (" in line for line in lines) == 1

        # an actor that keeps dying exhausts ray.max_actor_restarts and fails loudly
        marker.unlink()
        doomed = ray.remote(CrashOnceWorker).options(max_restarts=0, max_task_retries=0, num_cpus=0)
        fleet.slots = [RolloutSlot(doomed.remote(), 0)]
        with pytest.raises(RuntimeError, match=r"eval\[end\]: rollout actors \[0\] crashed"):
            phases.rollout_shards([[{"question": "a"}]], "end")

        # a constructor that raises cannot be fixed by restarts: the run stops at once,
        # naming the cause (it used to log "crashed; restarting" in a tight loop)
        class BadConfigWorker:
            def __init__(self):
                raise AttributeError("'RolloutConfig' object has no attribute 'x'")

            def rollout(self, records, greedy=False):
                return []

        bad = ray.remote(BadConfigWorker).options(max_restarts=3, num_cpus=0).remote()
        with pytest.raises(ray.exceptions.RayActorError) as died:
            ray.get(bad.rollout.remote([]))
        with pytest.raises(RolloutActorLost, match="failed to start: AttributeError: 'Rollout"):
            fleet.on_crash(RolloutSlot(bad, 0), died.value)
        # restarts spent: ray.max_actor_restarts + 1 crashes in a row are survived, one more not
        slot = RolloutSlot(bad, 1)
        limit = cfg.ray.max_actor_restarts + 1
        for _ in range(limit):
            fleet.on_crash(slot, RuntimeError("killed"))
        with pytest.raises(RolloutActorLost, match=f"crashed {limit + 1} times in a row"):
            fleet.on_crash(slot, RuntimeError("killed"))
    finally:
        ray.shutdown()


def test_max_train_s_stops_the_loop_and_the_run_still_checkpoints(
    tmp_path: Path, tiny_llama_dir: Path
):
    """The experiment's per-run cap: once expired, no learner step starts; the run still
    checkpoints and ends normally (a cap this small expires before the first step)."""
    from services.driver import Driver

    cfg = tiny_run_config(tmp_path, tiny_llama_dir, **{"run.eval_questions": 0})
    state = Driver(cfg, max_train_s=1e-6).run()
    assert state.learner_step == 0 < cfg.run.num_steps
    assert read_jsonl(cfg.run_dir / "steps.jsonl") == []
    latest = (cfg.run_dir / "checkpoints" / "latest").read_text().strip()
    assert (
        json.loads((cfg.run_dir / "checkpoints" / latest / "driver_state.json").read_text())[
            "learner_step"
        ]
        == 0
    )


def _scan_for(secret: str, folder: Path) -> list[Path]:
    hits = []
    for path in folder.rglob("*"):
        if path.is_file() and secret.encode() in path.read_bytes():
            hits.append(path)
    return hits


def test_resume_continues_the_last_live_change(
    tmp_path: Path, tiny_llama_dir: Path, capfd, monkeypatch
):
    """Issue 21: change the variant and the staleness bound live, checkpoint, resume with
    ``Driver(resume=True)`` from a command line that says otherwise: the learner, the
    driver, ``ctl status`` and the metrics all follow the last applied change, and no
    trajectory is consumed twice across the restart. Issue 16: the token is never printed,
    control.json is 0600, and a token from the environment is not written anywhere."""
    import stat

    from services.driver import Driver

    extra = {"run.num_steps": 2, "run.eval_questions": 0, "checkpoint.every_k_steps": 0}
    cfg = tiny_run_config(tmp_path, tiny_llama_dir, **extra)
    run_dir = cfg.run_dir
    run = RunInThread(cfg)
    control = run.wait_for(
        lambda: (run_dir / "control.json").exists() and json.loads((run_dir / "control.json").read_text()),
        300, "control plane",
    )  # fmt: skip
    assert stat.S_IMODE((run_dir / "control.json").stat().st_mode) == 0o600
    token = control["token"]
    client = httpx.Client(
        base_url=control["url"], headers={"Authorization": f"Bearer {token}"}, timeout=30
    )
    change = {"algorithm": {"variant": "ppo"}, "buffer": {"max_staleness": 2}}
    assert client.patch("/config", json=change).status_code == 202
    run.thread.join(900)
    assert not run.thread.is_alive(), "first run did not finish"
    if run.error is not None:
        raise run.error
    first = read_jsonl(run_dir / "steps.jsonl")
    assert first[-1]["variant"] == "ppo", "the change was not applied before the last step"
    assert token not in capfd.readouterr().out  # generated token: only in control.json
    assert _scan_for(token, run_dir) == [run_dir / "control.json"]

    # resume from a command line that still says st_ppo / max_staleness 1, with 2 more steps
    (run_dir / "control.json").unlink()
    env_token = "e" * 40
    monkeypatch.setenv("STPPO_CONTROL_TOKEN", env_token)
    cfg2 = tiny_run_config(tmp_path, tiny_llama_dir, **{**extra, "run.num_steps": 4})
    assert (cfg2.algorithm.variant, cfg2.buffer.max_staleness) == ("st_ppo", 1)
    resumed = Driver(cfg2, resume=True)
    seen: dict = {}

    def probe():  # ctl status and metrics while the resumed run trains
        control2 = json.loads((run_dir / "control.json").read_text())
        headers = {"Authorization": f"Bearer {env_token}"}
        status = httpx.get(f"{control2['url']}/status", headers=headers, timeout=30).json()
        seen["status"] = status
        seen["metrics"] = httpx.get(f"{control2['url']}/metrics/", timeout=30).text
        seen["control"] = control2

    run2 = RunInThread.__new__(RunInThread)
    run2.driver, run2.error, run2.state = resumed, None, None
    run2.thread = threading.Thread(target=run2._target, daemon=True)
    run2.thread.start()
    run2.wait_for(lambda: len(read_jsonl(run_dir / "steps.jsonl")) > len(first), 900, "step 3")
    probe()
    run2.thread.join(900)
    assert not run2.thread.is_alive(), "resumed run did not finish"
    if run2.error is not None:
        raise run2.error

    steps = read_jsonl(run_dir / "steps.jsonl")
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    after = steps[len(first) :]
    assert all(s["variant"] == s["trained_variant"] == "ppo" for s in after)
    assert seen["status"]["config"]["algorithm"]["variant"] == "ppo"
    assert seen["status"]["config"]["buffer"]["max_staleness"] == 2
    assert 'stppo_algorithm_variant_info{variant="ppo"} 1.0' in seen["metrics"]
    assert "stppo_max_staleness 2.0" in seen["metrics"]
    assert resumed.cfg.buffer.max_staleness == 2
    # every consumed trajectory id is unique across both runs, and each step consumed B
    consumed = [i for rec in read_jsonl(run_dir / "consumed.jsonl") for i in rec["ids"]]
    assert len(consumed) == 4 * cfg.learner.train_batch_size and None not in consumed
    assert len(set(consumed)) == len(consumed)
    # a token from the environment is neither printed nor written
    assert (
        "token" not in seen["control"] and seen["control"]["token_source"] == "STPPO_CONTROL_TOKEN"
    )
    assert env_token not in capfd.readouterr().out
    assert _scan_for(env_token, run_dir) == []
    # generated, consumed, dropped and waste are reported; nothing dropped at a fixed bound
    assert steps[-1]["trajectories_consumed"] == 4 * cfg.learner.train_batch_size
    assert steps[-1]["trajectories_generated"] >= steps[-1]["trajectories_consumed"]
    assert all(s["waste_fraction"] == 0.0 for s in first)


def test_collective_weight_sync_survives_an_engine_restart(tmp_path: Path, tiny_llama_dir: Path):
    """``sync.transport = "collective"`` (gloo on CPU) through the real driver: every sync is
    a broadcast from learner rank 0 to both engines; a killed engine is re-synced through the
    object store and the group is formed again with it at the next sync."""
    import ray

    # a member that dies mid-broadcast is noticed at once (gloo: connection closed by peer) or,
    # at worst, when the timeout expires
    overrides = {"sync.transport": "collective", "sync.collective_timeout_s": 60.0}
    cfg = tiny_run_config(tmp_path, tiny_llama_dir, **overrides)
    run = RunInThread(cfg)
    run_dir = cfg.run_dir
    run.wait_for(lambda: len(read_jsonl(run_dir / "steps.jsonl")) >= 1, 600, "step 1")
    ray.kill(run.driver.fleet.slots[0].handle, no_restart=False)
    run.thread.join(900)
    assert not run.thread.is_alive(), "run did not finish"
    if run.error is not None:
        raise run.error
    steps = read_jsonl(run_dir / "steps.jsonl")
    assert [s["policy_version"] for s in steps] == [1, 2, 3, 4]
    assert all(s["staleness_max"] <= 1 for s in steps)
    assert run.state.actor_restarts >= 1
    # formed at the first sync, and again with the restarted engine
    assert run.driver.sync.weight_sync.groups_formed >= 2
    evals = read_jsonl(run_dir / "eval.jsonl")
    assert [e["policy_version"] for e in evals] == [0, 4]  # the end eval ran on synced weights


def test_interruptible_run_keeps_the_bound_and_takes_a_live_change(
    tmp_path: Path, tiny_llama_dir: Path
):
    """``rollout.interrupt_every_tokens = 4``: weight loads run on the actors' weight thread
    and land mid-batch; nothing is dropped at the constant bound, no consumed token is
    older than it (consumed.jsonl, per token), and ``ctl set`` of the option applies."""
    cfg = tiny_run_config(
        tmp_path, tiny_llama_dir, **{"rollout.interrupt_every_tokens": 4, "run.num_steps": 5}
    )
    run = RunInThread(cfg)
    run_dir = cfg.run_dir
    control, client = _control_client(run, run_dir)
    run.wait_for(lambda: len(read_jsonl(run_dir / "steps.jsonl")) >= 1, 600, "step 1")
    resp = client.patch("/config", json={"rollout": {"interrupt_every_tokens": 2}})
    assert resp.status_code == 202, resp.text
    assert client.patch("/config", json={"sync": {"fixed_lag": True}}).status_code == 422
    run.wait_for(
        lambda: client.get("/status").json()["config"]["rollout"]["interrupt_every_tokens"] == 2,
        600, "interrupt_every_tokens applied",
    )  # fmt: skip
    metrics_text = httpx.get(f"{control['url']}/metrics/").text
    assert "stppo_inflight_weight_updates_total" in metrics_text
    run.thread.join(900)
    assert not run.thread.is_alive(), "run did not finish"
    if run.error is not None:
        raise run.error

    steps = read_jsonl(run_dir / "steps.jsonl")
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5]
    assert steps[-1]["trajectories_dropped_stale"] == 0
    assert all(s["staleness_max"] <= 1 and s["staleness_token_max"] <= 1 for s in steps)
    consumed = read_jsonl(run_dir / "consumed.jsonl")
    for line in consumed:
        assert max(int(k) for k in line["token_staleness"]) <= 1
        for staleness, runs in zip(line["staleness"], line["token_versions"], strict=True):
            versions = [v for v, _ in runs]
            assert versions == sorted(versions)
            assert line["step"] - 1 - versions[0] == staleness  # the oldest token's
    changes = read_jsonl(run_dir / "config_changes.jsonl")
    assert ["rollout.interrupt_every_tokens"] in [c["fields"] for c in changes]
    print("inflight weight updates:", steps[-1]["inflight_weight_updates"])


def test_continuous_batching_run_keeps_the_bound(tmp_path: Path, tiny_llama_dir: Path):
    """``rollout.calls_per_actor = 2``: the driver starts a second admitted rollout on a
    busy actor, whose episodes share the engine's turns with the first; nothing is dropped
    at the constant bound and no consumed token is older than it."""
    cfg = tiny_run_config(
        tmp_path, tiny_llama_dir,
        **{"rollout.calls_per_actor": 2, "rollout.num_actors": 1, "run.num_steps": 5,
           "buffer.max_staleness": 2},
    )  # fmt: skip
    run = RunInThread(cfg)
    run.thread.join(900)
    assert not run.thread.is_alive(), "run did not finish"
    if run.error is not None:
        raise run.error
    steps = read_jsonl(cfg.run_dir / "steps.jsonl")
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5]
    assert max(s["rollout_calls_running_max"] for s in steps) == 2
    assert steps[-1]["trajectories_dropped_stale"] == 0
    assert all(s["staleness_max"] <= 2 and s["staleness_token_max"] <= 2 for s in steps)
    for line in read_jsonl(cfg.run_dir / "consumed.jsonl"):
        for staleness, runs in zip(line["staleness"], line["token_versions"], strict=True):
            assert line["step"] - 1 - runs[0][0] == staleness <= 2  # the oldest token's


def test_the_stability_guard_rolls_back_and_acts_through_the_control_plane_in_a_run(
    tmp_path: Path, tiny_llama_dir: Path, capfd
):
    """``guard.mode = "act"`` with a rule that holds from learner step 3 (the record's own
    ``step``; window 1, so its signal began at step 3): the guard rolls the learner back in
    process to the checkpoint of step 2 (the newest before step 3) and lowers
    ``buffer.max_staleness`` 4 -> 1 through the control plane, applied at once like a
    person's change; steps 3 and 4 are trained again under the new bound, and the run
    writes guard.jsonl, the superseded step, the metrics and the end-of-run line."""
    from services.config import update_config

    extra = {"run.num_steps": 4, "run.eval_questions": 0, "buffer.max_staleness": 4}
    guard = {"mode": "act", "warmup_steps": 0, "window": 1,
             "rules": [{"signal": "step", "above": 2.5, "level": "act"}]}  # fmt: skip
    cfg = update_config(tiny_run_config(tmp_path, tiny_llama_dir, **extra), {"guard": guard})
    run = RunInThread(cfg)
    run.thread.join(900)
    assert not run.thread.is_alive(), "run did not finish"
    if run.error is not None:
        raise run.error
    decisions = read_jsonl(cfg.run_dir / "guard.jsonl")
    assert decisions[0]["step"] == 3 and decisions[0]["level"] == "act"
    assert decisions[0]["action"] == "lower_staleness"
    assert decisions[0]["after"] == {"buffer.max_staleness": 1}
    assert decisions[0]["rollback"] == {
        "from_step": 3, "signal_began": 3, "to_step": 2, "checkpoint": "step_000002",
        "reason": "",
    }  # fmt: skip
    # the trained-again steps 3 and 4 hold the rule too: within the cooldown
    assert [(d["step"], d["level"], d["reason"]) for d in decisions[1:]] == [
        (3, "warn", "cooldown"), (4, "warn", "cooldown"),
    ]  # fmt: skip
    # the learner went back to step 2 (version 2); its weights were published as version 4
    # (versions never decrease), so the second step 3 is version 5
    steps = read_jsonl(cfg.run_dir / "steps.jsonl")
    assert [(s["step"], s["policy_version"]) for s in steps] == [(1, 1), (2, 2), (3, 5), (4, 6)]
    (gone,) = read_jsonl(cfg.run_dir / "superseded" / "steps.jsonl")
    assert (gone["step"], gone["policy_version"]) == (3, 3)
    assert all(s["staleness_max"] <= 1 for s in steps[2:])  # steps 3 and 4 under the new bound
    changes = read_jsonl(cfg.run_dir / "config_changes.jsonl")
    assert {"learner_step": 2, "fields": ["buffer.max_staleness"]} in [
        {k: c[k] for k in ("learner_step", "fields")} for c in changes
    ]
    assert (run.state.learner_step, run.state.policy_version) == (4, 6)
    assert run.driver.control.config.buffer.max_staleness == 1
    assert run.driver.control.person_fields == set()
    # the checkpoints carry the guard's state: a resume keeps the rollback it took
    last = json.loads(
        (cfg.run_dir / "checkpoints" / "step_000004" / "driver_state.json").read_text()
    )
    assert len(last["guard"]["rollbacks"]) == 1 and last["policy_version"] == 6
    metrics = run.driver.services.metrics
    assert metrics.guard_actions_total.labels(action="lower_staleness")._value.get() == 1
    assert metrics.guard_rollbacks_total._value.get() == 1
    out = " ".join((lambda o: o.out + o.err)(capfd.readouterr()).split())
    assert "rolled back from step 3 to step_000002 (step 2, now policy_version 4)" in out
    assert "stability guard (mode act): " in out
    assert "acted: lower_staleness at step 3 (step > 2.5; rolled back to step 2); 1 rollback" in out


def test_a_kept_warm_start_is_loaded_by_the_next_run_instead_of_trained(
    tmp_path: Path, tiny_llama_dir: Path, monkeypatch, capfd
):
    """``sft.cache = true``: the first run trains the warm start and keeps it (a learner
    checkpoint under the cache); a second run with the same model, data, settings and code
    loads it (no demonstrations built, no SFT step), continues from its policy version with
    its own algorithm, and trains."""
    import services.loop.warm_start_cache as warm_start_cache
    from services.driver import Driver
    from services.estimate import WARM_START_LOAD_S

    monkeypatch.setattr(warm_start_cache, "CACHE_ROOT", tmp_path / "cache")
    extra = {
        "run.num_steps": 1, "run.eval_questions": 0, "checkpoint.every_k_steps": 0,
        "rollout.num_actors": 1, "sft.enabled": True, "sft.cache": True,
        "sft.num_demonstrations": 4, "sft.batch_size": 2, "sft.epochs": 1,
        "retrieval.server.index_dir": str(tmp_path / "index"),  # one index: one key
    }  # fmt: skip
    first = tiny_run_config(tmp_path / "first", tiny_llama_dir, **extra)
    Driver(first).run()
    (trained,) = read_jsonl(first.run_dir / "sft.jsonl")
    entries = [p for p in (tmp_path / "cache" / "warm_start").iterdir()]
    assert len(entries) == 1 and (entries[0] / "learner" / "learner_state.json").is_file()
    said = capfd.readouterr()
    out = " ".join((said.out + said.err).split())  # lines wrap
    assert "warm start kept in" in out
    # the expected time at the start: the warm start trained (2 SFT steps), then kept
    assert "expected on this CPU (" in out and "warm start " in out and "(2 SFT steps)" in out

    second = tiny_run_config(  # its own RL learning rate: the same key, set after loading
        tmp_path / "second", tiny_llama_dir, **extra,
        **{"algorithm.variant": "ppo", "learner.actor_lr": 5e-4},
    )  # fmt: skip
    Driver(second).run()
    (loaded,) = read_jsonl(second.run_dir / "sft.jsonl")
    assert loaded.pop("kept") == entries[0].name
    assert loaded.pop("run_id") != trained.pop("run_id")  # each run's own
    assert loaded == trained  # the same warm start: its record, steps and version
    said = capfd.readouterr()
    out = " ".join((said.out + said.err).split())
    assert "warm start: loading the one kept in" in out
    assert f"warm start {round(WARM_START_LOAD_S)} s (kept)" in out
    assert "building demonstrations" not in out and "[warm start] step" not in out
    (step,) = read_jsonl(second.run_dir / "steps.jsonl")
    assert step["variant"] == "ppo"  # the run's own algorithm, not the cached one's
    assert step["policy_version"] == trained["policy_version"] + 1
