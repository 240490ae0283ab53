"""The run configuration: one typed tree, loaded from TOML with dotted overrides.

``RunConfig`` composes the sections that live next to the code they configure
(``learner.config``, ``actors.config``, ``retrieval_server.config``) with the process-layer
sections defined here. Loading never imports torch or ray.

Example::

    cfg = load_config("deploy/configs/cpu_demo.toml", ["learner.actor_lr=1e-5", "algorithm.variant=ppo"])

Errors: :class:`ConfigError` with one line per problem, each naming the dotted field
(``learner.actor_lr: Input should be greater than 0``).
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from actors.config import RolloutConfig
from learner.admission import required_capacity
from learner.buffer import BufferLimits
from learner.config import (
    NULL,
    VARIANT_CONFIGS,
    AlgorithmConfig,
    LearnerConfig,
    SFTConfig,
    STPPOConfig,
    StrictModel,
)
from retrieval_server.config import RetrievalServerConfig
from services.retrieval_supervisor import RetrievalSupervisorConfig
from services.tracking import TrackingConfig


class ConfigError(ValueError):
    """A config file or override is invalid; the message names every offending field."""


class RunSection(StrictModel):
    """Identity and length of the run."""

    name: str = Field("stppo", min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$")
    """Run name; outputs go to ``<output_dir>/<name>``."""

    output_dir: Path = Path("runs")
    """Parent folder of run directories (JSONL logs, checkpoints, plots)."""

    seed: int = Field(0, ge=0)
    """Seed for data order, sampling and initialisation."""

    label: str = Field("", max_length=128)
    """Free-text label of the run, kept in ``config.json`` (an experiment writes the name of
    the run's method here: ``stppo experiment`` grids with a ``method`` axis)."""

    num_steps: int = Field(20, ge=0, le=10_000_000)
    """Learner steps to run (0 = warm start and evaluation only)."""

    eval_every: int = Field(0, ge=0)
    """Evaluate on the validation split every this many steps (0 = only at start and end):
    after learner step ``N`` with ``N % eval_every == 0`` and ``N < num_steps`` (the end
    evaluation covers the last), greedily on the same questions, tag ``step_<N>``. The
    rollouts in flight finish first (their trajectories stay in the buffer) and the step's
    weights are pushed to every engine; ``eval.jsonl`` records the seconds of both
    (``wait_s``) and of the evaluation (``wall_s``). Refused with ``sync.fixed_lag``."""

    eval_questions: int = Field(64, ge=0, le=1_000_000)
    """Validation questions per evaluation (0 disables evaluation)."""

    eval_batch_questions: int = Field(0, ge=0, le=100_000)
    """Questions per evaluation rollout call, decoded together by one engine (0 =
    ``rollout.prompts_per_batch``, as a training batch). More per call keeps a CPU engine's
    decode batch full (an evaluation is all decode), at the cost of coarser progress lines;
    the KV cache queues what does not fit."""

    eval_before_warm_start: bool = True
    """Evaluate the base model before the warm start (tag ``before_warm_start``). A base
    model that never writes the answer format scores 0 here whatever it knows; a run that
    reports its gain from the warm start on can skip it."""

    eval_sampled: bool = False
    """Also evaluate the sampling policy: every evaluation runs a second time on the same
    questions at the rollout temperature, ``rollout.group_size`` episodes per question,
    logged with the tag ``<tag>_sampled`` (``eval.jsonl``, ``eval_samples.jsonl``). Greedy
    decoding shows a change only where an argmax flips; the sampled success is what RL
    maximises, measured on held-out questions."""

    samples_per_step: int = Field(2, ge=0, le=1024)
    """Trained trajectories per learner step written in full to ``samples.jsonl`` (and the
    trackers), chosen at random among the step's batch (0 = none)."""

    record_text_chars: int = Field(2000, ge=16, le=1_000_000)
    """Cap on the characters of each text (question, each turn's policy text) kept in
    ``eval_samples.jsonl`` and ``samples.jsonl``; each record states the cap and which
    texts it cut."""

    resume: Literal["never", "auto", "must"] = "never"
    """What a start does with a run directory that already holds a run: ``never`` refuses it
    (new runs only), ``auto`` resumes from its latest checkpoint if there is one and starts
    otherwise (the cluster configs: a retried job continues), ``must`` resumes and fails
    without a checkpoint (``stppo train --resume``). See services/run_records.py."""


class ModelSection(StrictModel):
    """The policy model every component starts from."""

    path: Path = Path("data/model/smollm2-135m-instruct")
    """Local Hugging Face causal-LM folder (weights, config, tokenizer with a chat template;
    the default is built by ``stppo prepare``), or a hub id ``org/name`` downloaded once when
    online (see :mod:`services.model_source`)."""

    revision: str | None = None
    """Hub revision (branch, tag or commit) of a hub id ``path``; unused for a folder."""


class DataSection(StrictModel):
    """The QA sets questions are drawn from: the built-in sets (``qa_dir`` + ``datasets``),
    or your own files (``train_files`` ...), which then replace them."""

    qa_dir: Path = Path("data/qa")
    """Folder with ``<dataset>/{train,validation,test}.jsonl`` in Search-R1 format."""

    datasets: list[Literal["single_hop", "multi_hop", "medical_mc"]] = Field(
        default_factory=lambda: ["single_hop", "multi_hop", "medical_mc"], min_length=1
    )
    """Built-in QA sets mixed into training (uniformly by set); unused with ``train_files``."""

    train_files: list[Path] = Field(default_factory=list)
    """Your own training QA files (``.jsonl`` or ``.parquet``, Search-R1 records: see
    :mod:`services.qa_data`); each file is one set, mixed uniformly. Empty = built-in sets."""

    validation_files: list[Path] = Field(default_factory=list)
    """Validation QA files (evaluations during training); required with ``train_files``
    unless ``run.eval_questions = 0``."""

    test_files: list[Path] = Field(default_factory=list)
    """Test QA files (``stppo eval --split test``)."""

    warm_start_share: float = Field(0.0, ge=0.0, lt=1.0)
    """Share of every training QA set kept for the warm start's demonstrations, which RL
    then never draws (0: both draw from the whole split). A question goes to a side by a
    stable hash of its entity (``metadata.entity`` where the record names one, so every
    question about one entity lands on the same side; else its ``id``), not by the seed, so
    a resumed or re-seeded run splits alike. Use it when RL should improve what the warm
    start did not already teach question by question (the synthetic task:
    ``deploy/configs/experiments/stability_regime_split.toml``)."""

    @field_validator("train_files", "validation_files", "test_files")
    @classmethod
    def _check_qa_suffixes(cls, value: list[Path]) -> list[Path]:
        for path in value:
            if path.suffix not in (".jsonl", ".parquet"):
                raise ValueError(f"{path}: a QA file must end in .jsonl or .parquet")
        return value

    @model_validator(mode="after")
    def _check_files_given_together(self) -> DataSection:
        if not self.train_files and (self.validation_files or self.test_files):
            raise ValueError("validation_files / test_files need train_files too")
        return self

    @property
    def uses_files(self) -> bool:
        """True when the QA sets come from ``*_files`` rather than ``qa_dir``."""
        return bool(self.train_files)


class RetrievalSection(StrictModel):
    """Where the retrieval server is."""

    url: str | None = None
    """Base URL of an external server; None starts a managed local server from ``server``."""

    server: RetrievalServerConfig = RetrievalServerConfig()
    """Settings of the managed server."""

    supervisor: RetrievalSupervisorConfig = RetrievalSupervisorConfig()
    """Restarts of the managed server when its process exits (unused with ``url``)."""


class BufferConfig(StrictModel):
    """The staleness-tagged trajectory buffer between actors and learner."""

    max_staleness: int = Field(1, ge=0, le=10_000)
    """Largest ``learner_version - policy_version`` accepted at consume time; 0 = on-policy
    (synchronous). Live-tunable."""

    stale_policy: Literal["drop", "keep"] = "drop"
    """What to do with a trajectory over the bound: drop and count it, or keep it and record
    its staleness."""

    capacity: int = Field(64, ge=1, le=10_000_000)
    """Maximum trajectories held (a safety cap). Staleness-aware admission
    (:mod:`learner.admission`) never has more than ``(max_staleness + 1) *
    learner.train_batch_size`` unconsumed, so the buffer's effective capacity is
    ``max(capacity, (max_staleness + 1) * train_batch_size)``, re-derived on live changes."""


class SyncConfig(StrictModel):
    """Weight synchronisation learner -> engines."""

    every_k_steps: int = Field(1, ge=1, le=10_000)
    """Push new weights after every k learner steps; at most ``buffer.max_staleness + 1``
    (engines that lag more could start nothing in bound: deadlock)."""

    transport: Literal["object_store", "collective"] = "object_store"
    """``object_store``: the learner exports once into Ray's object store and each engine
    pulls it. ``collective``: learner rank 0 and every engine form one process group and the
    weights are broadcast tensor by tensor (nccl when the learner has GPUs, gloo otherwise;
    :mod:`services.weight_sync`)."""

    bucket_mb: int = Field(1024, ge=1, le=65_536)
    """Weights leave the learner this many MiB at a time: under ZeRO-3 each bucket is
    gathered, sent (or copied, for the object store) and freed before the next, so a rank
    holds at most one bucket of the full model beyond its partition; with ``collective``
    each engine loads every tensor as it arrives (no second copy of the model on either
    side)."""

    collective_timeout_s: float = Field(1800.0, gt=0.0, le=86_400.0)
    """``collective``: how long a member waits for the others in one broadcast. An engine
    takes part at its rollout's next safe point (``rollout.interrupt_every_tokens``), or
    when its current generation batch ends (0), so this bounds a batch."""

    join_timeout_s: float = Field(60.0, gt=0.0, le=3_600.0)
    """``collective``: how long forming the group may take (learner and every engine
    connect to each other). A group that does not form stops the run with an error naming
    the member that did not join and its address (:mod:`actors.rendezvous`); the driver
    prints who has joined while it waits."""

    fixed_lag: bool = False
    """Exact staleness (:mod:`services.lagged_sync`): engines hold the weights exactly
    ``buffer.max_staleness`` versions behind the learner, so every consumed trajectory has
    staleness ``max_staleness`` (``min(step, max_staleness)`` in the first steps); generation
    and learning alternate. Needs ``every_k_steps = 1`` and the object-store transport."""

    @model_validator(mode="after")
    def _check_fixed_lag(self) -> SyncConfig:
        if self.fixed_lag and (self.every_k_steps != 1 or self.transport != "object_store"):
            raise ValueError(
                "fixed_lag needs every_k_steps = 1 and transport = 'object_store' "
                f"(got {self.every_k_steps}, {self.transport!r})"
            )
        return self


class ControlConfig(StrictModel):
    """The control plane (FastAPI): status and live config changes."""

    enabled: bool = True
    """Serve the control plane during training."""

    host: str = "127.0.0.1"
    """Bind address."""

    port: int = Field(8365, ge=0, le=65535)
    """Bind port (0 = pick a free one)."""

    token: str | None = Field(None, min_length=16)
    """Bearer token; None generates one per run, written to ``<run_dir>/control.json`` (mode
    0600, never printed). Redacted from ``config.json`` and ``/status``."""


class MetricsConfig(StrictModel):
    """Prometheus export."""

    enabled: bool = True
    """Serve ``/metrics``."""

    host: str = "127.0.0.1"
    """Bind address of the metrics endpoint."""

    port: int = Field(9464, ge=0, le=65535)
    """Port of the metrics endpoint (0 = pick a free one)."""


class CheckpointConfig(StrictModel):
    """Checkpoints (also written on SIGTERM)."""

    every_k_steps: int = Field(10, ge=0)
    """Checkpoint every k learner steps (0 = only at the end and on SIGTERM)."""

    keep_last: int = Field(2, ge=1)
    """Checkpoints kept on disk."""


_RAY_PREDEFINED_RESOURCES = frozenset({"CPU", "GPU", "memory", "object_store_memory"})


class RayConfig(StrictModel):
    """The Ray cluster and the resources of each actor."""

    address: str | None = None
    """Existing cluster to join (``auto`` on KubeRay); None starts a local one."""

    num_cpus: int | None = Field(None, ge=1)
    """CPUs of the local cluster (None = all)."""

    rollout_actor_cpus: float = Field(1.0, gt=0.0)
    """CPUs reserved per rollout actor."""

    rollout_actor_gpus: float = Field(0.0, ge=0.0)
    """GPUs reserved per rollout actor."""

    learner_cpus: float = Field(1.0, gt=0.0)
    """CPUs reserved per learner rank (one placement-group bundle each)."""

    learner_gpus: float = Field(0.0, ge=0.0)
    """GPUs reserved per learner rank (1 on GPU nodes: ``learner.num_ranks`` GPUs in all)."""

    learner_threads: int = Field(0, ge=0, le=1024)
    """torch/OpenMP threads of each learner rank (``OMP_NUM_THREADS`` in its runtime env);
    0: ``learner_cpus`` rounded (at least 1), set explicitly as well. Above ``learner_cpus`` the
    learner also uses cores reserved for the rollout actors: worth it where they idle most
    of a step (the main job's rollout takes ~7 s of a ~45 s step), at the price of the two
    competing while both run."""

    rollout_actor_resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources per rollout actor (name -> amount > 0), e.g. ``{stppo_rollout = 1}``:
    the rollout worker group advertises them (``rayStartParams.resources``), so the actors
    land on its nodes only. Empty = any node with the CPUs/GPUs."""

    learner_resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources of the learner actor (name -> amount > 0), e.g.
    ``{stppo_learner = 1}``: pins it to the learner worker group. Empty = any node."""

    @field_validator("rollout_actor_resources", "learner_resources")
    @classmethod
    def _check_custom_resources(cls, value: dict[str, float]) -> dict[str, float]:
        for name, amount in value.items():
            if name in _RAY_PREDEFINED_RESOURCES:
                raise ValueError(f"{name!r} is set by *_cpus / *_gpus, not as a custom resource")
            if not amount > 0:
                raise ValueError(f"custom resource {name!r} must be > 0, got {amount}")
        return value

    max_rollout_actors: int | None = Field(None, ge=1)
    """Most rollout actors the cluster can hold. None = derived from the Ray cluster's
    resources when the job starts (:func:`services.ray_actors.rollout_actor_capacity`); set
    it where the cluster autoscales (KubeRay: the rollout group's ``maxReplicas`` x actors
    per pod), since the nodes are not there yet at start. A ``rollout.num_actors`` above it
    fails at start and is refused live with 422, instead of leaving actors pending."""

    learner_join_timeout_s: float = Field(120.0, gt=0.0, le=3_600.0)
    """``learner.num_ranks > 1``: how long forming the learner ranks' process group may
    take, separate from its per-collective timeout; an error names the rank that did not
    join (:func:`learner.distributed.init_rank_distributed`)."""

    max_actor_restarts: int = Field(3, ge=0)
    """Restarts of a crashed rollout actor before the run fails."""


GuardAction = Literal["lower_staleness", "behavior_objective", "lower_lr"]
"""A step of the stability guard's ladder (:func:`services.loop.guard.plan_action`)."""


class GuardRule(StrictModel):
    """One rule: the trailing mean of a step-record signal past a threshold."""

    signal: str = Field(pattern=r"^[a-z][a-z0-9_]*$", max_length=64)
    """A numeric key of the step record (``steps.jsonl``), e.g. ``malformed_rate``. The rule
    reads the mean of its finite values over the last ``guard.window`` steps; a step whose
    record lacks it (or holds NaN) contributes no value, and with none in the window the
    rule does not hold."""

    above: float | None = None
    """The rule holds when the smoothed signal is above this (in the signal's units)."""

    below: float | None = None
    """The rule holds when the smoothed signal is below this (e.g. for ``success_rate``)."""

    level: Literal["warn", "act"] = "act"
    """``warn``: logged only. ``act``: after ``guard.patience`` steps in a row, an action."""

    @model_validator(mode="after")
    def _check_one_threshold(self) -> GuardRule:
        if (self.above is None) == (self.below is None):
            raise ValueError(f"rule on {self.signal}: set exactly one of above / below")
        return self

    @property
    def name(self) -> str:
        """``malformed_rate > 0.5``: how the decision log names the rule."""
        if self.above is not None:
            return f"{self.signal} > {self.above:g}"
        return f"{self.signal} < {self.below:g}"


def _default_rules() -> list[GuardRule]:
    return [
        GuardRule(signal="behavior_log_ratio_abs_mean", above=0.1, level="act"),
        GuardRule(signal="malformed_rate", above=0.5, level="act"),
        GuardRule(signal="approx_kl", above=0.02, level="warn"),
    ]


class GuardConfig(StrictModel):
    """The stability guard (:mod:`services.loop.guard`): rules on the step record's signals
    and the actions it takes before a fall. Live-tunable (``stppo ctl set guard.mode=off``
    pauses it)."""

    mode: Literal["off", "warn", "act"] = "warn"
    """``off``: no decisions. ``warn``: decisions are logged (``guard.jsonl``, metrics, the
    progress line) and nothing changes. ``act``: an ``act`` decision also changes the live
    config along ``ladder`` (after a rollback, ``rollback``). The default logs only: in the
    arena, of 21 runs it acted on, 7 ended low with it and 18 without (its controls), but
    both runs it acted on that would not have fallen ended low, its log-ratio threshold is
    not measured on real models and engines, and a rollback needs frequent checkpoints
    (docs: Stability autopilot, The default)."""

    window: int = Field(3, ge=1, le=1000)
    """Trailing mean over this many steps (learner steps) before a rule is checked."""

    patience: int = Field(1, ge=1, le=1000)
    """Steps in a row an ``act`` rule must hold before the guard acts (learner steps)."""

    warmup_steps: int = Field(5, ge=0, le=10_000_000)
    """No decision before this learner step (the first steps' signals are noisy)."""

    cooldown_steps: int = Field(5, ge=0, le=10_000_000)
    """Learner steps after an action before the next one (its effect needs steps to show;
    decisions in between are ``warn``)."""

    rules: list[GuardRule] = Field(default_factory=_default_rules, max_length=64)
    """The rules, each ``{signal, above | below, level}``; the defaults were set from the
    off-policy arena's archived runs (``experiments/guard_replay.py``)."""

    ladder: list[GuardAction] = Field(
        default_factory=lambda: ["lower_staleness", "behavior_objective", "lower_lr"],
        max_length=16,
    )
    """Actions in order; each ``act`` takes the first one that still applies
    (``lower_staleness`` again until ``min_staleness``; a step that does not apply, or
    changes a field a person changed live, is skipped)."""

    max_actions: int = Field(3, ge=0, le=1000)
    """Actions per run at most; once spent, ``act`` decisions are logged as ``warn``."""

    rollback: bool = True
    """Mode ``act`` only: each action first rolls the learner back, in process, to the newest
    checkpoint before the learner step at which the triggering rule's signal began (policy,
    critic, optimizer, counters, sampler position; the live config stays), then the ladder's
    change applies. Without such a checkpoint the action only tightens. ``false``: the
    ladder only tightens."""

    max_rollbacks: int = Field(2, ge=0, le=1000)
    """Rollbacks per run at most, counted across resumes. An ``act`` decision that would roll
    back once they are spent stops the run instead: it ends like a finished one (checkpoint,
    end evaluation) and ``stppo train`` exits with status 3."""

    staleness_factor: float = Field(0.25, gt=0.0, lt=1.0)
    """``lower_staleness``: the new ``buffer.max_staleness`` is the old one times this,
    rounded down, at least ``min_staleness``."""

    min_staleness: int = Field(1, ge=0, le=10_000)
    """``lower_staleness`` never goes below this bound (learner steps)."""

    lr_factor: float = Field(0.5, gt=0.0, lt=1.0)
    """``lower_lr``: ``learner.actor_lr`` is multiplied by this."""


class RunConfig(StrictModel):
    """The whole run: every section of the actor-learner service."""

    run: RunSection = RunSection()
    """Identity and length of the run."""

    model: ModelSection = ModelSection()
    """The policy model."""

    data: DataSection = DataSection()
    """QA sets."""

    retrieval: RetrievalSection = RetrievalSection()
    """The retrieval server."""

    rollout: RolloutConfig = RolloutConfig()
    """Rollout actors."""

    algorithm: AlgorithmConfig = Field(default_factory=STPPOConfig)
    """The ST-PPO family variant and its options."""

    learner: LearnerConfig = LearnerConfig()
    """The DeepSpeed learner."""

    sft: SFTConfig = SFTConfig()
    """Warm-start SFT."""

    buffer: BufferConfig = BufferConfig()
    """Staleness-tagged buffer."""

    sync: SyncConfig = SyncConfig()
    """Weight sync."""

    control: ControlConfig = ControlConfig()
    """Control plane."""

    metrics: MetricsConfig = MetricsConfig()
    """Prometheus export."""

    tracking: TrackingConfig = TrackingConfig()
    """Experiment trackers (TensorBoard, MLflow, W&B) fed by the driver."""

    checkpoint: CheckpointConfig = CheckpointConfig()
    """Checkpointing."""

    ray: RayConfig = RayConfig()
    """Ray cluster and resources."""

    guard: GuardConfig = GuardConfig()
    """The stability guard: rules on each step's signals, and the actions it may take."""

    @model_validator(mode="after")
    def _check_bias_norm_zero_stage(self) -> RunConfig:
        if getattr(self.algorithm, "bias_norm", None) == "param" and self.learner.zero_stage == 3:
            raise ValueError(
                "algorithm.bias_norm = 'param' needs full parameters for its extra backward, "
                "which ZeRO-3 partitions across ranks: set learner.zero_stage <= 2 or "
                "algorithm.bias_norm = 'logprob'"
            )
        return self

    @model_validator(mode="after")
    def _check_shared_gpu_budget(self) -> RunConfig:
        share, learner = self.ray.learner_gpus, self.learner
        if learner.micro_batch_tokens == -1 and 0.0 < share < learner.gpu_memory_fraction:
            raise ValueError(
                f"learner.gpu_memory_fraction = {learner.gpu_memory_fraction} is more than "
                f"the learner's share of its GPU (ray.learner_gpus = {share}): with "
                "micro_batch_tokens = -1 its budget would plan for memory the GPU's other "
                f"tenant (the rollout engine) grows into; set learner.gpu_memory_fraction <= "
                f"{share}"
            )
        return self

    @model_validator(mode="after")
    def _check_collective_on_shared_gpus(self) -> RunConfig:
        ray = self.ray
        fractional = [
            f"ray.{name} = {value:g}"
            for name, value in (("learner_gpus", ray.learner_gpus),
                                ("rollout_actor_gpus", ray.rollout_actor_gpus))
            if 0.0 < value < 1.0
        ]  # fmt: skip
        if self.sync.transport == "collective" and ray.learner_gpus > 0 and fractional:
            raise ValueError(
                f"sync.transport = 'collective' with {' and '.join(fractional)}: ranks that "
                "share a GPU cannot be in one NCCL group (NCCL refuses two ranks on one "
                "device); give each a whole GPU or use sync.transport = 'object_store'"
            )
        return self

    @model_validator(mode="after")
    def _check_group_size_for_grpo(self) -> RunConfig:
        if self.algorithm.variant in ("grpo", "so_grpo") and self.rollout.group_size < 2:
            raise ValueError(
                f"rollout.group_size must be >= 2 for {self.algorithm.variant} "
                f"(group-relative advantages), got {self.rollout.group_size}"
            )
        return self

    @model_validator(mode="after")
    def _check_validation_files(self) -> RunConfig:
        data = self.data
        if data.uses_files and not data.validation_files and self.run.eval_questions > 0:
            raise ValueError(
                "data.validation_files: required with data.train_files (evaluations draw "
                "from it), or set run.eval_questions = 0"
            )
        return self

    @model_validator(mode="after")
    def _check_interrupt_vs_fixed_lag(self) -> RunConfig:
        if self.sync.fixed_lag and self.rollout.interrupt_every_tokens > 0:
            raise ValueError(
                "rollout.interrupt_every_tokens must be 0 with sync.fixed_lag = true (got "
                f"{self.rollout.interrupt_every_tokens}): a fixed lag means every batch is "
                "generated by one version exactly k behind, and an update landing "
                "mid-batch would make its later tokens fresher than k"
            )
        if self.sync.fixed_lag and self.run.eval_every > 0:
            raise ValueError(
                f"run.eval_every must be 0 with sync.fixed_lag = true (got "
                f"{self.run.eval_every}): an evaluation measures the learner's current "
                "weights, and engines that loaded them cannot go back to the version "
                "buffer.max_staleness behind"
            )
        if self.sync.fixed_lag and self.rollout.calls_per_actor > 1:
            raise ValueError(
                "rollout.calls_per_actor must be 1 with sync.fixed_lag = true (got "
                f"{self.rollout.calls_per_actor}): continuous batching lets weight updates "
                "land between turns of a running call, and a fixed lag needs every batch "
                "generated by one version exactly k behind"
            )
        return self

    @model_validator(mode="after")
    def _check_staleness_budget(self) -> RunConfig:
        # learner.admission: at most (s + 1) * B trajectories may be unconsumed at once
        s, batch = self.buffer.max_staleness, self.learner.train_batch_size
        per_call = self.rollout.prompts_per_batch * self.rollout.group_size
        if per_call > required_capacity(s, batch):
            raise ValueError(
                f"one rollout call (rollout.prompts_per_batch * rollout.group_size = {per_call}) "
                f"exceeds (buffer.max_staleness + 1) * learner.train_batch_size = "
                f"{required_capacity(s, batch)}: it could never start within the staleness bound"
            )
        if self.sync.every_k_steps > s + 1:
            raise ValueError(
                f"sync.every_k_steps ({self.sync.every_k_steps}) must be <= "
                f"buffer.max_staleness + 1 ({s + 1}): engines lagging more cannot generate "
                "anything within the bound"
            )
        return self

    @property
    def buffer_limits(self) -> BufferLimits:
        """What the trajectory buffer applies now: the staleness bound and stale policy, and
        the capacity ``max(buffer.capacity, (max_staleness + 1) * train_batch_size)``
        (:func:`learner.admission.required_capacity`: admission never leaves more
        unconsumed)."""
        b = self.buffer
        required = required_capacity(b.max_staleness, self.learner.train_batch_size)
        return BufferLimits(b.max_staleness, max(b.capacity, required), b.stale_policy)

    @property
    def run_dir(self) -> Path:
        """``<run.output_dir>/<run.name>``."""
        return self.run.output_dir / self.run.name


# --------------------------------------------------------------------------- loading


def _format_validation_error(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "<root>"
        lines.append(f"{source}: {loc}: {e['msg']}")
    return "\n".join(lines)


def _parse_override_value(raw: str) -> Any:
    """Parse the right-hand side of ``key=value`` as TOML, falling back to a bare string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply dotted ``a.b.c=value`` overrides to a nested dict (values parsed as TOML).

    Raises:
        ConfigError: an override is not of the form ``key=value``, or walks through a
            non-table value.
    """
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expected dotted.key=value")
        node = data
        parts = key.strip().split(".")
        for p in parts[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {item!r}: {p} is not a section")
            node = nxt
        node[parts[-1]] = _parse_override_value(raw.strip())
    return data


def read_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML file; raise :class:`ConfigError` naming the file on a missing file or syntax error."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError as e:
        raise ConfigError(f"{path}: config file not found") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from e


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Load a :class:`RunConfig` from an optional TOML file plus dotted overrides.

    Args:
        path: TOML file (a leading ``@`` is accepted, as on the command line); None = defaults.
        overrides: ``dotted.key=value`` strings applied after the file, in order.

    Raises:
        ConfigError: unknown key, wrong type or out-of-bound value, naming each field.
    """
    data: dict[str, Any] = {}
    source = "<defaults>"
    if path is not None:
        path = Path(str(path).removeprefix("@"))
        data = read_toml(path)
        source = str(path)
    if overrides:
        data = apply_overrides(data, list(overrides))
        source = f"{source} + overrides" if path is not None else "overrides"
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e, source)) from None


def update_config(cfg: RunConfig, changes: dict[str, Any], strict: bool = False) -> RunConfig:
    """Return a new validated config with nested ``changes`` merged in (nothing applied on error).

    Used by the control plane for live changes: the whole tree is re-validated, so a change
    is applied entirely or not at all.

    Args:
        cfg: the current config.
        changes: nested partial config, e.g. ``{"buffer": {"max_staleness": 2}}``.
        strict: pydantic strict mode over JSON (the control plane): no coercion, so ``"2"``,
            ``true`` or ``"1e-5"`` for a number, or ``2`` for a string, are errors.

    Raises:
        ConfigError: as :func:`load_config`, and for a section given as a non-object.
    """
    data = json.loads(cfg.model_dump_json())

    def merge(dst: dict[str, Any], src: dict[str, Any], path: str) -> None:
        for k, v in src.items():
            if isinstance(dst.get(k), dict) and v not in (None, NULL):  # an optional section unset
                if not isinstance(v, dict):
                    raise ConfigError(f"change: {path}{k}: expected an object (a config section)")
                merge(dst[k], v, f"{path}{k}.")
            else:
                dst[k] = v

    algo = changes.get("algorithm")
    if isinstance(algo, dict) and "variant" in algo:
        # a new variant has its own field set: keep only the fields it shares with the old one
        data["algorithm"] = {
            "variant": algo["variant"],
            **{k: v for k, v in data["algorithm"].items() if k != "variant"},
        }
        data["algorithm"] = _fields_valid_for_variant(data["algorithm"])
    merge(data, changes, "")
    try:
        if strict:
            return RunConfig.model_validate_json(json.dumps(data), strict=True)
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e, "change")) from None


def _fields_valid_for_variant(algo: dict[str, Any]) -> dict[str, Any]:
    variant = algo["variant"]
    cls = VARIANT_CONFIGS.get(variant) if isinstance(variant, str) else None
    if cls is None:
        return algo  # validation names the bad variant
    return {k: v for k, v in algo.items() if k in cls.model_fields}
