"""The learner's weights leaving it: export for the object store, and the collective
weight-sync group's rank 0 (``sync.transport = "collective"``).

:class:`WeightsMixin` is part of :class:`learner.trainer.Learner` (split out by
responsibility, issue 31); it uses the learner's ``policy_engine``, ``policy_version``,
``rank`` and ``world_size``. Every method is a collective under ZeRO-3 (partitioned
parameters are gathered first): on N ranks every rank calls it.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import torch
from torch import Tensor


class WeightsExport(NamedTuple):
    """Policy weights ready to ship to generation engines.

    Attributes:
        state_dict: HF parameter name -> contiguous CPU tensor, cloned (owns its memory:
            nothing references DeepSpeed's buffers). Tied weights share one clone.
        policy_version: the learner's version of these weights (incremented once per step).
    """

    state_dict: dict[str, Tensor]
    policy_version: int


class WeightsMixin:
    """Weight export and broadcast of :class:`learner.trainer.Learner`."""

    rank: int
    world_size: int
    policy_engine: Any
    policy_version: int

    def export_weights(self) -> WeightsExport:
        """The policy's weights as HF-named, contiguous, cloned CPU tensors + its version.

        Clones own their memory (shipping views of DeepSpeed buffers through the Ray object
        store kept those buffers alive: a learner grew to 21 GB). Under ZeRO-3 the
        partitioned parameters are gathered first (a collective: every rank calls this).
        Tied parameters (SmolLM2's embedding and LM head) map to one shared clone, so
        ``load_state_dict`` of a fresh HF model works. On N ranks only rank 0 returns the
        weights; the other ranks return an empty dict (and the same version).
        """
        state = self._module_state(self.policy_engine.module, self.rank == 0)
        return WeightsExport(state_dict=state, policy_version=self.policy_version)

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
        joined, at most ``join_timeout_s``) and returns the broadcast plan (a
        :class:`actors.weight_group.TensorMeta` per exported tensor); other ranks take part
        in the export only (ZeRO-3 gathers) and return ``[]``.

        Raises:
            actors.rendezvous.GroupJoinError: the group did not form in time (names who is
                missing)."""
        from actors.weight_group import WeightGroup, tensor_metas

        metas = tensor_metas(self.export_weights().state_dict)
        if self.rank != 0:
            return []
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

    def broadcast_weights(self) -> dict[str, float]:
        """Export the policy (collective under ZeRO-3) and, on rank 0, broadcast it to the
        engines tensor by tensor; returns ``policy_version``, ``export_s``, ``broadcast_s``
        and ``bytes`` (zeros on other ranks).

        Raises:
            RuntimeError: rank 0 is not in a weight-sync group.
        """
        started = time.perf_counter()
        export = self.export_weights()
        export_s = time.perf_counter() - started
        if self.rank != 0:
            return {"policy_version": float(self.policy_version), "export_s": export_s,
                    "broadcast_s": 0.0, "bytes": 0.0}  # fmt: skip
        group = getattr(self, "_weight_group", None)
        if group is None:
            raise RuntimeError("broadcast_weights before join_weight_group")
        started = time.perf_counter()
        sent = group.send(export.state_dict, self._weight_metas, export.policy_version)
        return {
            "policy_version": float(export.policy_version),
            "export_s": export_s,
            "broadcast_s": time.perf_counter() - started,
            "bytes": float(sent),
        }

    def _module_state(self, module: torch.nn.Module, keep: bool) -> dict[str, Tensor]:
        """Full CPU clones of ``module``'s state dict where ``keep``, else ``{}``; gathers
        ZeRO-3 partitions first (collective)."""
        state: dict[str, Tensor] = {}
        clones: dict[int, Tensor] = {}
        with self._gathered(module):
            if not keep:
                return state
            for name, tensor in module.state_dict().items():
                key = tensor.data_ptr()
                if key not in clones:
                    clones[key] = tensor.detach().to("cpu", copy=True).contiguous()
                state[name] = clones[key]
        return state

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

    def _gathered(self, module: torch.nn.Module) -> Any:
        import contextlib

        if not self._zero3(module):
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None)
