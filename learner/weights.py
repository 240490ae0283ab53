"""The learner's weights leaving it: export for the object store, and the collective
weight-sync group's rank 0 (``sync.transport = "collective"``).

:class:`WeightsMixin` is part of :class:`learner.trainer.Learner` (split out by
responsibility); it uses the learner's ``policy_engine``, ``policy_version``, ``rank`` and
``world_size``. Every method is a collective under ZeRO-3 (partitioned parameters are
gathered first): on N ranks every rank calls it.

**Buckets.** Under ZeRO-3 the weights are gathered one bucket at a time
(:func:`weight_buckets`, ``sync.bucket_mb``): every rank takes part in a bucket's all-gather,
rank 0 copies or broadcasts that bucket's tensors, and the bucket is freed before the next
one is gathered, so no rank ever holds more of the full model than one bucket on top of its
own partition (the pattern of OpenRLHF's ``_broadcast_to_vllm`` and verl's sharding
managers). The broadcast plan comes from the parameters' metadata (``ds_shape`` under
ZeRO-3), not from an export.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch import Tensor

DEFAULT_BUCKET_BYTES = 1 << 30
"""Bytes of full (gathered) tensors per bucket when the caller names none: 1 GiB, the
default of ``sync.bucket_mb``."""


class WeightsExport(NamedTuple):
    """Policy weights ready to ship to generation engines.

    Attributes:
        state_dict: HF parameter name -> contiguous CPU tensor, cloned (owns its memory:
            nothing references DeepSpeed's buffers). Tied weights share one clone.
        policy_version: the learner's version of these weights (incremented once per step).
    """

    state_dict: dict[str, Tensor]
    policy_version: int


def full_shape(tensor: Tensor) -> tuple[int, ...]:
    """The tensor's shape as the model sees it: ``ds_shape`` for a ZeRO-3 partitioned
    parameter (whose local ``shape`` is a flat partition or empty), else ``shape``."""
    return tuple(getattr(tensor, "ds_shape", tensor.shape))


def full_bytes(tensor: Tensor) -> int:
    """Bytes of the tensor once gathered (``ds_numel`` under ZeRO-3)."""
    return int(getattr(tensor, "ds_numel", tensor.numel())) * tensor.element_size()


def weight_buckets(module: torch.nn.Module, bucket_bytes: int) -> list[list[tuple[str, Tensor]]]:
    """The module's state-dict entries (HF names, ``keep_vars``: the parameters themselves,
    nothing gathered), each distinct tensor once (a tied alias such as ``lm_head.weight``
    is left out: it is the embedding), in state-dict order, grouped into buckets of at most
    ``bucket_bytes`` gathered bytes. A tensor larger than a bucket is a bucket of its own.

    Raises:
        ValueError: ``bucket_bytes`` < 1.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    buckets: list[list[tuple[str, Tensor]]] = []
    current: list[tuple[str, Tensor]] = []
    size = 0
    seen: set[int] = set()
    for name, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        nbytes = full_bytes(tensor)
        if current and size + nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append((name, tensor))
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


def gathered(tensors: list[Tensor]) -> contextlib.AbstractContextManager:
    """DeepSpeed's ``GatheredParameters`` over the ZeRO-3 partitioned ones among
    ``tensors`` (a collective: every rank enters it with the same list), read-only; a null
    context when none is partitioned."""
    partitioned = [t for t in tensors if hasattr(t, "ds_id")]
    if not partitioned:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None)


def iter_gathered(module: torch.nn.Module, bucket_bytes: int) -> Iterator[tuple[str, Tensor]]:
    """Every distinct weight of ``module`` as ``(HF name, state-dict entry)``, gathered one
    bucket at a time (:func:`weight_buckets`). The entry is the parameter itself (its full
    data while its bucket is gathered; do not modify it): copy or send it before asking
    for the next one, whose bucket may release it. Under ZeRO-3 every rank must consume
    the iterator to its end (each bucket is a collective)."""
    for bucket in weight_buckets(module, bucket_bytes):
        with gathered([tensor for _, tensor in bucket]):
            yield from bucket


