"""A checkpoint loaded into the running job: the resume at the start (:meth:`Restore.load`)
and the stability guard's rollback in the middle of a run (:meth:`Restore.rollback`), which
shares the resume's code path.

A rollback runs in the driver's process, at a step boundary (no learner step in flight),
without restarting Ray:

1. wait for the weight loads and the rollout calls in flight; what the calls made, and what
   the buffer holds, is dropped (the abandoned policy made it, from draws after the
   checkpoint: the sampler draws them again);
2. load the checkpoint as a resume does (policy, critic, optimizer states, reference,
   step, sampler position) under a new policy version: engines never load a decreasing
   version, so the restored weights are published as the next one;
3. make it the checkpoint ``latest`` and ``last_good`` name, and delete the later ones
   (:func:`rewind_checkpoints`);
4. move the record lines written after it to ``superseded/``, except :data:`KEPT_RECORDS`;
5. put the live config (not the checkpoint's) back into effect and push the weights;
6. put the guard's windows back to the checkpoint's (its budgets stay).

The driver then takes the restored counters, applies the guard's change and checkpoints
the result, so that a resume from there keeps the rollback, its budget and the change.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray

from services.atomic import write_atomic
from services.config import RunConfig
from services.loop.autopilot import GUARD_LOG
from services.loop.checkpoint import (
    LAST_GOOD,
    LATEST,
    CheckpointStore,
    DriverState,
    checkpoint_problem,
    step_of,
)
from services.loop.live_config import apply_config

KEPT_RECORDS = (GUARD_LOG, "config_changes.jsonl")
"""Record files a rollback keeps whole: what the guard decided, and the live changes, which
still hold."""


def rewind_checkpoints(store: CheckpointStore, path: Path) -> list[str]:
    """Make checkpoint ``path`` the one ``latest`` and ``last_good`` name and delete every
    checkpoint folder of a later step (complete or partial: the abandoned policy's);
    returns the names deleted.

    Raises:
        ValueError: ``path`` is not a complete checkpoint of ``store``.
    """
    path = Path(path)
    if path.parent != store.root or checkpoint_problem(path) is not None:
        raise ValueError(f"{path} is not a complete checkpoint in {store.root}")
    write_atomic(store.root / LATEST, path.name)
    write_atomic(store.root / LAST_GOOD, path.name)
    step = step_of(path)
    removed = []
    for later in sorted(store.root.glob("step_*")):
        if later.is_dir() and step_of(later) > step:
            shutil.rmtree(later, ignore_errors=True)
            removed.append(later.name)
    store.last_saved_step = step
    return removed


class Restore:
    """Loads checkpoints into the running job (module docstring).

    Args:
        checkpoints: the run's :class:`services.loop.checkpoint.CheckpointStore`.
        parts: :class:`services.loop.parts.Parts` (learner, sampler, fleet, sync, pipeline,
            targets, report).
        records: the run's :class:`services.run_records.RecordWriter`.
        autopilot: the run's :class:`services.loop.autopilot.Autopilot`.
    """

    def __init__(
        self, checkpoints: CheckpointStore, parts: Any, records: Any, autopilot: Any
    ) -> None:
        self.checkpoints = checkpoints
        self.parts = parts
        self.records = records
        self.autopilot = autopilot

    def load(
        self, path: Path, policy_version: int | None = None
    ) -> tuple[DriverState, dict[str, Any] | None]:
        """Load checkpoint ``path`` into the learner (its version renumbered to
        ``policy_version`` unless None) and the sampler's position; returns (its driver
        state, its saved config or None).

        Raises:
            FileNotFoundError, ValueError: the learner cannot load it
                (:meth:`learner.checkpoint.CheckpointMixin.load_checkpoint`).
        """
        p = self.parts
        ray.get(p.learner.load_checkpoint.remote(str(path), policy_version=policy_version))
        state, saved = self.checkpoints.load(path)
        self.checkpoints.last_saved_step = state.learner_step  # it is on disk already
        p.sampler.num_drawn = state.questions_drawn
        return state, saved

    def rollback(
        self,
        decision: Any,
        state: DriverState,
        cfg: RunConfig,
        on_crash: Callable[[Any, BaseException], None],
    ) -> DriverState:
        """Roll the job back to the checkpoint of the guard's ``decision``
        (:attr:`services.loop.guard.Decision.rollback`; module docstring, 1-6) from the
        driver's ``state``, under the live config ``cfg``; ``on_crash(slot, error)`` handles
        an actor that crashed in a rollout waited for. Returns the restored driver state.

        Raises:
            FileNotFoundError, ValueError: the checkpoint cannot be loaded.
            services.loop.fleet.RolloutActorLost: an actor cannot come back.
        """
        p = self.parts
        path = self.checkpoints.root / decision.rollback["checkpoint"]
        version = state.policy_version + 1
        p.sync.rewind()
        dropped = self._drain(on_crash) + p.pipeline.buffer.clear()
        restored, _ = self.load(path, policy_version=version)
        removed = rewind_checkpoints(self.checkpoints, path)
        restored.policy_version, restored.actor_restarts = version, state.actor_restarts
        self.records.supersede_after(restored.record_lines, except_files=KEPT_RECORDS)
        apply_config(None, cfg, p.targets, version)  # the live config, not the saved one
        p.sync.push(version, blocking=True)
        self.autopilot.rewind(restored, cfg, self.checkpoints)
        p.report.say(
            f"rolled back from step {state.learner_step} to {path.name} (step "
            f"{restored.learner_step}, now policy_version {version}); {dropped} trajectories "
            "dropped" + (f"; deleted {', '.join(removed)}" if removed else "")
        )
        return restored

    def _drain(self, on_crash: Callable[[Any, BaseException], None]) -> int:
        """Wait for every rollout call in flight and drop what it made; returns the
        trajectories dropped."""
        fleet, dropped = self.parts.fleet, 0
        for slot in list(fleet.slots):
            for call in list(slot.running):
                outcome = fleet.finish(slot, call)
                if outcome.crash is not None:
                    on_crash(slot, outcome.crash)
                if outcome.died:  # every call running on it is lost
                    break
                dropped += len(outcome.trajectories)
        return dropped
