"""Weight synchronisation learner -> rollout engines, behind one Protocol.

Versioned and in memory: the learner exports its weights once per sync (contiguous CPU
clones, HF parameter names) together with its ``policy_version``; every engine loads them
between two generation batches. A Ray actor runs its method calls one at a time in
submission order, so ``load_weights`` queued behind a running ``rollout`` waits for that
batch to finish: weights never change mid-token, and a trajectory's
``policy_version_min/max`` records which weights produced it.

Transports:

- :class:`ObjectStoreWeightSync` (CPU, default): the state dict goes into the Ray object
  store once (``export_weights`` returns it) and each engine pulls it by reference.
- NCCL broadcast (GPU; ``sync.transport = "nccl"``), design: the learner rank and every
  engine's worker join one ``torch.distributed`` group created after the actors start
  (``init_process_group`` with a TCP store on the learner's node); ``push`` sends the version
  and a flat list of (name, dtype, shape) through the object store, then broadcasts each
  tensor from the learner rank on the GPU, and engines copy into their parameters in place
  (vLLM: ``collective_rpc`` to the worker's ``load_weights``). Same :class:`WeightSync`
  Protocol, no host round trip. Not built yet: choosing it fails at start with a clear error.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass
class SyncHandle:
    """A sync in progress: one acknowledgement per engine (each returns its load seconds).

    Attributes:
        policy_version: the version being pushed.
        export_s: seconds the learner spent exporting (cloning) its weights.
        acks: Ray object refs, one per engine, resolving to that engine's load seconds.
        weights_ref: the object-store reference of the exported state dict (kept so engines
            restarted after a crash can be re-synced without another export).
        started_s: ``time.perf_counter()`` when the sync was issued.
    """

    policy_version: int
    export_s: float
    acks: list[Any]
    weights_ref: Any
    started_s: float


class WeightSync(Protocol):
    """Moves the learner's weights into the engines."""

    def push(self, learner: Any, engines: list[Any], policy_version: int) -> SyncHandle:
        """Export the learner's weights and queue a load on every engine (non-blocking)."""
        ...

    def push_to(self, handle: SyncHandle, engines: list[Any]) -> list[Any]:
        """Re-send an already exported version to some engines (e.g. restarted ones)."""
        ...


class ObjectStoreWeightSync:
    """Ray object store transport (see module docstring)."""

    def push(self, learner: Any, engines: list[Any], policy_version: int) -> SyncHandle:
        import ray

        started = time.perf_counter()
        weights_ref, version_ref = learner.export_weights.options(num_returns=2).remote()
        exported_version = ray.get(version_ref)
        if exported_version != policy_version:
            raise RuntimeError(
                f"learner exported policy_version {exported_version}, driver expected {policy_version}"
            )
        export_s = time.perf_counter() - started
        handle = SyncHandle(policy_version, export_s, [], weights_ref, started)
        handle.acks = self.push_to(handle, engines)
        return handle

    def push_to(self, handle: SyncHandle, engines: list[Any]) -> list[Any]:
        return [e.load_weights.remote(handle.weights_ref, handle.policy_version) for e in engines]


def make_weight_sync(transport: str) -> WeightSync:
    """The transport named in ``sync.transport``.

    Raises:
        NotImplementedError: ``nccl`` (designed above, not built yet).
    """
    if transport == "object_store":
        return ObjectStoreWeightSync()
    if transport == "nccl":
        raise NotImplementedError(
            "sync.transport = 'nccl' is designed (services/weight_sync.py) but not built yet; "
            "use 'object_store'"
        )
    raise ValueError(f"unknown weight-sync transport {transport!r}")
