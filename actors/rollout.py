"""The batched multi-turn rollout of the search agent (Search-R1 loop), Ray-free.

Each turn, every live episode's token sequence (``prompt_ids + response_ids``) goes to the
engine in ONE batched ``generate`` call; generation stops at ``</search>``, ``</answer>``,
EOS or the token budget. Then all the turn's search queries go to the retrieval server in
ONE ``/retrieve`` request, and each searching episode gets its ``<information>`` block
appended as environment tokens. Up to ``max_turns`` policy turns.

Several calls can share the engine (:class:`ContinuousBatcher`, ``rollout.calls_per_actor``):
each turn's engine call then holds the live episodes of every running call, so a new call's
first turns run beside an older call's slowest episodes instead of after them.

Token accounting (what makes turn-level importance ratios possible): the engine's input for
an episode is always exactly ``prompt_ids + response_ids`` so far; generated tokens are
appended with ``loss_mask = 1``, ``turn_ids = k`` (k-th policy turn) and their behaviour
log-probs; environment tokens with ``loss_mask = 0``, ``turn_ids = -1``, log-prob 0.
Every :class:`~actors.trajectory.Trajectory` is ``validate()``-d before it is returned.

Episode ends (``finish_reason``):

- ``answer``: the turn ended with ``</answer>``;
- ``max_turns``: a search was requested in the last allowed turn;
- ``max_tokens``: a turn hit its token budget (per turn or the response budget), or an
  information block would not leave room for another turn;
- ``eos``: the policy ended its message (EOS) with neither a search nor an answer;
- ``retrieval_failed``: the ``/retrieve`` call failed after retries. The trajectory is
  flagged ``retrieval_failed`` (the learner excludes it) and never given an empty result.

Source: Jin et al., "Search-R1" (2025), ``search_r1/llm_agent/generation.py`` (``run_llm_loop``).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from actors.config import RolloutConfig
from actors.engines.build import build_engine, serve_engine_metrics
from actors.engines.interrupt import Interrupt, WeightGate
from actors.engines.protocol import STOP_STRINGS, GenerationEngine, GenerationResult, SamplingParams
from actors.prompts import extract_search_query, information_ids, invalid_search_ids, prompt_ids
from actors.retrieval_client import Passage, RetrievalClient, RetrievalFailed
from actors.reward import compute_reward
from actors.scoring import compared_forms
from actors.trajectory import Trajectory, Transcript, TurnTranscript

logger = logging.getLogger(__name__)


class Retriever(Protocol):
    """What the loop needs from retrieval: :class:`actors.retrieval_client.RetrievalClient`
    (HTTP, the real one) or any object with the same ``retrieve`` contract."""

    def retrieve(self, queries: list[str]) -> list[list[Passage]]:
        """Top-k passages per query; raises ``RetrievalFailed`` when it cannot answer."""
        ...


REQUIRED_RECORD_KEYS = ("id", "question", "golden_answers", "data_source")
"""Keys every QA record given to :func:`run_rollout` must have."""


@dataclass
class RolloutStats:
    """Counters of one :func:`run_rollout` call (summable across calls with :meth:`add`).

    Attributes:
        num_trajectories: Episodes finished.
        num_generated_tokens: Tokens kept from the engine (policy tokens).
        num_engine_calls: Batched ``generate`` calls.
        num_searches: Queries sent to the retrieval server.
        num_retrieval_failures: ``/retrieve`` calls that failed after retries.
        num_retrieval_failed_trajectories: Episodes flagged ``retrieval_failed``.
        generation_s: Wall seconds inside ``engine.generate``.
        retrieval_s: Wall seconds inside ``/retrieve`` calls.
        wall_s: Wall seconds of the whole rollout (tokenisation, parsing, reward included).
        num_inflight_weight_updates: Weight updates applied while this rollout ran (at a
            safe point: mid-turn or between turns; ``rollout.interrupt_every_tokens > 0``).
        weight_wait_s: Wall seconds the rollout waited, before starting, for the weights
            the driver pushed to land.
    """

    num_trajectories: int = 0
    num_generated_tokens: int = 0
    num_engine_calls: int = 0
    num_searches: int = 0
    num_retrieval_failures: int = 0
    num_retrieval_failed_trajectories: int = 0
    generation_s: float = 0.0
    retrieval_s: float = 0.0
    wall_s: float = 0.0
    num_inflight_weight_updates: int = 0
    weight_wait_s: float = 0.0

    def add(self, other: RolloutStats) -> None:
        """Accumulate another call's counters into this one."""
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @property
    def outside_generation_s(self) -> float:
        """Wall seconds not spent in the engine (retrieval, tokenisation, bookkeeping)."""
        return self.wall_s - self.generation_s


