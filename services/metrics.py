"""Prometheus metrics of the actor-learner service, on an explicit ``CollectorRegistry``.

Every metric is prefixed ``stppo_``; the learner metrics (``learner.step_metrics.StepMetrics``,
listed in ``docs/reference/metrics.md``) keep the same name in Prometheus and in the per-step JSONL log (there without the
prefix). Nothing here touches prometheus_client's global registry, so several
:class:`TrainingMetrics` can live in one process (tests, multiple runs) without clashing.

Example::

    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    metrics = TrainingMetrics(registry)
    server = start_metrics_server(registry, host="127.0.0.1", port=0)
    metrics.observe_step({"clip_ratio": 0.12, "approx_kl": 0.003, "reward_mean": 0.4})
    metrics.observe_staleness([0, 1, 1])
    # curl http://127.0.0.1:{server.port}/metrics  ->  stppo_clip_ratio 0.12 ...
    server.close()

Exported names (samples as scraped; counters end in ``_total``, histograms expose
``_bucket``/``_sum``/``_count``) are listed by :func:`exported_metric_names`.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client import make_asgi_app as _prometheus_asgi_app

PREFIX = "stppo_"
"""Prefix of every metric this module exports."""

LEARNER_STEP_METRICS: dict[str, str] = {
    "clip_ratio": "Token-weighted fraction of loss-masked tokens whose ratio was clipped "
    "(ratio 0..1, spec section 4).",
    "clip_ratio_turn": "Fraction of turns whose turn-level ratio was clipped (ratio 0..1).",
    "approx_kl": "k1 estimate of KL(behaviour || current policy): mean of logp_old - logp_theta "
    "over masked tokens (nats per token).",
    "kl_ref": "KL(current policy || reference policy) over masked tokens with the configured "
    "estimator (algorithm.kl_estimator; default low_var_kl = k3 clamped to [-10, 10]) "
    "(nats per token).",
    "token_log_ratio_abs_max": "Largest |log pi_theta - log pi_old| of a policy token in the "
    "last learner step (nats).",
    "clip_ratio_dual": "Fraction of policy tokens capped by the dual clip (ratio 0..1).",
    "token_bound_ratio": "Fraction of policy tokens whose log-ratio the token bound inside "
    "turns replaced (ratio 0..1).",
    "behavior_weight_mean": "Decoupled PPO: mean behaviour weight pi_prox / pi_behaviour "
    "before truncation (dimensionless; NaN with off_policy = behavior).",
    "behavior_weight_capped": "Decoupled PPO: fraction of policy tokens whose importance "
    "weight the rollout correction's cap truncated (TIS; ratio 0..1).",
    "behavior_masked": "Decoupled PPO: fraction of policy tokens the rollout correction's mask "
    "dropped (MIS, Geo-RS, IcePop; ratio 0..1).",
    "m2po_masked": "Fraction of policy tokens M2PO's second-moment mask dropped (ratio 0..1; "
    "NaN without algorithm.m2po_threshold).",
    "proximal_approx_abs_error": "Mean |log pi_prox - its log-linear approximation| over "
    "policy tokens (nats per token; NaN where the proximal log-probs are not recomputed).",
    "entropy": "Mean token entropy of the current policy over masked tokens (nats per token).",
    "pg_loss": "Policy-gradient loss of the last learner step (dimensionless).",
    "value_loss": "Critic value loss of the last learner step (squared return units); "
    "NaN for critic-free variants.",
    "grad_norm": "Global L2 norm of the gradient before clipping (dimensionless).",
    "clip_bias_norm": "Norm ||C|| of the clipping-bias term (dimensionless).",
    "clip_bias_scale": "Scale s of the clipping-bias correction, applied to the optimizer "
    "step (scale_target = update) or the loss (dimensionless; mean over optimizer steps).",
    "reward_mean": "Mean trajectory reward of the consumed batch (reward units, 0..1 for EM).",
    "success_rate": "Fraction of consumed trajectories answered correctly (ratio 0..1).",
    "num_turns_mean": "Mean number of assistant turns per consumed trajectory (turns).",
    "response_tokens_mean": "Mean number of loss-masked response tokens per consumed "
    "trajectory (tokens).",
    "tokens_per_s": "Learner throughput of the last step: trained tokens per second (tokens/s).",
}
"""The gauges :meth:`TrainingMetrics.observe_step` sets: spec section 4 minus ``staleness``
(a histogram, see :meth:`TrainingMetrics.observe_staleness`). Name -> HELP text."""

STALENESS_BUCKETS: tuple[float, ...] = tuple(float(v) for v in range(17))
"""Upper bounds of the staleness histogram, in learner steps: 0, 1, ..., 16 (+Inf implied)."""

WEIGHT_SYNC_BUCKETS_S: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)  # fmt: skip
"""Upper bounds of the weight-sync histogram, in seconds (CPU object store: ~0.1-2 s for
135M parameters; NCCL on GPU: well under 0.1 s)."""


class UnknownMetricError(KeyError):
    """``observe_step`` got keys that are neither learner metrics nor explicitly ignored."""


@dataclass(frozen=True)
class MetricsServer:
    """A running ``/metrics`` HTTP endpoint (daemon thread).

    Attributes:
        host: bind address.
        port: actual bound port (the free port picked when 0 was asked for).
        server: the WSGI server; :meth:`close` stops it.
        thread: the daemon thread serving it.
    """

    host: str
    port: int
    server: WSGIServer
    thread: threading.Thread

    @property
    def url(self) -> str:
        """``http://host:port/metrics``."""
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and release the port (blocks until the serve loop has exited)."""
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5.0)


def _require_label(kind: str, value: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{kind} label must be a non-empty string, got {value!r}")
    return value


class TrainingMetrics:
    """Every metric of the actor-learner service, registered on ``registry``.

    Learner step gauges (``stppo_<name>``, one per :data:`LEARNER_STEP_METRICS` key) are set
    by :meth:`observe_step`; the rest are attributes (prometheus_client objects) with small
    named helpers. Attributes hold the prometheus_client objects so callers can also use the
    library API directly (``metrics.buffer_depth.set(3)``).

    Args:
        registry: the explicit registry to register on (never the global one).

    Raises:
        ValueError: a metric of the same name is already registered on ``registry``
            (prometheus_client's "Duplicated timeseries" error): one instance per registry.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        if not isinstance(registry, CollectorRegistry):
            raise TypeError(f"registry must be a CollectorRegistry, got {type(registry).__name__}")
        self.registry = registry
        r = registry
        p = PREFIX

        # -- learner step (spec section 4)
        self.step_gauges: dict[str, Gauge] = {
            name: Gauge(p + name, help_text, registry=r)
            for name, help_text in LEARNER_STEP_METRICS.items()
        }
        self.staleness = Histogram(
            p + "staleness",
            "Staleness of consumed trajectories: learner_version - policy_version (learner steps).",
            buckets=STALENESS_BUCKETS,
            registry=r,
        )

        # -- counters
        self.trajectories_generated_total = Counter(
            p + "trajectories_generated",
            "Trajectories produced by rollout actors (trajectories).",
            registry=r,
        )
        self.trajectories_consumed_total = Counter(
            p + "trajectories_consumed",
            "Trajectories consumed by learner steps (trajectories).",
            registry=r,
        )
        self.dropped_stale_total = Counter(
            p + "dropped_stale",
            "Trajectories dropped at consume time because staleness exceeded max_staleness "
            "(trajectories).",
            registry=r,
        )
        # Exported as ``retrieval_client_errors``: the retrieval server already exports
        # ``stppo_retrieval_errors_total`` (server-side rejections), a different count.
        self.retrieval_errors_total = Counter(
            p + "retrieval_client_errors",
            "Failed retrieval requests seen by rollout actors (timeouts, connection errors, "
            "HTTP errors after retries), by reason (requests).",
            ["reason"],
            registry=r,
        )
        self.retrieval_failed_trajectories_total = Counter(
            p + "retrieval_failed_trajectories",
            "Trajectories with at least one failed retrieval (trajectories).",
            registry=r,
        )
        self.actor_restarts_total = Counter(
            p + "actor_restarts",
            "Rollout actor restarts after a crash (restarts).",
            registry=r,
        )
        self.retrieval_server_restarts_total = Counter(
            p + "retrieval_server_restarts",
            "Restarts of the managed retrieval server after its process exited (restarts).",
            registry=r,
        )
        self.nonfinite_steps_total = Counter(
            p + "nonfinite_steps",
            "Learner steps skipped because the loss or gradient was not finite (steps).",
            registry=r,
        )
        self.malformed_answers_total = Counter(
            p + "malformed_answers",
            "Trajectories whose output was malformed (reward 0), by reason (trajectories).",
            ["reason"],
            registry=r,
        )
        self.config_changes_total = Counter(
            p + "config_changes",
            "Live config changes applied through the control plane, by dotted field (changes).",
            ["field"],
            registry=r,
        )

        # -- the stability guard (services.loop.guard)
        self.guard_decisions_total = Counter(
            p + "guard_decisions",
            "Stability guard decisions that were not ok, by level: warn or act (decisions).",
            ["level"],
            registry=r,
        )
        self.guard_actions_total = Counter(
            p + "guard_actions",
            "Actions of the stability guard, by action: a ladder step (a config change "
            "requested) or stop (the run ended, its rollback budget spent) (actions).",
            ["action"],
            registry=r,
        )
        self.guard_rollbacks_total = Counter(
            p + "guard_rollbacks",
            "Rollbacks of the stability guard: the learner restored from the last good "
            "checkpoint before an action (rollbacks).",
            registry=r,
        )
        self.guard_level = Gauge(
            p + "guard_level",
            "The stability guard's decision at the last learner step: 0 ok, 1 warn, 2 act (level).",
            registry=r,
        )
        self.guard_signal = Gauge(
            p + "guard_signal",
            "Trailing mean of each guard rule's signal at the last learner step (the "
            "signal's own units; NaN where not logged).",
            ["signal"],
            registry=r,
        )

        # -- interruptible generation (rollout.interrupt_every_tokens)
        self.consumed_policy_tokens_total = Counter(
            p + "consumed_policy_tokens",
            "Policy tokens consumed by learner steps, by token staleness: learner_version - "
            "the version that sampled the token (tokens; label 0..16, '17+'). The per-token "
            "reading of stppo_staleness, which is per trajectory (its oldest token).",
            ["staleness"],
            registry=r,
        )
        self.inflight_weight_updates_total = Counter(
            p + "inflight_weight_updates",
            "Weight updates an engine applied while a rollout batch was running, mid-turn or "
            "between turns, instead of after the batch (updates).",
            registry=r,
        )
        self.mixed_version_trajectories_total = Counter(
            p + "mixed_version_trajectories",
            "Consumed trajectories whose policy tokens were sampled by more than one weight "
            "version (trajectories).",
            registry=r,
        )

        # -- service gauges
        self.learner_step = Gauge(
            p + "learner_step", "Learner steps completed (steps).", registry=r
        )
        self.policy_version = Gauge(
            p + "policy_version",
            "Version of the learner's current weights (learner steps).",
            registry=r,
        )
        self.buffer_depth = Gauge(
            p + "buffer_depth",
            "Trajectories waiting in the staleness-tagged buffer (trajectories).",
            registry=r,
        )
        self.max_staleness = Gauge(
            p + "max_staleness",
            "Current staleness bound of the buffer (learner steps; live-tunable).",
            registry=r,
        )
        self.algorithm_variant_info = Gauge(
            p + "algorithm_variant_info",
            "Current algorithm variant: value 1 on the active variant label (info).",
            ["variant"],
            registry=r,
        )
        self.learning_rate = Gauge(
            p + "learning_rate",
            "Current policy learning rate (per step, optimizer units).",
            registry=r,
        )
        self.clip_eps = Gauge(
            p + "clip_eps",
            "Current PPO clip epsilon (ratio; live-tunable).",
            registry=r,
        )
        self.num_rollout_actors = Gauge(
            p + "num_rollout_actors",
            "Rollout actors currently requested (actors; live-tunable).",
            registry=r,
        )
        self.rollout_tokens_per_s = Gauge(
            p + "rollout_tokens_per_s",
            "Generation throughput of all rollout actors (generated tokens/s).",
            registry=r,
        )
        self.trajectories_per_s = Gauge(
            p + "trajectories_per_s",
            "Trajectories consumed by the learner per second of wall time (trajectories/s).",
            registry=r,
        )
        self.weight_sync_seconds = Histogram(
            p + "weight_sync_seconds",
            "Wall time of one learner -> engines weight sync (seconds).",
            buckets=WEIGHT_SYNC_BUCKETS_S,
            registry=r,
        )

    # ------------------------------------------------------------------ learner step

    def observe_step(self, metrics: Mapping[str, float], ignore: Collection[str] = ()) -> None:
        """Set the learner step gauges from one step's metrics dict (the JSONL log record).

        Keys are the unprefixed names of :data:`LEARNER_STEP_METRICS`. A learner metric
        missing from ``metrics`` is set to NaN: the step did not produce it (``value_loss``
        under GRPO, ``clip_ratio_turn`` under token PPO), so a value from before a live
        variant change never lingers. Values may be Python/NumPy floats or 0-d tensors;
        NaN/inf are exported as they are (that is what the step produced).

        Args:
            metrics: name -> value for one learner step.
            ignore: other keys the caller knowingly logs but does not export here (e.g.
                ``"step"``, ``"policy_version"``); any key neither known nor ignored is an
                error, so a typo never silently disappears from the dashboards.

        Raises:
            UnknownMetricError: keys not in :data:`LEARNER_STEP_METRICS` nor ``ignore``.
            TypeError: a value that ``float()`` cannot convert (names the key).
        """
        unknown = sorted(set(metrics) - set(LEARNER_STEP_METRICS) - set(ignore))
        if unknown:
            raise UnknownMetricError(
                f"unknown learner metrics {unknown}; known: {sorted(LEARNER_STEP_METRICS)} "
                "(pass ignore=... for keys logged but not exported)"
            )
        values: dict[str, float] = {}
        for name in LEARNER_STEP_METRICS:
            if name not in metrics:
                values[name] = math.nan
                continue
            try:
                values[name] = float(metrics[name])
            except (TypeError, ValueError) as e:
                raise TypeError(
                    f"learner metric {name!r} must be a number, got {metrics[name]!r}"
                ) from e
        for name, value in values.items():  # convert everything first: all-or-nothing
            self.step_gauges[name].set(value)

    def observe_staleness(self, values: Iterable[int]) -> None:
        """Record the staleness of consumed (or dropped) trajectories in the histogram.

        Args:
            values: ``learner_version - policy_version`` per trajectory (learner steps, >= 0).

        Raises:
            ValueError: a negative or non-integer staleness (a trajectory from the future
                means a version-stamping bug upstream); nothing is recorded then.
        """
        checked = []
        for v in values:
            if isinstance(v, bool) or int(v) != v or v < 0:
                raise ValueError(f"staleness must be a non-negative integer, got {v!r}")
            checked.append(int(v))
        for v in checked:
            self.staleness.observe(v)

    def observe_token_staleness(self, counts: Mapping[int, int]) -> None:
        """Add a take's per-token staleness histogram (staleness -> policy tokens, from
        :func:`learner.buffer.token_staleness_counts`) to ``stppo_consumed_policy_tokens_total``.

        Raises:
            ValueError: a negative staleness or count; nothing is recorded then.
        """
        if any(int(k) < 0 or int(n) < 0 for k, n in counts.items()):
            raise ValueError(f"token staleness counts must be non-negative, got {dict(counts)}")
        for k, n in counts.items():
            label = (
                str(int(k))
                if k <= int(STALENESS_BUCKETS[-1])
                else f"{int(STALENESS_BUCKETS[-1]) + 1}+"
            )
            self.consumed_policy_tokens_total.labels(staleness=label).inc(n)

    # ------------------------------------------------------------------ service state

    def set_learner_state(self, learner_step: int, policy_version: int) -> None:
        """Set ``stppo_learner_step`` and ``stppo_policy_version`` (both in learner steps)."""
        if learner_step < 0 or policy_version < 0:
            raise ValueError(
                f"learner_step and policy_version must be >= 0, got {learner_step}, "
                f"{policy_version}"
            )
        self.learner_step.set(learner_step)
        self.policy_version.set(policy_version)

    def set_variant(self, variant: str) -> None:
        """Make ``variant`` the only label of ``stppo_algorithm_variant_info`` with value 1."""
        _require_label("variant", variant)
        self.algorithm_variant_info.clear()
        self.algorithm_variant_info.labels(variant=variant).set(1)

    def set_live_config(
        self,
        *,
        max_staleness: int,
        variant: str,
        learning_rate: float,
        clip_eps: float,
        num_rollout_actors: int,
    ) -> None:
        """Mirror the live-tunable config values into their gauges (call at start and after
        every applied change)."""
        self.max_staleness.set(max_staleness)
        self.set_variant(variant)
        self.learning_rate.set(learning_rate)
        self.clip_eps.set(clip_eps)
        self.num_rollout_actors.set(num_rollout_actors)

    def count_config_change(self, field: str) -> None:
        """Count one applied live change of the dotted config ``field``."""
        self.config_changes_total.labels(field=_require_label("field", field)).inc()

    def observe_guard(
        self,
        level: str,
        action: str | None,
        signals: Mapping[str, float],
        rolled_back: bool = False,
    ) -> None:
        """One stability-guard decision: ``level`` (``ok``, ``warn``, ``act``), the action
        requested (None: none; ``stop``: the run ends), the smoothed signals, and whether it
        rolls back to a checkpoint (counted with ``act`` only).

        Raises:
            ValueError: an unknown level.
        """
        levels = ("ok", "warn", "act")
        if level not in levels:
            raise ValueError(f"guard level must be one of {levels}, got {level!r}")
        self.guard_level.set(levels.index(level))
        if level != "ok":
            self.guard_decisions_total.labels(level=level).inc()
        if action is not None and level == "act":
            self.guard_actions_total.labels(action=_require_label("action", action)).inc()
        if rolled_back and level == "act":
            self.guard_rollbacks_total.inc()
        for signal, value in signals.items():
            self.guard_signal.labels(signal=_require_label("signal", signal)).set(value)

    def count_retrieval_error(self, reason: str, n: int = 1) -> None:
        """Count ``n`` failed retrieval requests with ``reason`` (e.g. ``timeout``, ``http_5xx``)."""
        self.retrieval_errors_total.labels(reason=_require_label("reason", reason)).inc(n)

    def count_malformed_answer(self, reason: str, n: int = 1) -> None:
        """Count ``n`` malformed trajectories with ``reason`` (``Trajectory.malformed_reason``)."""
        self.malformed_answers_total.labels(reason=_require_label("reason", reason)).inc(n)

    def observe_weight_sync(self, seconds: float) -> None:
        """Record one weight sync's wall time (seconds, >= 0)."""
        if not seconds >= 0:
            raise ValueError(f"weight sync time must be >= 0 s, got {seconds!r}")
        self.weight_sync_seconds.observe(seconds)


# ---------------------------------------------------------------------- serving


def start_metrics_server(registry: CollectorRegistry, host: str, port: int) -> MetricsServer:
    """Serve ``registry`` at ``http://host:port/metrics`` from a daemon thread.

    Args:
        registry: what to expose (never the global registry unless passed explicitly).
        host: bind address (``127.0.0.1`` locally, ``0.0.0.0`` in a pod).
        port: TCP port; 0 picks a free one (read it back from ``MetricsServer.port``).

    Raises:
        OSError: the port is taken or the address cannot be bound.
    """
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be in 0..65535, got {port}")
    server, thread = start_http_server(port, addr=host, registry=registry)
    return MetricsServer(host=host, port=int(server.server_port), server=server, thread=thread)


def make_asgi_app(registry: CollectorRegistry):  # -> ASGI callable
    """An ASGI app serving ``registry`` in Prometheus text format, to mount in FastAPI:
    ``app.mount("/metrics", make_asgi_app(registry))``."""
    return _prometheus_asgi_app(registry=registry)


_SAMPLE_SUFFIXES: dict[str, tuple[str, ...]] = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
    "gauge": ("",),
    "stateset": ("",),
    "enum": ("",),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "unknown": ("",),
}


def exported_metric_names(registry: CollectorRegistry) -> set[str]:
    """Every series name ``registry`` exposes when scraped, derived from each family's type
    (so labelled families count before their first sample): ``stppo_clip_ratio``,
    ``stppo_dropped_stale_total``, ``stppo_staleness_bucket``/``_sum``/``_count``... Used to
    check that dashboards and alerts only name real series.

    Raises:
        ValueError: a family of a type this function does not know (names it).
    """
    names: set[str] = set()
    for family in registry.collect():
        suffixes = _SAMPLE_SUFFIXES.get(family.type)
        if suffixes is None:
            raise ValueError(f"metric {family.name}: unknown family type {family.type!r}")
        names.update(family.name + suffix for suffix in suffixes)
    return names


def training_metric_names() -> set[str]:
    """:func:`exported_metric_names` of a fresh :class:`TrainingMetrics`."""
    registry = CollectorRegistry()
    TrainingMetrics(registry)
    return exported_metric_names(registry)