class WeightsMixin:
    """Weight export and broadcast of :class:`learner.trainer.Learner`."""

    rank: int
    world_size: int
    policy_engine: Any
    policy_version: int

    def export_weights(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> WeightsExport:
        """The policy's weights as HF-named, contiguous, cloned CPU tensors + its version.

        Clones own their memory (shipping views of DeepSpeed buffers through the Ray object
        store kept those buffers alive: a learner grew to 21 GB). Under ZeRO-3 the
        partitioned parameters are gathered ``bucket_bytes`` at a time (a collective: every
        rank calls this; only rank 0 keeps copies). Tied parameters (SmolLM2's embedding
        and LM head) map to one shared clone, so ``load_state_dict`` of a fresh HF model
        works. On N ranks only rank 0 returns the weights; the other ranks return an empty
        dict (and the same version).
        """
        state = self._module_state(self.policy_engine.module, self.rank == 0, bucket_bytes)
        return WeightsExport(state_dict=state, policy_version=self.policy_version)

    def weight_metas(self) -> list:
        """The broadcast plan: a :class:`actors.weight_group.TensorMeta` per distinct policy
        weight, in :func:`weight_buckets` order, from the parameters' metadata (no gather,
        no copy; the same on every rank)."""
        from actors.weight_group import TensorMeta

        return [
            TensorMeta(name, str(tensor.dtype).removeprefix("torch."), full_shape(tensor))
            for bucket in weight_buckets(self.policy_engine.module, DEFAULT_BUCKET_BYTES)
            for name, tensor in bucket
        ]

    # ------------------------------------------------------------------ collective weight sync

    def weight_group_address(self) -> tuple[str, int]:
        """(node IP, port) where rank 0 hosts the weight-sync group's store
        (``sync.transport = "collective"``, :mod:`actors.weight_group`). The store is bound
        here, on every interface and a port the OS picks, and kept for
        :meth:`join_weight_group`; the address is this node's as Ray knows it
        (:func:`actors.rendezvous.node_ip`), never the hostname's or the default route's."""
        from actors.rendezvous import bind_master_store, node_ip

        self._weight_store = bind_master_store()
        return node_ip(), self._weight_store.port

    def join_weight_group(
        self,
        host: str,
        port: int,
        world_size: int,
        backend: str,
        timeout_s: float,
        join_timeout_s: float = 60.0,
    ) -> list:
        """Rank 0 joins the weight-sync group as its rank 0 (blocks until every engine has
        joined, at most ``join_timeout_s``) and returns the broadcast plan
        (:meth:`weight_metas`); other ranks return ``[]`` (they take part in the ZeRO-3
        gathers of each broadcast only).

        Raises:
            actors.rendezvous.GroupJoinError: the group did not form in time (names who is
                missing)."""
        from actors.weight_group import WeightGroup

        if self.rank != 0:
            return []
        metas = self.weight_metas()
        self.leave_weight_group()
        store, self._weight_store = getattr(self, "_weight_store", None), None
        if store is not None and store.port != port:
            store = None  # an address from another call: bind the port given
        self._weight_group = WeightGroup(
            host, port, 0, world_size, backend, timeout_s, store, join_timeout_s
        )
        self._weight_metas = metas
        return metas

    def leave_weight_group(self) -> None:
        """Leave the weight-sync group, if in one (every member must leave and re-join to
        change its members, e.g. after an engine restarted)."""
        group = getattr(self, "_weight_group", None)
        if group is not None:
            group.close()
        self._weight_group = None

    def broadcast_weights(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> dict[str, float]:
        """Broadcast the policy to the engines bucket by bucket: each bucket is gathered
        (every rank: a collective under ZeRO-3), rank 0 broadcasts its tensors from where
        they are (GPU memory with NCCL; no host copy), and it is freed before the next.
        Returns ``policy_version``, ``export_s`` (0: the gathers overlap the broadcast and
        count in it), ``broadcast_s`` and ``bytes`` (zeros on other ranks).

        Raises:
            RuntimeError: rank 0 is not in a weight-sync group.
        """
        started = time.perf_counter()
        tensors = iter_gathered(self.policy_engine.module, bucket_bytes)
        if self.rank != 0:
            for _ in tensors:  # take part in every bucket's gather
                pass
            return {"policy_version": float(self.policy_version), "export_s": 0.0,
                    "broadcast_s": time.perf_counter() - started, "bytes": 0.0}  # fmt: skip
        group = getattr(self, "_weight_group", None)
        if group is None:
            for _ in tensors:  # the other ranks are in the gathers: finish them, then raise
                pass
            raise RuntimeError("broadcast_weights before join_weight_group")
        sent = group.send(tensors, self._weight_metas, self.policy_version)
        return {
            "policy_version": float(self.policy_version),
            "export_s": 0.0,
            "broadcast_s": time.perf_counter() - started,
            "bytes": float(sent),
        }

    def _module_state(
        self, module: torch.nn.Module, keep: bool, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> dict[str, Tensor]:
        """Full CPU clones of ``module``'s state dict where ``keep``, else ``{}``; under
        ZeRO-3 gathered a bucket at a time (collective: every rank consumes every bucket).
        Tied aliases map to their tensor's clone."""
        clones: dict[int, Tensor] = {}
        for _, tensor in iter_gathered(module, bucket_bytes):
            if keep:
                clones[id(tensor)] = tensor.detach().to("cpu", copy=True).contiguous()
        if not keep:
            return {}
        return {
            name: clones[id(tensor)] for name, tensor in module.state_dict(keep_vars=True).items()
        }

    def _load_module_state(self, module: torch.nn.Module, state: dict[str, Tensor]) -> None:
        """``module.load_state_dict(state)``; under ZeRO-3 inside a gather whose changes
        rank 0 re-partitions (collective: every rank calls it, ``state`` needed on rank 0)."""
        if not self._zero3(module):
            module.load_state_dict(state)
            return
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=0):
            if self.rank == 0:
                module.load_state_dict(state)

    @staticmethod
    def _zero3(module: torch.nn.Module) -> bool:
        return any(hasattr(p, "ds_id") for p in module.parameters())
