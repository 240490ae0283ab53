"""Checkpoints of the learner: DeepSpeed states of policy and critic, the learner's
counters, and HF folders of the policy (and of the reference once it is no longer the base
model).

:class:`CheckpointMixin` is part of :class:`learner.trainer.Learner` (split out by
responsibility, issue 31); it uses the learner's engines, counters, tokenizer and
:class:`learner.weights.WeightsMixin` (gathered exports under ZeRO-3).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from learner.weights import WeightsMixin


class CheckpointMixin(WeightsMixin):
    """:meth:`save_checkpoint` and :meth:`load_checkpoint` of :class:`learner.trainer.Learner`."""

    config: Any
    critic_engine: Any
    reference_engine: Any
    reference_version: int | None
    global_step: int
    nonfinite_steps_total: int
    algorithm: Any
    tokenizer: Any
    set_algorithm: Callable[[Any], None]

    def save_checkpoint(self, directory: str | Path) -> Path:
        """Save policy and critic (weights, optimizer state), step and version, plus an HF
        folder of the policy (``<directory>/hf_policy``, loadable by ``from_pretrained``).

        Layout: ``policy/`` and ``critic/`` (DeepSpeed checkpoints), ``learner_state.json``,
        ``hf_policy/``, and ``hf_reference/`` when the reference is no longer the base model
        (:meth:`reset_reference_to_policy`). Returns ``directory``.

        On N ranks every rank calls it with the same (shared) ``directory``: DeepSpeed writes
        each rank's optimizer partition, rank 0 the gathered HF folders and
        ``learner_state.json`` (which records ``num_ranks`` and ``zero_stage``).
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tag = f"step_{self.global_step}"
        self.policy_engine.save_checkpoint(str(directory / "policy"), tag=tag)
        self.critic_engine.save_checkpoint(str(directory / "critic"), tag=tag)
        state = {
            "global_step": self.global_step,
            "policy_version": self.policy_version,
            "nonfinite_steps_total": self.nonfinite_steps_total,
            "algorithm": self.algorithm.model_dump(),
            "tag": tag,
            "num_ranks": self.world_size,
            "zero_stage": self.config.zero_stage,
        }
        export = self.export_weights()
        reference = None
        if self.reference_version is not None:  # not the base model: it cannot be reloaded
            reference = self._module_state(self.reference_engine.module, self.rank == 0)
        if self.rank == 0:
            hf_dir = directory / "hf_policy"
            self.policy_engine.module.save_pretrained(hf_dir, state_dict=export.state_dict)
            self.tokenizer.save_pretrained(hf_dir)
            if reference is not None:
                self.reference_engine.module.save_pretrained(
                    directory / "hf_reference", state_dict=reference
                )
            state["reference_version"] = self.reference_version
            (directory / "learner_state.json").write_text(json.dumps(state, indent=2))
        self._barrier()
        return directory

    def _barrier(self) -> None:
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier()

    def load_checkpoint(self, directory: str | Path, policy_version: int | None = None) -> None:
        """Restore what :meth:`save_checkpoint` wrote (weights, optimizer states, step,
        version, algorithm).

        ``policy_version``: number the restored weights with this version instead of the
        saved one (a rollback: the engines never load a decreasing version, so the restored
        policy is published as a new one; None: the saved version).

        Resuming needs the ``num_ranks`` and ``zero_stage`` the checkpoint was written with
        (DeepSpeed stores one optimizer partition per rank); another value fails here,
        before anything is loaded. Checkpoints older than these fields count as 1 rank.

        Raises:
            FileNotFoundError: ``learner_state.json`` or a DeepSpeed checkpoint is missing.
            ValueError: the checkpoint was written with another ``num_ranks`` or
                ``zero_stage``.
        """
        directory = Path(directory)
        state_path = directory / "learner_state.json"
        if not state_path.exists():
            raise FileNotFoundError(f"{state_path} not found: not a learner checkpoint")
        state = json.loads(state_path.read_text())
        saved_ranks = int(state.get("num_ranks", 1))
        saved_stage = state.get("zero_stage", self.config.zero_stage)
        if saved_ranks != self.world_size or saved_stage != self.config.zero_stage:
            raise ValueError(
                f"{directory} was written with learner.num_ranks = {saved_ranks}, "
                f"learner.zero_stage = {saved_stage}; this run has num_ranks = "
                f"{self.world_size}, zero_stage = {self.config.zero_stage}. Resume with the "
                "same values (the optimizer state is partitioned per rank), or start a new "
                "run from its hf_policy/ folder (model.path)"
            )
        for name, engine in (("policy", self.policy_engine), ("critic", self.critic_engine)):
            path, _ = engine.load_checkpoint(str(directory / name), tag=state["tag"])
            if path is None:
                raise FileNotFoundError(
                    f"no DeepSpeed checkpoint {state['tag']} in {directory / name}"
                )
        reference_version = state.get("reference_version")
        if reference_version is not None:
            from transformers import AutoModelForCausalLM

            saved = AutoModelForCausalLM.from_pretrained(
                directory / "hf_reference", dtype=self.reference_engine.module.dtype
            )
            self._load_module_state(self.reference_engine.module, saved.state_dict())
        self.reference_version = reference_version
        self.global_step = int(state["global_step"])
        saved_version = int(state["policy_version"])
        self.policy_version = saved_version if policy_version is None else int(policy_version)
        self.nonfinite_steps_total = int(state["nonfinite_steps_total"])
        self.set_algorithm(state["algorithm"])
