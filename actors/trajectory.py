"""The wire contract between rollout actors and the learner.

A :class:`Trajectory` is one multi-turn episode of the search agent: the chat-formatted
prompt, then a response made of policy turns interleaved with environment
(``<information>``) blocks. All per-token arrays are aligned with ``response_ids``
(length R); the prompt carries no per-token fields because nothing in it is trained on.

Token layout (R = len(response_ids)):

    prompt_ids                 response_ids
    [system+user chat prompt]  [turn 0 tokens][<information>...</information>][turn 1 tokens]...
    loss_mask                  [1 1 1 ... 1  ][0 0 0 ... 0                    ][1 1 ... 1    ]
    turn_ids                   [0 0 0 ... 0  ][-1 -1 ... -1                   ][1 1 ... 1    ]
    behavior_logprobs          [lp lp ... lp ][0 0 0 ... 0                    ][lp ... lp    ]
    token_versions             [v v v ... v+1][-1 -1 ... -1                   ][v+1 ... v+2  ]

Invariants (checked by :meth:`Trajectory.validate`):
- ``loss_mask[t] == 1`` exactly where ``turn_ids[t] >= 0`` (policy-generated tokens);
- turn ids are non-decreasing over policy tokens and each turn is one contiguous run;
- ``behavior_logprobs`` is 0.0 wherever ``loss_mask == 0``;
- ``policy_version_min <= policy_version_max``;
- ``token_versions`` (when recorded) is -1 exactly off the policy tokens, non-decreasing
  over the policy tokens, and its minimum / maximum there are ``policy_version_min`` /
  ``policy_version_max``. A weight update may land mid-turn (interruptible generation,
  ``rollout.interrupt_every_tokens``), so one turn can span two versions; each token's
  ``behavior_logprobs`` entry is its probability under the version that sampled it.

Staleness of a trajectory is defined by its OLDEST token: ``learner_version -
policy_version_min`` (what admission, the buffer's bound and the ``staleness`` metric use).
Per token it is ``learner_version - token_versions[t]`` (:meth:`Trajectory.token_staleness`),
never larger than the trajectory's.
- a :class:`Transcript`, when present, has one entry per policy turn, its non-empty
  search queries number ``num_searches``, and only a turn that searched has passages.

The transcript is what a person reads (``eval_samples.jsonl``, ``samples.jsonl``: see
:mod:`services.records`); the learner never needs it, and the driver strips it
(:meth:`Trajectory.without_transcript`) before a batch is shipped to the learner.

Arrays are numpy (cheap to pickle through the Ray object store, no torch needed to build one).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class TurnTranscript:
    """One policy turn as the environment saw it.

    Attributes:
        text: The turn's decoded policy text (special tokens kept), uncapped.
        search_query: The query sent to retrieval after this turn; ``""`` for an empty
            ``<search></search>`` (answered with the invalid-action reply); None when the
            turn did not search (it answered, stopped, or searched in the last allowed turn).
        passages: ``(passage id, title)`` of each passage retrieval returned for the query,
            in rank order; empty when the search failed or the turn did not search.
    """

    text: str
    search_query: str | None = None
    passages: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Transcript:
    """What an episode said and how it was scored, for per-question records.

    Attributes:
        question: The question as put to the policy.
        golden_answers: The accepted answers (aliases, or option letters).
        turns: One :class:`TurnTranscript` per policy turn, in order.
        scoring_method: ``exact_match`` or ``option_letter`` (see :mod:`actors.scoring`).
        compared_prediction: The normalised answer (exact match) or extracted option letter
            that was compared; None when there was no answer (malformed) or no letter.
        compared_golden: The normalised golden answers (exact match) or golden letters.
    """

    question: str
    golden_answers: tuple[str, ...]
    turns: tuple[TurnTranscript, ...]
    scoring_method: str
    compared_prediction: str | None
    compared_golden: tuple[str, ...]


@dataclass(frozen=True)
class TurnSummary:
    """Mean, min and max of a per-token value over one policy turn's tokens."""

    mean: float
    min: float
    max: float


def per_turn_summary(values: np.ndarray, turn_ids: np.ndarray) -> list[TurnSummary]:
    """Summarise a per-token value (behaviour log-probs, advantages) turn by turn.

    Args:
        values: float [R], aligned with ``turn_ids`` (extra trailing padding is ignored
            when ``turn_ids`` there is -1).
        turn_ids: int [R], the turn index per policy token, -1 elsewhere.

    Returns:
        One :class:`TurnSummary` per turn ``0 .. max(turn_ids)``, in order; empty when no
        token is a policy token. A turn without tokens gets NaNs.

    Raises:
        ValueError: ``values`` and ``turn_ids`` differ in length.

    Example::

        >>> per_turn_summary(np.array([1.0, 3.0, 0.0, 5.0]), np.array([0, 0, -1, 1]))[0].mean
        2.0
    """
    values, turn_ids = np.asarray(values, dtype=np.float64), np.asarray(turn_ids)
    if values.shape != turn_ids.shape:
        raise ValueError(f"values {values.shape} and turn_ids {turn_ids.shape} differ")
    out = []
    for k in range(int(turn_ids.max(initial=-1)) + 1):
        v = values[turn_ids == k]
        if v.size == 0:
            out.append(TurnSummary(float("nan"), float("nan"), float("nan")))
        else:
            out.append(TurnSummary(float(v.mean()), float(v.min()), float(v.max())))
    return out


