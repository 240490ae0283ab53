"""Exact staleness: engines hold the weights exactly ``k`` learner versions behind.

With ``sync.fixed_lag = true`` the driver exports the learner's weights after every learner
step (as usual) but pushes to the engines the export of version ``v - k`` (``k`` =
``buffer.max_staleness``), kept in the Ray object store since then. With the staleness-aware
admission of :mod:`learner.admission`, an engine at version ``e = V - k`` may start at most
``(e + k + 1 - V) * B = B`` trajectories, which the step at ``V`` takes: every batch is
generated ``k`` versions before the step that trains on it, so the realised staleness is
exactly ``k`` from the ``k``-th learner step on, and ``min(step index, k)`` before (there is
no older policy than the first one). The driver logs the staleness of every consumed
trajectory (``consumed.jsonl``: ``staleness``), and ``tests/integration/test_stability.py``
checks it.

The loop is then synchronous (generation and learning alternate); that is the price of an
exact lag here. Measured on the synthetic grid: 0.53 s learner + 0.31 s rollout = 0.85 s
per step, one of two cores idle, which is why ``stppo experiment stability`` runs two grid
runs side by side (``parallel_runs``). For ``k >= 1`` the two could overlap: with engines
``k - 1`` versions behind, the batch of the step at ``V + 1`` (version ``V + 1 - k``) can be
generated while the step at ``V`` trains; admission already caps each version at one batch
then, but the first ``k`` steps' staleness pattern changes. Not done. Without it, ``buffer.max_staleness`` is only a bound: the realised staleness
depends on how fast rollouts and learner steps are (0, 1, 2, 3, then 4 in the PPO vs ST-PPO
experiment).

Interruptible generation (``rollout.interrupt_every_tokens > 0``) is refused with a fixed
lag (a config error): an update landing mid-batch would make the batch's later tokens
fresher than ``k``, so the lag would no longer be exact.

Memory: ``k + 1`` exported state dicts live in the object store (one per version still to
be pushed). Object-store transport only.
"""

from __future__ import annotations

import time
from typing import Any

from services.weight_sync import SyncHandle, engine_weights_call, export_to_object_store


class LaggedWeightSync:
    """Exports every version, pushes the one ``lag`` versions older (module docstring)."""

    def __init__(self) -> None:
        self._exports: dict[int, Any] = {}

    def push(self, learner: Any, engines: list[Any], policy_version: int, lag: int) -> SyncHandle:
        """Export the learner's weights (version ``policy_version``; once: a second push of
        a version reuses its export), then queue on every engine the load of version
        ``max(first exported, policy_version - lag)``. ``lag = 0`` loads ``policy_version``
        itself (the final evaluation's push).

        Returns:
            The :class:`SyncHandle` of the version pushed (``policy_version`` is that
            lagged version, ``export_s`` the export time of this call).

        Raises:
            RuntimeError: the learner exported another version than ``policy_version``.
            ValueError: ``lag < 0``.
        """
        if lag < 0:
            raise ValueError(f"lag must be >= 0, got {lag}")
        started = time.perf_counter()
        export_s = 0.0
        if policy_version not in self._exports:  # an exact push after the lagged one
            self._exports[policy_version], export_s = export_to_object_store(
                learner, policy_version
            )
        target = max(min(self._exports), policy_version - lag)
        # versions older than the target are never pushed again
        for v in [v for v in self._exports if v < target]:
            del self._exports[v]
        version = max(v for v in self._exports if v <= target)
        handle = SyncHandle(version, export_s, [], self._exports[version], started)
        handle.acks = [
            engine_weights_call(e, "load_weights").remote(handle.weights_ref, version)
            for e in engines
        ]
        return handle

    def push_to(self, handle: SyncHandle, engines: list[Any]) -> list[Any]:
        """Re-send an already pushed version to some engines (restarted ones)."""
        return [
            engine_weights_call(e, "load_weights").remote(handle.weights_ref, handle.policy_version)
            for e in engines
        ]
