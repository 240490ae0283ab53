"""The phases around the loop: the warm start and the evaluations, on the same fleet.

The warm start (:meth:`Phases.warm_start`) is SFT on demonstrations (search the gold entity,
answer with the gold answer) built from the training split and the real retrieval server; it
teaches the tool format. An evaluation (:meth:`Phases.evaluate`) runs the validation
questions greedily (and, with ``run.eval_sampled``, at the rollout temperature), sharded
over the rollout actors in chunks; an actor that crashes mid-shard (or came back from a
restart with the base weights) is re-synced and given its shard again: an evaluation is
never trained on, so re-running it is safe. With ``run.eval_every`` an evaluation also runs
between learner steps (:meth:`Phases.evaluate_midway`), on the step's weights, after the
training rollouts in flight have finished. Both return what happened; the driver counts it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

from services.config import RunConfig
from services.loop.fleet import Fleet, rollout_outcome
from services.loop.report import Report, fmt
from services.loop.seams import LearnerHandle
from services.loop.sync import SyncCoordinator


@dataclass
class WarmStartDone:
    """The warm start's outcome: the learner's version after it and its ``sft.jsonl``
    record."""

    policy_version: int
    record: dict[str, Any]


def fmt_seconds(seconds: float) -> str:
    """``95`` -> ``"1m35s"``; ``4000`` -> ``"1h06m"``."""
    seconds = max(0, round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


class Phases:
    """Warm start and evaluation (module docstring).

    Args:
        config: the live run config (a callable). fleet, sync: the rollout slots and their
            weight syncs. learner: the learner group handle. retrieval_url: the retrieval
            server. report: where records and progress lines go.
    """

    def __init__(
        self,
        config: Callable[[], RunConfig],
        fleet: Fleet,
        sync: SyncCoordinator,
        learner: LearnerHandle,
        retrieval_url: str,
        report: Report,
    ) -> None:
        self.config = config
        self.fleet = fleet
        self.sync = sync
        self.learner = learner
        self.retrieval_url = retrieval_url
        self.report = report

    def warm_start(self) -> WarmStartDone:
        """Build the demonstrations and run the learner's SFT on them, or load the warm
        start a previous run with the same key kept (``sft.cache``,
        :mod:`services.loop.warm_start_cache`); keep a new one."""
        from actors.hardware import resolve_dtype
        from services.loop.warm_start_cache import WarmStartCache, warm_start_key

        cfg = self.config()
        if not cfg.sft.cache:
            return self._train_warm_start(cfg)
        device = "cuda" if cfg.ray.learner_gpus > 0 else "cpu"
        key = warm_start_key(cfg, resolve_dtype(cfg.learner.dtype, device).name)
        cache = WarmStartCache()
        kept = cache.lookup(key)
        if kept is not None:
            folder, record = kept
            self.report.say(
                f"warm start: loading the one kept in {folder.parent} (same model, data, "
                "settings and code; sft.cache = false trains it again)"
            )
            algorithm = cfg.algorithm.model_dump()
            version = ray.get(self.learner.load_warm_start.remote(str(folder), algorithm))
            # the kept optimizer states carry the learning rates of the run that kept them
            ray.get(self.learner.set_lr.remote(cfg.learner.actor_lr, cfg.learner.critic_lr))
            return WarmStartDone(version, {**record, "kept": key})
        done = self._train_warm_start(cfg)
        ray.get(self.learner.save_warm_start.remote(str(cache.staging(key))))
        self.report.say(f"warm start kept in {cache.commit(key, done.record)} for later runs")
        return done

    def _train_warm_start(self, cfg: RunConfig) -> WarmStartDone:
        from transformers import AutoTokenizer

        from actors.demonstrations import build_demonstrations
        from actors.retrieval_client import RetrievalClient
        from services.sampler import QuestionSampler

        n = cfg.sft.num_demonstrations
        self.report.say(f"warm start: building demonstrations from {n} training questions")
        # a separate stream (seed + 1) so RL questions are not used up by the warm start;
        # with data.warm_start_share > 0 the two draw from disjoint sides of the split
        records = QuestionSampler.from_data(
            cfg.data, "train", cfg.run.seed + 1, side="warm_start"
        ).sample(n)
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        with RetrievalClient(self.retrieval_url, cfg.rollout.retrieval) as client:
            demos = build_demonstrations(
                records, tokenizer, client.retrieve,
                max_information_tokens=cfg.rollout.max_information_tokens,
                system_prompt=cfg.rollout.system_prompt,
                early_answer_share=cfg.sft.early_answer_share,
                seed=cfg.run.seed + 1,
            )  # fmt: skip
        early = f", {demos.num_early_answer} answering after their first search"
        self.report.say(
            f"warm start: {len(demos.demonstrations)} demonstrations "
            f"({demos.num_answer_not_retrieved} skipped: answer not retrieved, "
            f"{demos.num_invalid} invalid{early if cfg.sft.early_answer_share > 0 else ''}); "
            f"SFT {cfg.sft.epochs} epoch(s)"
        )
        result = ray.get(self.learner.warm_start.remote(demos.demonstrations, cfg.sft))
        record = {k: v for k, v in result.__dict__.items() if k != "losses"}
        record.update(loss_first=result.losses[0], loss_last=result.losses[-1])
        self.report.say(f"warm start done: {fmt(record)}")
        return WarmStartDone(result.policy_version, record)

    def eval_due(self, learner_step: int) -> bool:
        """An evaluation is due after ``learner_step`` (``run.eval_every``): a multiple of it,
        before the last step (the end evaluation covers that one)."""
        run = self.config().run
        if run.eval_every == 0 or run.eval_questions == 0:
            return False
        return learner_step % run.eval_every == 0 and 0 < learner_step < run.num_steps

    def evaluate_midway(self, state: Any, route: Callable[[Any], None]) -> int:
        """The evaluation ``run.eval_every`` asks for after learner step ``N`` (tag
        ``step_<N>``; ``state``: the driver's counters, at ``N``), on that step's weights,
        between two learner steps (none in flight): wait for every training rollout in
        flight, handing each finished ref to ``route`` (the driver's: it buffers the
        trajectories, valid and stamped with their version, and counts them and any
        crash), then push the weights and wait for every load
        (:meth:`SyncCoordinator.push_final`, as before the end evaluation), then evaluate.
        Its ``eval.jsonl`` record gets ``wait_s``, the seconds before the evaluation could
        start. Returns the actor crashes met in the evaluation."""
        learner_step, policy_version = state.learner_step, state.policy_version
        started = time.perf_counter()
        while refs := self.fleet.refs():
            ready, _ = ray.wait(refs, num_returns=1)
            route(ready[0])
        drained = time.perf_counter()  # from here on no training rollout runs
        self.sync.push_final(policy_version)
        wait_s = round(time.perf_counter() - started, 3)
        tag = f"step_{learner_step}"
        crashes = self.evaluate(tag, learner_step, policy_version, {"wait_s": wait_s})
        self.report.pause_window(time.perf_counter() - drained)  # out of the rollout rates
        return crashes

    def evaluate(
        self, tag: str, learner_step: int, policy_version: int, extra: dict[str, Any] | None = None
    ) -> int:
        """Greedy evaluation on ``run.eval_questions`` validation questions (and the same
        again at the rollout temperature, tag ``<tag>_sampled``, with ``run.eval_sampled``),
        written to ``eval.jsonl`` (the greedy record with ``extra``; each with ``wall_s``,
        its seconds) and ``eval_samples.jsonl``; returns the actor crashes met.
        """
        from services.sampler import evaluation_questions

        cfg = self.config()
        if cfg.run.eval_questions == 0:
            return 0
        records = evaluation_questions(cfg.data, "validation", cfg.run.eval_questions)
        n = len(self.fleet.slots)
        shards = [records[i::n] for i in range(n)]
        at = learner_step, policy_version
        crashes = self._evaluate_shards(shards, tag, True, *at, extra or {})
        if cfg.run.eval_sampled:
            crashes += self._evaluate_shards(shards, f"{tag}_sampled", False, *at, {})
        if tag == "end":  # the run's result, with intervals
            from services.evaluate import result_line

            line = result_line(self.report.records.run_dir)
            if line:
                self.report.say(line)
        return crashes

    def _evaluate_shards(
        self, shards: list[list[dict[str, Any]]], tag: str, greedy: bool, step: int,
        version: int, extra: dict[str, Any],
    ) -> int:  # fmt: skip
        from services.evaluate import summarize_eval
        from services.records import EVAL_RECORDS, eval_records

        started = time.perf_counter()
        trajectories, crashes = self.rollout_shards(shards, tag, greedy=greedy)
        summary = summarize_eval(trajectories)
        summary.update(tag=tag, learner_step=step, policy_version=version, **extra)
        summary["wall_s"] = round(time.perf_counter() - started, 3)
        if trajectories:  # the weights that answered, as the engines stamped them
            summary["engine_policy_version_min"] = min(t.policy_version_min for t in trajectories)
            summary["engine_policy_version_max"] = max(t.policy_version_max for t in trajectories)
        self.report.append("eval.jsonl", summary)
        records = eval_records(trajectories, tag, step, self.config().run.record_text_chars)
        self.report.write_records(EVAL_RECORDS, f"eval_samples/{tag}", records, step)
        self.report.say(f"eval ({tag}) validation: {fmt(summary)}")
        return crashes

    def rollout_shards(
        self, shards: list[list[dict[str, Any]]], tag: str, greedy: bool = True
    ) -> tuple[list[Any], int]:
        """Evaluation rollouts of ``shards[i]`` on rollout actor ``i``, all in parallel:
        greedy (one episode per question), or at the rollout temperature
        (``rollout.group_size`` episodes per question); returns (the trajectories, the
        crashes met).

        Raises:
            RuntimeError: actors still crashed after ``ray.max_actor_restarts`` rounds.
            services.loop.fleet.RolloutActorLost: an actor cannot come back.
        """
        cfg = self.config()
        chunk = max(1, cfg.run.eval_batch_questions or cfg.rollout.prompts_per_batch)
        total = sum(len(shard) for shard in shards)
        done, crashes, started = 0, 0, time.perf_counter()
        pending = {i: shard for i, shard in enumerate(shards) if shard}
        trajectories: list[Any] = []
        restarting: set[int] = set()  # actors that crashed and have not answered since
        for _ in range(cfg.ray.max_actor_restarts + 1):
            # each shard in chunks, all queued at once (an actor runs them in order), read
            # back in order per actor so that progress shows as chunks finish
            slots = self.fleet.slots
            queues = {
                i: [(k, slots[i].handle.rollout.remote(shard[k : k + chunk], greedy=greedy))
                    for k in range(0, len(shard), chunk)]
                for i, shard in pending.items()
            }  # fmt: skip
            failed: dict[int, list[dict[str, Any]]] = {}
            while queues:
                heads = {queue[0][1]: i for i, queue in queues.items()}
                ready, _ = ray.wait(list(heads), num_returns=1)
                i = heads[ready[0]]
                k, ref = queues[i].pop(0)
                slot = slots[i]
                outcome = rollout_outcome(lambda ref=ref: ray.get(ref), slot.engine_version)
                # a death counts once, however many of the actor's queued chunks fail
                if outcome.crash is not None and not (outcome.died and i in restarting):
                    self.sync.on_crash(slot, outcome.crash)
                    crashes += 1
                lost, batch = outcome.crash is not None, outcome.trajectories
                restarting.discard(i)
                if lost:
                    restarting.add(i)
                    failed[i] = pending[i][k:]  # this chunk and the ones queued behind it
                    del queues[i]
                    continue
                if not queues[i]:
                    del queues[i]
                trajectories.extend(batch)
                done += len(pending[i][k : k + chunk])
                eta = (time.perf_counter() - started) / done * (total - done)
                self.report.say(f"eval ({tag}) {done}/{total} questions, ETA {fmt_seconds(eta)}")
            if not failed:
                return trajectories, crashes
            for i in failed:  # wait until Ray has restarted them (a dead one fails next round)
                self.fleet.wait_ready(slots[i])
            self.sync.settle()  # the re-synced weights must land first
            pending = failed
        raise RuntimeError(
            f"eval[{tag}]: rollout actors {sorted(pending)} crashed "
            f"{cfg.ray.max_actor_restarts + 1} times in a row"
        )