@dataclass(eq=False)
class _Episode:
    """Mutable state of one episode while the loop runs."""

    record: Mapping
    group_id: str
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    turn_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    policy_texts: list[str] = field(default_factory=list)
    queries: list[str | None] = field(default_factory=list)  # per turn, see TurnTranscript
    passages: list[tuple[tuple[str, str], ...]] = field(default_factory=list)  # per turn
    versions: list[int] = field(default_factory=list)  # per turn: version at its start
    token_versions: list[int] = field(default_factory=list)  # per response token, -1 env
    num_turns: int = 0
    num_searches: int = 0
    num_invalid_searches: int = 0
    finish_reason: str | None = None
    retrieval_error: str | None = None
    generation_s: float = 0.0
    retrieval_s: float = 0.0
    pending_query: str | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def engine_input(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def append_policy(
        self, token_ids: list[int], logprobs: list[float], versions: list[int], version: int
    ) -> None:
        self.response_ids += token_ids
        self.loss_mask += [1] * len(token_ids)
        self.turn_ids += [self.num_turns] * len(token_ids)
        self.logprobs += logprobs
        self.token_versions += versions
        self.versions.append(version)
        self.queries.append(None)
        self.passages.append(())
        self.num_turns += 1

    def append_environment(self, token_ids: list[int]) -> None:
        self.response_ids += token_ids
        self.loss_mask += [0] * len(token_ids)
        self.turn_ids += [-1] * len(token_ids)
        self.logprobs += [0.0] * len(token_ids)
        self.token_versions += [-1] * len(token_ids)


def check_record(record: Mapping) -> None:
    """Raise ValueError naming the first missing key of a QA record."""
    for key in REQUIRED_RECORD_KEYS:
        if key not in record:
            raise ValueError(
                f"QA record {record.get('id')!r} lacks {key!r}; needs {REQUIRED_RECORD_KEYS}"
            )


@dataclass(eq=False)
class RolloutCall:
    """One submitted rollout call of a :class:`ContinuousBatcher`: its episodes (in record
    order), its sampling temperature and counters; ``done`` once every episode has ended."""

    episodes: list[_Episode]
    temperature: float
    stats: RolloutStats = field(default_factory=RolloutStats)
    started_s: float = field(default_factory=time.perf_counter)
    done: bool = False


class ContinuousBatcher:
    """Continuous batching of rollout calls at turn granularity (Ray-free, thread-safe).

    Episodes of every submitted call that has not ended share each turn: one batched
    ``generate`` over all live episodes (one per sampling temperature), then one
    ``/retrieve`` for all of the turn's queries. A call submitted while others run joins
    at the next :meth:`step`, so an engine whose oldest call is down to its slowest
    episode keeps generating the newer calls' first turns in the same engine calls instead
    of waiting for it (the batch barrier of one call at a time). With a single call,
    :meth:`step` is exactly one iteration of the Search-R1 turn loop (:func:`run_rollout`).

    Threads: :meth:`submit` may run on any thread; :meth:`step` on one thread at a time
    (the caller holds the engine, :class:`actors.engines.interrupt.WeightGate`).

    Source: continuous (iteration-level) batching, Yu et al., "Orca" (OSDI 2022), applied
    per turn of a multi-turn episode instead of per decoded token.
    """

    def __init__(
        self, engine: GenerationEngine, tokenizer, client: Retriever, cfg: RolloutConfig
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.client = client
        self.cfg = cfg
        self._calls: list[RolloutCall] = []
        self._lock = threading.Lock()  # guards _calls (submit vs step)

    def submit(
        self, records: Sequence[Mapping], group_ids: Sequence[str], temperature: float
    ) -> RolloutCall:
        """Queue one episode per record; they start at the next :meth:`step`.

        Raises:
            ValueError: empty input, mismatched lengths, or a malformed record.
        """
        if not records:
            raise ValueError("run_rollout needs at least one record")
        if len(group_ids) != len(records):
            raise ValueError(f"{len(group_ids)} group_ids for {len(records)} records")
        episodes = [
            _new_episode(self.tokenizer, r, g, self.cfg.system_prompt)
            for r, g in zip(records, group_ids, strict=True)
        ]
        call = RolloutCall(episodes, temperature)
        with self._lock:
            self._calls.append(call)
        return call

    def has_started_episodes(self) -> bool:
        """Has a running call an episode that has begun its first turn (tokens in flight)?"""
        with self._lock:
            return any(e.num_turns > 0 for c in self._calls for e in c.episodes)

    @property
    def num_running(self) -> int:
        """Submitted calls that have not ended."""
        with self._lock:
            return len(self._calls)

    def step(self, interrupt: Interrupt | None = None) -> None:
        """One turn of every live episode of every running call; calls whose episodes
        have all ended are marked ``done`` and leave the batcher.

        ``interrupt.safe_point()`` runs first (a weight update lands between turns) and the
        engine gets ``interrupt`` for its safe points within the turn.
        """
        with self._lock:
            calls = list(self._calls)
        live_calls = [c for c in calls if any(not e.done for e in c.episodes)]
        if live_calls and interrupt is not None:
            interrupt.safe_point()  # between turns: let a pending weight update in
        for temperature in dict.fromkeys(c.temperature for c in live_calls):
            same = [c for c in live_calls if c.temperature == temperature]
            live = [e for c in same for e in c.episodes if not e.done]
            _generate_turn(self.engine, self.tokenizer, live, self.cfg, temperature, interrupt)
            for c in same:
                c.stats.num_engine_calls += 1
        searching = [e for c in live_calls for e in c.episodes if e.pending_query is not None]
        if searching:
            failed = _retrieve_turn(self.client, self.tokenizer, searching, self.cfg)
            for c in live_calls:
                c.stats.num_retrieval_failures += int(
                    failed and any(e in searching for e in c.episodes)
                )
        for call in calls:
            for e in call.episodes:
                if not e.done and e.num_turns >= self.cfg.max_turns:
                    e.finish_reason = "max_turns"  # an invalid search in the last turn
            call.done = all(e.done for e in call.episodes)
        with self._lock:
            self._calls = [c for c in self._calls if not c.done]

    def result(self, call: RolloutCall) -> tuple[list[Trajectory], RolloutStats]:
        """The trajectories (record order, validated) and counters of a ``done`` call.

        Raises:
            RuntimeError: the call has not ended.
        """
        if not call.done:
            raise RuntimeError("result() of a rollout call that has not ended")
        trajectories = [_to_trajectory(self.tokenizer, e, self.cfg) for e in call.episodes]
        stats = call.stats
        stats.num_trajectories = len(trajectories)
        stats.num_retrieval_failed_trajectories = sum(t.retrieval_failed for t in trajectories)
        stats.num_generated_tokens = sum(sum(e.loss_mask) for e in call.episodes)
        stats.num_searches = sum(e.num_searches for e in call.episodes)
        stats.generation_s = sum(e.generation_s for e in call.episodes)
        stats.retrieval_s = sum(e.retrieval_s for e in call.episodes)
        stats.wall_s = time.perf_counter() - call.started_s
        return trajectories, stats


def run_rollout(
    engine: GenerationEngine,
    tokenizer,
    client: Retriever,
    records: Sequence[Mapping],
    group_ids: Sequence[str],
    cfg: RolloutConfig,
    temperature: float | None = None,
    interrupt: Interrupt | None = None,
) -> tuple[list[Trajectory], RolloutStats]:
    """Roll out one episode per record, batched across episodes every turn.

    Args:
        engine: The policy (HF or vLLM engine).
        tokenizer: The policy's tokenizer (chat template, encode/decode).
        client: Retriever, normally the HTTP client (its failures mark trajectories ``retrieval_failed``).
        records: QA records, one episode each (repeat a record for a GRPO group).
        group_ids: Same length as ``records``; episodes of one question share an id.
        cfg: Turn and token budgets, sampling settings, answer normalisation of the reward.
        temperature: Overrides ``cfg.temperature`` (0 = greedy evaluation).
        interrupt: Safe points for weight updates (:mod:`actors.engines.interrupt`):
            ``interrupt.safe_point()`` runs before every turn, and the engine gets it for
            its safe points within a turn. None: weights do not change during the call
            unless the engine changes them itself.

    Returns:
        ``(trajectories, stats)``: validated trajectories in record order, and counters.

    Raises:
        ValueError: empty input, mismatched lengths, or a malformed record.
    """
    batcher = ContinuousBatcher(engine, tokenizer, client, cfg)
    call = batcher.submit(
        records, group_ids, cfg.temperature if temperature is None else temperature
    )
    while not call.done:
        batcher.step(interrupt)
    return batcher.result(call)


def _new_episode(
    tokenizer, record: Mapping, group_id: str, system_prompt: str | None = None
) -> _Episode:
    check_record(record)
    ids = prompt_ids(tokenizer, record, system_prompt=system_prompt)
    return _Episode(record=record, group_id=group_id, prompt_ids=ids)


def _turn_budget(e: _Episode, cfg: RolloutConfig) -> int:
    return min(cfg.max_new_tokens_per_turn, cfg.max_response_tokens - len(e.response_ids))


def _generate_turn(
    engine: GenerationEngine,
    tokenizer,
    live: list[_Episode],
    cfg: RolloutConfig,
    temperature: float,
    interrupt: Interrupt | None = None,
) -> None:
    """One batched engine call for all live episodes; apply each result (each episode is
    charged an equal share of the call's wall time in ``generation_s``)."""
    budgets = [_turn_budget(e, cfg) for e in live]
    params = SamplingParams(
        max_new_tokens=max(budgets), temperature=temperature, top_p=cfg.top_p, stop=STOP_STRINGS
    )
    t0 = time.perf_counter()
    inputs = [e.engine_input() for e in live]
    if interrupt is None:
        results = engine.generate(inputs, params)
    else:
        results = engine.generate(inputs, params, interrupt=interrupt)
    elapsed = time.perf_counter() - t0
    if len(results) != len(live):
        raise RuntimeError(f"engine returned {len(results)} results for {len(live)} prompts")
    for e, result, budget in zip(live, results, budgets, strict=True):
        e.generation_s += elapsed / len(live)
        _apply_generation(tokenizer, e, result, budget, cfg)


def _apply_generation(
    tokenizer, e: _Episode, result: GenerationResult, budget: int, cfg: RolloutConfig
) -> None:
    """Append one turn's tokens (cut to this episode's budget) and decide what happens next."""
    token_ids, logprobs, reason = result.token_ids, result.logprobs, result.finish_reason
    versions, stop = result.token_versions, result.stop_string
    if len(token_ids) > budget:  # the batch used a larger budget than this episode has
        token_ids, logprobs, reason, stop = token_ids[:budget], logprobs[:budget], "length", None
        versions = versions[:budget]
    e.append_policy(list(token_ids), list(logprobs), list(versions), result.policy_version)
    text = tokenizer.decode(token_ids, skip_special_tokens=False)
    e.policy_texts.append(text)
    if reason == "stop" and stop == "</answer>":
        e.finish_reason = "answer"
    elif reason == "stop" and stop == "</search>":
        if e.num_turns >= cfg.max_turns:
            e.finish_reason = "max_turns"
        else:
            e.pending_query = extract_search_query(text) or ""
    elif reason == "eos":
        e.finish_reason = "eos"
    else:
        e.finish_reason = "max_tokens"


def _retrieve_turn(
    client: Retriever,
    tokenizer,
    searching: list[_Episode],
    cfg: RolloutConfig,
) -> bool:
    """One ``/retrieve`` request for all of this turn's valid queries; append the blocks.

    Returns True when the request failed (after the client's retries): its episodes end
    ``retrieval_failed``, with the error in ``retrieval_error``."""
    valid = [e for e in searching if e.pending_query]
    for e in searching:
        if not e.pending_query:  # "<search></search>": Search-R1's invalid-action reply
            e.num_invalid_searches += 1
            e.queries[-1] = ""
            _append_environment(e, invalid_search_ids(tokenizer), cfg)
    if not valid:
        return False
    queries = [e.pending_query for e in valid]
    t0 = time.perf_counter()
    try:
        passages = client.retrieve(queries)
        error = None
    except RetrievalFailed as err:
        passages, error = None, f"{err.reason}: {err}"
    elapsed = time.perf_counter() - t0
    for i, e in enumerate(valid):
        e.queries[-1] = e.pending_query
        e.pending_query = None
        e.num_searches += 1
        e.retrieval_s += elapsed / len(valid)
        if passages is None:
            e.retrieval_error = error
            e.finish_reason = "retrieval_failed"
        else:
            e.passages[-1] = tuple((p.id, p.title) for p in passages[i])
            block = information_ids(tokenizer, passages[i], cfg.max_information_tokens)
            _append_environment(e, block, cfg)
    return passages is None


def _append_environment(e: _Episode, block: list[int], cfg: RolloutConfig) -> None:
    """Append an environment block if it leaves room for at least one more policy token."""
    e.pending_query = None
    if len(e.response_ids) + len(block) >= cfg.max_response_tokens:
        e.finish_reason = "max_tokens"
        return
    e.append_environment(block)


def _to_trajectory(tokenizer, e: _Episode, cfg: RolloutConfig) -> Trajectory:
    record = e.record
    failed = e.finish_reason == "retrieval_failed"
    # the oldest / newest token; an episode without policy tokens: its turns' versions
    policy_versions = [v for v in e.token_versions if v >= 0] or e.versions
    reward = compute_reward("\n".join(e.policy_texts), record, cfg.answer_normalization)
    return Trajectory(
        prompt_ids=np.asarray(e.prompt_ids, dtype=np.int64),
        response_ids=np.asarray(e.response_ids, dtype=np.int64),
        loss_mask=np.asarray(e.loss_mask, dtype=np.int8),
        turn_ids=np.asarray(e.turn_ids, dtype=np.int32),
        behavior_logprobs=np.asarray(e.logprobs, dtype=np.float32),
        reward=0.0 if failed else reward.reward,
        success=False if failed else reward.success,
        num_searches=e.num_searches,
        num_turns=e.num_turns,
        policy_version_min=min(policy_versions),
        policy_version_max=max(policy_versions),
        group_id=e.group_id,
        question_id=str(record["id"]),
        data_source=str(record["data_source"]),
        finish_reason=str(e.finish_reason),
        malformed_reason=None if failed else reward.malformed_reason,
        retrieval_failed=failed,
        generation_s=e.generation_s,
        retrieval_s=e.retrieval_s,
        answer=None if failed else reward.answer,
        extra={
            "num_invalid_searches": e.num_invalid_searches,
            "retrieval_error": e.retrieval_error,
        },
        transcript=_transcript(e, None if failed else reward.answer, cfg.answer_normalization),
        token_versions=np.asarray(e.token_versions, dtype=np.int32),
    ).validate()


def _transcript(e: _Episode, answer: str | None, normalization: str = "folded") -> Transcript:
    """The episode in words: question, turns with their searches and passages, and the
    forms its answer was compared in (:func:`actors.scoring.compared_forms` under the
    rollout's ``answer_normalization``)."""
    record = e.record
    forms = compared_forms(answer, record, normalization)
    turns = zip(e.policy_texts, e.queries, e.passages, strict=True)
    return Transcript(
        question=str(record["question"]),
        golden_answers=tuple(str(g) for g in record["golden_answers"]),
        turns=tuple(TurnTranscript(t, q, p) for t, q, p in turns),
        scoring_method=forms.method,
        compared_prediction=forms.prediction,
        compared_golden=forms.golden,
    )


class RolloutWorker:
    """One rollout actor's state: engine, tokenizer, retrieval client; Ray-free.

    The service layer wraps it with ``ray.remote(RolloutWorker)``; every public method is a
    plain call with picklable arguments and results.

    Args:
        model_path: HF model folder of the initial policy (``policy_version`` 0).
        rollout_cfg: Engine choice, group size, turn/token budgets, sampling, client config.
        retrieval_url: Base URL of the retrieval server.
        seed: Engine sampling seed (distinct per actor).
        engine: An already-built engine to use instead of building one (tests, benchmarks).

    Example:
        >>> worker = RolloutWorker("data/model/smollm2-135m-instruct", RolloutConfig(), url, 0)
        >>> trajectories = worker.rollout(records)  # len(records) * group_size
    """

    def __init__(
        self,
        model_path: str,
        rollout_cfg: RolloutConfig,
        retrieval_url: str,
        seed: int = 0,
        engine: GenerationEngine | None = None,
    ) -> None:
        self.cfg = rollout_cfg
        self.seed = seed
        self.engine = engine if engine is not None else build_engine(model_path, rollout_cfg, seed)
        self.tokenizer = self.engine.tokenizer
        self.batcher = ContinuousBatcher(
            self.engine, self.tokenizer, RetrievalClient(retrieval_url, rollout_cfg.retrieval),
            rollout_cfg,
        )  # fmt: skip
        self.temperature = rollout_cfg.temperature
        self.total_stats = RolloutStats()
        self.last_stats = RolloutStats()
        self.gate = WeightGate(in_flight=self.batcher.has_started_episodes)
        self._stats_lock = threading.Lock()
        self._inflight_reported = 0  # gate.num_inflight_updates already written on a batch
        self.interrupt_every_tokens = rollout_cfg.interrupt_every_tokens
        self._batches = itertools.count()
        self.engine_metrics_url, self._metrics_server = (None, None)
        if rollout_cfg.engine_metrics_port is not None:
            self.engine_metrics_url, self._metrics_server = serve_engine_metrics(
                self.engine, rollout_cfg.engine_metrics_host, rollout_cfg.engine_metrics_port
            )

    @property
    def client(self) -> Retriever:
        """The retriever every rollout call uses (the HTTP client unless replaced)."""
        return self.batcher.client

    @client.setter
    def client(self, client: Retriever) -> None:
        self.batcher.client = client

    def rollout(
        self, records: list[dict], greedy: bool = False, min_policy_version: int | None = None
    ) -> list[Trajectory]:
        """Generate ``group_size`` episodes per record (1 per record when ``greedy``).

        With ``interrupt_every_tokens > 0`` weight loads arriving on another thread are let
        in at safe points (between turns, every N tokens; :mod:`actors.engines.interrupt`);
        otherwise they wait for this call to return. The count of those that landed is
        ``last_stats.num_inflight_weight_updates``, and is also written on the batch's first
        trajectory (``extra["inflight_weight_updates"]``, 0 on the others: summing over
        trajectories counts each update once).

        Continuous batching (``rollout.calls_per_actor > 1``; the Ray actor then runs that
        many of these calls on threads of their own): the call's episodes join the
        actor's :class:`ContinuousBatcher`, and whichever running call holds the engine
        steps every call's episodes turn by turn; weight loads also land between turns.
        Each update that lands while tokens are in flight is reported by exactly one call.

        Args:
            records: QA records (``id``, ``question``, ``golden_answers``, ``data_source``).
            greedy: Evaluation mode: temperature 0, one episode per record.
            min_policy_version: Wait until the engine holds at least this version before
                generating (the driver's last push to this actor, whose load may run on the
                loader thread after this call started), at most
                ``rollout.weight_wait_timeout_s``. None: start at once.

        Returns:
            Validated trajectories, grouped by record (``group_id`` shared within a group);
            each token's version is at least ``min_policy_version``.

        Raises:
            ValueError: empty ``records`` or a record missing a required key.
            TimeoutError: ``min_policy_version`` did not land in time.
        """
        if not records:
            raise ValueError("rollout() needs at least one record")
        waited = time.perf_counter()
        if min_policy_version is not None:
            self.gate.wait_for_version(
                lambda: self.engine.policy_version,
                min_policy_version,
                self.cfg.weight_wait_timeout_s,
            )
        waited = time.perf_counter() - waited
        batch = next(self._batches)
        group_size = 1 if greedy else self.cfg.group_size
        expanded = [r for r in records for _ in range(group_size)]
        group_ids = [
            f"s{self.seed}-b{batch}-q{i}" for i in range(len(records)) for _ in range(group_size)
        ]
        interrupt = self._interrupt(self.interrupt_every_tokens)
        temperature = 0.0 if greedy else self.temperature
        call = self.batcher.submit(expanded, group_ids, temperature)
        # whoever holds the gate steps every running call's episodes (continuous batching);
        # this call's thread takes over when the holder's own call has ended
        with self.gate.generating():
            while not call.done:
                self.batcher.step(interrupt)
                if not call.done and self.cfg.calls_per_actor > 1:
                    self.gate.safe_point()  # between turns, whatever the interrupt
        trajectories, stats = self.batcher.result(call)
        with self._stats_lock:  # each in-flight update is reported by one batch only
            landed = self.gate.num_inflight_updates - self._inflight_reported
            self._inflight_reported += landed
            stats.num_inflight_weight_updates = landed
            stats.weight_wait_s = waited
            self.last_stats = stats
            self.total_stats.add(stats)
        for k, t in enumerate(trajectories):
            t.extra["inflight_weight_updates"] = landed if k == 0 else 0
        return trajectories

    def load_weights(self, state_dict: dict, policy_version: int) -> float:
        """Load new policy weights in place (see the engine); returns the seconds from the
        call to loaded (what the driver adds to the export time in
        ``stppo_weight_sync_seconds``, as :meth:`receive_weights` returns for the
        collective transport). The new version is :meth:`get_policy_version`.

        Thread-safe: called on the actor's loader thread while a rollout runs, it waits for
        the rollout's next safe point (``interrupt_every_tokens > 0``) or its end."""
        started = time.perf_counter()
        with self.gate.updating():
            self.engine.load_weights(state_dict, policy_version)
        return time.perf_counter() - started

    def _interrupt(self, every_tokens: int) -> Interrupt | None:
        """The safe points of a rollout with ``interrupt_every_tokens = every_tokens``."""
        if every_tokens == 0:
            return None
        return Interrupt(every_tokens, self.gate.safe_point, lambda: self.gate.update_waiting)

    def set_interrupt_every_tokens(self, every_tokens: int) -> None:
        """Change ``rollout.interrupt_every_tokens`` (live; from the next rollout on).

        Raises:
            ValueError: a negative value.
        """
        if every_tokens < 0:
            raise ValueError(f"interrupt_every_tokens must be >= 0, got {every_tokens}")
        self.interrupt_every_tokens = every_tokens

    def join_weight_group(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        backend: str,
        timeout_s: float,
        join_timeout_s: float = 60.0,
    ) -> None:
        """Join the ``collective`` weight-sync group as ``rank`` (see
        :mod:`actors.weight_group`; blocks until every member has joined, at most
        ``join_timeout_s``), listening on this node's IP. A previous membership is left
        first.

        Raises:
            actors.rendezvous.GroupJoinError: the group did not form in time."""
        from actors.weight_group import WeightGroup

        self.leave_weight_group()
        self._weight_group = WeightGroup(
            host, port, rank, world_size, backend, timeout_s, join_timeout_s=join_timeout_s
        )

    def node_address(self) -> str:
        """The address this worker listens on for the weight-sync group: its node's IP as
        Ray knows it (:func:`actors.rendezvous.node_ip`)."""
        from actors.rendezvous import node_ip

        return node_ip()

    def leave_weight_group(self) -> None:
        """Leave the weight-sync group, if in one."""
        group = getattr(self, "_weight_group", None)
        if group is not None:
            group.close()
        self._weight_group = None

    def receive_weights(self, metas: list) -> float:
        """Receive one broadcast of the policy (``metas``: the
        :class:`actors.weight_group.TensorMeta` plan) and load it into the engine in place,
        tensor by tensor as it arrives (the engine's ``load_weights`` on the receive
        stream: one tensor in flight, never a second copy of the model). The engine is
        held for the whole receive, so the broadcast starts at the rollout's next safe
        point (``rollout.interrupt_every_tokens``) or the end of its batch. Returns the
        seconds from the first tensor to loaded.

        Raises:
            RuntimeError: this worker is not in a weight-sync group.
        """
        group = getattr(self, "_weight_group", None)
        if group is None:
            raise RuntimeError("receive_weights before join_weight_group")
        with self.gate.updating():
            version, tensors = group.receive(metas)
            started = time.perf_counter()
            self.engine.load_weights(tensors, version)
        return time.perf_counter() - started

    def get_policy_version(self) -> int:
        """The engine's current ``policy_version`` (a method: Ray actors expose no properties)."""
        return self.engine.policy_version

    def stats(self) -> dict[str, RolloutStats]:
        """``{"last": stats of the last rollout, "total": since start}`` (plus the client's)."""
        return {"last": self.last_stats, "total": self.total_stats, "retrieval": self.client.stats}

    def metrics_url(self) -> str | None:
        """URL of this actor's engine metrics (None when not served); see
        ``rollout.engine_metrics_port``."""
        return self.engine_metrics_url

    def close(self) -> None:
        """Close the HTTP connection pool and the engine metrics endpoint."""
        self.client.close()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
            self._metrics_server = None