@dataclass
class Trajectory:
    """One rollout of the multi-turn search agent.

    Attributes:
        prompt_ids: int64 [P]. Chat-formatted prompt tokens (system + user question).
        response_ids: int64 [R]. Everything after the prompt: policy turns and
            environment blocks, in the order the engine saw them.
        loss_mask: int8 [R]. 1 on policy-generated tokens, 0 on environment tokens.
        turn_ids: int32 [R]. Policy turn index (0, 1, ...) per token, -1 on environment tokens.
        behavior_logprobs: float32 [R]. Log-prob of each sampled token under the behaviour
            policy (the engine's weights at generation time), natural log; 0 where masked out.
        reward: Scalar reward of the episode (exact match / option letter; 0 if malformed).
        success: Whether the final answer was correct.
        num_searches: ``<search>`` calls made.
        num_turns: Policy turns generated.
        policy_version_min: Oldest weight version that generated any token of this trajectory.
        policy_version_max: Newest such version (differs from min only if weights changed
            during this episode: between turns, or mid-turn with interruptible generation).
        group_id: Identifies samples of the same question in the same batch (GRPO groups).
        question_id: Stable id of the question (``<data_source>/<split>/<index>``).
        data_source: QA set the question comes from (``single_hop``, ``multi_hop``, ``medical_mc``).
        finish_reason: ``answer`` | ``eos`` (the policy ended its message without searching or
            answering) | ``max_turns`` | ``max_tokens`` | ``retrieval_failed``.
        malformed_reason: Why the output was malformed (``no_answer``, ``empty_answer``,
            ``bad_tag`` ...), or None when well-formed.
        retrieval_failed: A search still failed after all retries; such trajectories are
            excluded from training and counted.
        generation_s: Wall seconds spent inside the engine for this trajectory's batch share.
        retrieval_s: Wall seconds spent waiting for the retrieval server.
        answer: The extracted ``<answer>`` text (None if absent).
        extra: Free-form diagnostics: ``num_invalid_searches`` (empty ``<search></search>``)
            and ``retrieval_error`` (``"<reason>: <message>"`` when a search failed).
        transcript: The episode's turns, searches, passages and scoring in words
            (:class:`Transcript`), or None (stripped before training, or not recorded).
        token_versions: int32 [R] or None. The ``policy_version`` that sampled each policy
            token, -1 on environment tokens. None = not recorded (trajectories built
            outside the rollout loop): :meth:`policy_token_versions` then reads every
            policy token as ``policy_version_min`` (the conservative, oldest reading).
    """

    prompt_ids: np.ndarray
    response_ids: np.ndarray
    loss_mask: np.ndarray
    turn_ids: np.ndarray
    behavior_logprobs: np.ndarray
    reward: float
    success: bool
    num_searches: int
    num_turns: int
    policy_version_min: int
    policy_version_max: int
    group_id: str
    question_id: str
    data_source: str
    finish_reason: str
    malformed_reason: str | None = None
    retrieval_failed: bool = False
    generation_s: float = 0.0
    retrieval_s: float = 0.0
    answer: str | None = None
    extra: dict = field(default_factory=dict)
    transcript: Transcript | None = None
    token_versions: np.ndarray | None = None

    @property
    def num_response_tokens(self) -> int:
        """R, the response length in tokens (policy + environment)."""
        return int(self.response_ids.shape[0])

    @property
    def num_policy_tokens(self) -> int:
        """Tokens the loss trains on (sum of ``loss_mask``)."""
        return int(self.loss_mask.sum())

    def staleness(self, learner_version: int) -> int:
        """``learner_version - policy_version_min``: how many updates old the oldest token is."""
        return learner_version - self.policy_version_min

    def policy_token_versions(self) -> np.ndarray:
        """int64 [R]: the version that sampled each token, -1 on environment tokens
        (``policy_version_min`` on every policy token when ``token_versions`` is None)."""
        if self.token_versions is not None:
            return np.asarray(self.token_versions, dtype=np.int64)
        return np.where(self.loss_mask.astype(bool), self.policy_version_min, -1).astype(np.int64)

    def token_staleness(self, learner_version: int) -> np.ndarray:
        """int64 [num_policy_tokens]: ``learner_version - version`` of each policy token, in
        order. Its maximum is :meth:`staleness` (the oldest token)."""
        versions = self.policy_token_versions()
        return learner_version - versions[self.loss_mask.astype(bool)]

    def version_counts(self) -> dict[int, int]:
        """version -> number of policy tokens it sampled (tokens per version)."""
        versions = self.policy_token_versions()
        values, counts = np.unique(versions[versions >= 0], return_counts=True)
        return {int(v): int(c) for v, c in zip(values, counts, strict=True)}

    def validate(self) -> Trajectory:
        """Check the token-accounting invariants of the module docstring.

        Returns:
            self, so ``Trajectory(...).validate()`` chains.

        Raises:
            ValueError: naming the violated invariant.
        """
        r = self.response_ids.shape[0]
        for name in ("loss_mask", "turn_ids", "behavior_logprobs"):
            arr = getattr(self, name)
            if arr.ndim != 1 or arr.shape[0] != r:
                raise ValueError(f"{name} has shape {arr.shape}, expected ({r},) like response_ids")
        if self.prompt_ids.ndim != 1 or self.prompt_ids.shape[0] == 0:
            raise ValueError("prompt_ids must be a non-empty 1-D array")
        policy = self.turn_ids >= 0
        if not np.array_equal(policy, self.loss_mask.astype(bool)):
            raise ValueError("loss_mask must be 1 exactly where turn_ids >= 0")
        if np.any(self.behavior_logprobs[~policy] != 0.0):
            raise ValueError("behavior_logprobs must be 0 on environment tokens")
        if np.any(self.behavior_logprobs[policy] > 0.0):
            raise ValueError("behavior_logprobs must be <= 0 (natural-log probabilities)")
        tids = self.turn_ids[policy]
        if tids.size:
            if tids[0] != 0 or np.any(np.diff(tids) < 0) or np.any(np.diff(tids) > 1):
                raise ValueError("turn ids must start at 0 and increase by at most 1")
            # each turn one contiguous run: number of runs of policy tokens == number of turns
            starts = np.flatnonzero(np.diff(np.concatenate([[0], policy.astype(np.int8)])) == 1)
            if starts.size != int(tids[-1]) + 1:
                raise ValueError("each turn must be one contiguous run of policy tokens")
        if self.policy_version_min > self.policy_version_max:
            raise ValueError("policy_version_min must be <= policy_version_max")
        if self.token_versions is not None:
            self._validate_token_versions(np.asarray(self.token_versions), policy)
        if self.transcript is not None:
            self._validate_transcript(self.transcript)
        return self

    def _validate_token_versions(self, versions: np.ndarray, policy: np.ndarray) -> None:
        if versions.ndim != 1 or versions.shape[0] != policy.shape[0]:
            raise ValueError(
                f"token_versions has shape {versions.shape}, expected ({policy.shape[0]},)"
            )
        if np.any(versions[~policy] != -1):
            raise ValueError("token_versions must be -1 on environment tokens")
        on_policy = versions[policy]
        if on_policy.size == 0:
            return
        if np.any(on_policy < 0):
            raise ValueError("token_versions must be >= 0 on policy tokens")
        if np.any(np.diff(on_policy) < 0):
            raise ValueError("token_versions must be non-decreasing over the policy tokens")
        if (int(on_policy[0]), int(on_policy[-1])) != (
            self.policy_version_min,
            self.policy_version_max,
        ):
            raise ValueError(
                f"token_versions span {int(on_policy[0])}..{int(on_policy[-1])} but "
                f"policy_version_min/max are {self.policy_version_min}/{self.policy_version_max}"
            )

    def _validate_transcript(self, transcript: Transcript) -> None:
        turns = transcript.turns
        if len(turns) != self.num_turns:
            raise ValueError(f"transcript has {len(turns)} turns, num_turns is {self.num_turns}")
        searched = sum(bool(t.search_query) for t in turns)
        if searched != self.num_searches:
            raise ValueError(
                f"transcript has {searched} search queries, num_searches is {self.num_searches}"
            )
        if any(t.passages and not t.search_query for t in turns):
            raise ValueError("transcript: passages on a turn that sent no search query")

    def without_transcript(self) -> Trajectory:
        """A shallow copy without the transcript (what the learner is sent: it trains on
        tokens only, so the text need not travel)."""
        return dataclasses.replace(self, transcript=None)

    def to_dict(self) -> dict:
        """Plain-dict form (arrays as lists) for JSONL logs and tests."""
        out = dataclasses.asdict(self)
        for k, v in out.items():
            if isinstance(v, np.ndarray):
                out[k] = v.tolist()
        return out
