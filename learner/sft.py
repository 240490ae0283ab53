"""Warm-start SFT: teach the policy the search-agent tool format before RL.

A demonstration is an ordinary :class:`actors.trajectory.Trajectory` built from a training
QA record: for each query in ``record["metadata"]["search_queries"]`` (the gold entity, then
the bridge entity for multi-hop) a policy turn ``<think> ... </think>\\n<search> q
</search>``, the real retrieval server's ``<information>`` block (environment tokens,
``loss_mask = 0``), and a final policy turn ``<think> ... </think>\\n<answer> gold
</answer>``. Prompt, information block and turn layout come from :mod:`actors.prompts`, the
same code the rollout actors use, so the learned format is exactly the one the rollout
parses. Cross-entropy is taken on policy tokens only (the mask selects what is trained).

Source of the format: Search-R1 (Jin et al., 2025); the warm start itself is our choice (a
135M model does not follow the tool format zero-shot).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from torch import Tensor

from actors.prompts import information_ids, prompt_ids
from actors.retrieval_client import Passage
from actors.scoring import is_multiple_choice, normalize_answer
from actors.trajectory import Trajectory
from learner.batch import collate_trajectories
from learner.config import SFTConfig
from learner.distributed import all_reduce_floats
from learner.step_metrics import SupervisedStepMetrics, read_scalars

RetrieveFn = Callable[[list[str]], list[list[Passage]]]
"""``queries -> top-k passages per query`` (e.g. ``RetrievalClient(...).retrieve``)."""

SEARCH_THOUGHT = "<think> I need to look up {query}. </think>\n<search> {query} </search>"
"""Policy text of a demonstration search turn."""

ANSWER_THOUGHT = (
    "<think> The information answers the question. </think>\n<answer> {answer} </answer>"
)
"""Policy text of the demonstration's final turn."""


class DemonstrationError(ValueError):
    """A QA record cannot be turned into a demonstration (the message says why)."""


@dataclass
class DemonstrationSet:
    """Demonstrations and what was dropped while building them.

    Attributes:
        demonstrations: the trajectories (``extra["demonstration"] = True``).
        num_records: records tried.
        num_answer_not_retrieved: dropped because no retrieved passage contains a gold
            answer (only with ``require_answer_in_passages``).
        num_invalid: dropped records (no search queries, no gold answer...), with reasons
            in ``invalid_reasons``.
        num_early_answer: demonstrations that stopped after their first search and answered
            what it returned (``early_answer_share``).
        num_early_eligible: records that could be (more than one search and a
            ``metadata.partial_answer``).
    """

    demonstrations: list[Trajectory] = field(default_factory=list)
    num_records: int = 0
    num_answer_not_retrieved: int = 0
    num_invalid: int = 0
    invalid_reasons: list[str] = field(default_factory=list)
    num_early_answer: int = 0
    num_early_eligible: int = 0


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _search_queries(record: Mapping) -> list[str]:
    """``metadata.search_queries``; a record without them (your own QA files) searches its
    question text once."""
    meta = record.get("metadata") or {}
    if "search_queries" not in meta and isinstance(record.get("question"), str):
        return [record["question"].strip().split("\n")[0]]
    queries = meta.get("search_queries")
    if (
        not isinstance(queries, list)
        or not queries
        or not all(isinstance(q, str) and q.strip() for q in queries)
    ):
        raise DemonstrationError(
            f"record {record.get('id')!r}: metadata.search_queries must be a non-empty list of "
            "non-empty strings"
        )
    return [q.strip() for q in queries]


def _gold_answer(record: Mapping) -> str:
    golden = record.get("golden_answers")
    if not isinstance(golden, list) or not golden or not str(golden[0]).strip():
        raise DemonstrationError(f"record {record.get('id')!r} has no golden answer")
    return str(golden[0]).strip()


def answer_in_passages(record: Mapping, passages: Sequence[Passage]) -> bool:
    """Whether a normalised gold alias occurs in a retrieved passage's normalised text
    (multiple choice: the correct option's text). Used to skip demonstrations that would
    teach answering without evidence."""
    if is_multiple_choice(record):
        meta = record.get("metadata") or {}
        letter = str(meta.get("answer_letter", record["golden_answers"][0]))
        aliases = [str((meta.get("options") or {}).get(letter, ""))]
    else:
        aliases = [str(a) for a in record["golden_answers"]]
    wanted = [normalize_answer(a) for a in aliases if normalize_answer(a)]
    texts = [normalize_answer(f"{p.title} {p.text}") for p in passages]
    return any(a in t for a in wanted for t in texts)


def build_demonstration(
    record: Mapping,
    tokenizer,
    retrieve_fn: RetrieveFn,
    *,
    max_information_tokens: int = 256,
    require_answer_in_passages: bool = True,
    system_prompt: str | None = None,
    early_answer: bool = False,
) -> Trajectory | None:
    """One demonstration trajectory for a QA record (format in the module docstring).

    Args:
        record: QA record with ``question``, ``golden_answers``, ``data_source`` and
            ``metadata.search_queries``.
        tokenizer: the policy's tokenizer (chat template required).
        retrieve_fn: the real retrieval server's client (``RetrievalClient.retrieve``).
        max_information_tokens: budget of one information block (the rollout's
            ``max_information_tokens``).
        require_answer_in_passages: return None when no retrieved passage contains a gold
            answer.
        system_prompt: the agent's system message (``rollout.system_prompt``; None =
            Search-R1's), so the demonstrations show the prompt the rollouts will use.
        early_answer: stop after the first search and answer what it returned, the
            record's ``metadata.partial_answer`` (a demonstrator that missed that the
            question asks about a linked record). Such a demonstration is never dropped for
            ``require_answer_in_passages``.

    Returns:
        A validated :class:`Trajectory` (``behavior_logprobs = 0``, ``policy_version =
        -1``: not generated by any policy; ``reward = 1``, or 0 for an early answer that is
        not a gold one), or None (see above).

    Raises:
        DemonstrationError: record without search queries or gold answer; ``early_answer``
            for a record without ``metadata.partial_answer``.
        actors.retrieval_client.RetrievalFailed: the server did not answer.
    """
    queries = _search_queries(record)
    if early_answer:
        partial = _partial_answer(record)
        if not partial:
            raise DemonstrationError(f"record {record.get('id')!r}: no metadata.partial_answer")
        queries = queries[:1]
    answer = _gold_answer(record)
    if is_multiple_choice(record):
        answer = str((record.get("metadata") or {}).get("answer_letter", answer))
    correct = not early_answer or str(partial) == answer
    answer = str(partial) if early_answer else answer
    response: list[int] = []
    loss_mask: list[int] = []
    turn_ids: list[int] = []
    retrieved: list[Passage] = []
    for turn, query in enumerate(queries):
        policy = _encode(tokenizer, SEARCH_THOUGHT.format(query=query))
        passages = retrieve_fn([query])[0]
        retrieved.extend(passages)
        env = information_ids(tokenizer, passages, max_information_tokens)
        response += policy + env
        loss_mask += [1] * len(policy) + [0] * len(env)
        turn_ids += [turn] * len(policy) + [-1] * len(env)
    if (
        require_answer_in_passages
        and not early_answer
        and not answer_in_passages(record, retrieved)
    ):
        return None
    final = _encode(tokenizer, ANSWER_THOUGHT.format(answer=answer))
    response += final
    loss_mask += [1] * len(final)
    turn_ids += [len(queries)] * len(final)
    return Trajectory(
        prompt_ids=np.asarray(
            prompt_ids(tokenizer, record, system_prompt=system_prompt), dtype=np.int64
        ),
        response_ids=np.asarray(response, dtype=np.int64),
        loss_mask=np.asarray(loss_mask, dtype=np.int8),
        turn_ids=np.asarray(turn_ids, dtype=np.int32),
        behavior_logprobs=np.zeros(len(response), dtype=np.float32),
        reward=1.0 if correct else 0.0,
        success=correct,
        num_searches=len(queries),
        num_turns=len(queries) + 1,
        policy_version_min=-1,
        policy_version_max=-1,
        group_id=f"demo/{record['id']}",
        question_id=str(record["id"]),
        data_source=str(record["data_source"]),
        finish_reason="answer",
        answer=answer,
        extra={"demonstration": True, "early_answer": early_answer},
    ).validate()


def build_demonstrations(
    records: Sequence[Mapping],
    tokenizer,
    retrieve_fn: RetrieveFn,
    *,
    max_information_tokens: int = 256,
    require_answer_in_passages: bool = True,
    system_prompt: str | None = None,
    early_answer_share: float = 0.0,
    seed: int = 0,
) -> DemonstrationSet:
    """:func:`build_demonstration` over many records; invalid records are counted with
    their reason, not raised (a retrieval failure still raises: that is an outage).

    With ``early_answer_share`` each demonstration of a question that names a
    ``metadata.partial_answer`` and needs more than one search (each entry of ``records``:
    a question drawn twice is demonstrated twice, independently) stops after its first
    search with that probability and answers what that search returned
    (``early_answer``). Seeded by ``seed``. The answer is always one the demonstration
    read, so the policy learns one way of answering (copy from the last passage) and a
    decision, search again or answer now; a guessed answer instead taught the synthetic
    task's policy to answer against what it read.

    Raises:
        ValueError: if ``early_answer_share > 0`` and no record is eligible (the share would
            silently do nothing; the synthetic task writes ``partial_answer`` since its
            version 2). Checked before any retrieval.
    """
    eligibility = [
        len(_search_queries_or_none(record)) > 1 and bool(_partial_answer(record))
        for record in records
    ]
    if early_answer_share > 0.0 and not any(eligibility):
        raise ValueError(
            f"sft.early_answer_share = {early_answer_share} but none of the {len(records)} "
            "demonstrated questions needs two searches and names a metadata.partial_answer "
            "(the synthetic task writes them since its version 2: stppo prepare-synthetic "
            "--force)"
        )
    out = DemonstrationSet()
    rng = random.Random(seed)
    for record, eligible in zip(records, eligibility, strict=True):
        out.num_records += 1
        out.num_early_eligible += int(eligible)
        early = eligible and early_answer_share > 0.0 and rng.random() < early_answer_share
        try:
            demo = build_demonstration(
                record,
                tokenizer,
                retrieve_fn,
                max_information_tokens=max_information_tokens,
                require_answer_in_passages=require_answer_in_passages,
                system_prompt=system_prompt,
                early_answer=early,
            )
        except DemonstrationError as err:
            out.num_invalid += 1
            out.invalid_reasons.append(str(err))
            continue
        if demo is None:
            out.num_answer_not_retrieved += 1
        else:
            out.demonstrations.append(demo)
            out.num_early_answer += int(early)
    return out


def _partial_answer(record: Mapping) -> str | None:
    """``metadata.partial_answer``: what stopping after the first search answers (None where
    the record names none)."""
    return (record.get("metadata") or {}).get("partial_answer")


def _search_queries_or_none(record: Mapping) -> list[str]:
    """The record's search queries, [] where it has none (it fails as a demonstration)."""
    try:
        return _search_queries(record)
    except DemonstrationError:
        return []


@dataclass
class WarmStartReport:
    """What :func:`run_warm_start` did.

    Attributes:
        losses: token-mean cross-entropy (nats/token) of each optimizer step, in order.
        num_steps: optimizer steps taken (skipped ones included).
        num_skipped: steps skipped by the non-finite guard.
        num_demonstrations: demonstrations trained on.
        wall_s: total seconds.
        policy_version: the learner's version afterwards.
    """

    losses: list[float]
    num_steps: int
    num_skipped: int
    num_demonstrations: int
    wall_s: float
    policy_version: int


def print_progress(step: int, total: int, loss: float, elapsed_s: float) -> None:
    """The warm start's progress line (stdout; a Ray actor's stdout reaches the driver):
    ``[warm start] step 3/12 loss 1.234, 55.0 s/step, ETA 8m15s``."""
    per_step = elapsed_s / step
    eta = round(per_step * (total - step))
    print(
        f"[warm start] step {step}/{total} loss {loss:.3f}, {per_step:.1f} s/step, "
        f"ETA {eta // 60}m{eta % 60:02d}s",
        flush=True,
    )


def run_warm_start(
    learner,
    demonstrations: Sequence[Trajectory],
    config: SFTConfig,
    *,
    seed: int = 0,
    progress: Callable[[int, int, float, float], None] | None = None,
) -> WarmStartReport:
    """Supervised warm start of ``learner``'s policy on demonstrations.

    ``config.epochs`` shuffled passes in batches of ``config.batch_size`` (the last batch of
    a pass may be smaller), one :meth:`learner.trainer.Learner.supervised_step` each, at
    learning rate ``config.lr``; the learner's RL learning rate is restored afterwards.

    ``progress(step, total_steps, loss, elapsed_s)`` is called after every step (e.g.
    :func:`print_progress`).

    Raises:
        ValueError: no demonstrations.
    """
    if not demonstrations:
        raise ValueError("run_warm_start needs at least one demonstration")
    start = time.perf_counter()
    previous_lr = learner.learning_rates()["actor_lr"]
    learner.set_lr(actor_lr=config.lr)
    rng = random.Random(seed)
    total = config.epochs * math.ceil(len(demonstrations) / config.batch_size)
    losses: list[float] = []
    skipped = 0
    try:
        for _ in range(config.epochs):
            order = list(range(len(demonstrations)))
            rng.shuffle(order)
            for i in range(0, len(order), config.batch_size):
                batch = [demonstrations[j] for j in order[i : i + config.batch_size]]
                metrics = learner.supervised_step(batch)
                losses.append(metrics.loss)
                skipped += int(metrics.skipped)
                if progress is not None:
                    progress(len(losses), total, metrics.loss, time.perf_counter() - start)
    finally:
        learner.set_lr(actor_lr=previous_lr)
    return WarmStartReport(
        losses=losses,
        num_steps=len(losses),
        num_skipped=skipped,
        num_demonstrations=len(demonstrations),
        wall_s=time.perf_counter() - start,
        policy_version=learner.policy_version,
    )


class SupervisedMixin:
    """The warm start's side of :class:`learner.trainer.Learner` (split out by
    responsibility, as :mod:`learner.weights` and :mod:`learner.checkpoint`): one SFT
    optimizer step, the warm start over demonstrations, and the reference reset after it.
    It uses the learner's engines, micro-batch plan, token statistics and non-finite
    guard."""

    def supervised_step(self, trajectories: Sequence[Trajectory]) -> SupervisedStepMetrics:
        """One optimizer step of token-mean cross-entropy on policy tokens (warm-start SFT).

        ``loss = -(1/N) sum_t m_t log pi(y_t)`` over the whole batch (N = policy tokens),
        accumulated over micro-batches of ``micro_batch_size``; same non-finite guard as
        :meth:`step`. The critic and reference are untouched. ``policy_version`` increments
        (the weights changed).

        Raises:
            ValueError: empty input or a trajectory that fails validation / has no policy
                token.
        """
        start = time.perf_counter()
        self._set_forward_options()
        batch = collate_trajectories(list(trajectories), self.pad_token_id)
        denominator = float(batch.num_policy_tokens)
        micro_losses: list[Tensor] = []  # read once, after every backward is queued
        for rows, real in self._micro_plan(batch, range(batch.batch_size)):
            micro = batch.select(rows).to(self.device)
            logprobs = self._token_stats(self.policy_engine, micro).logprobs
            loss = -(logprobs * micro.loss_mask).sum() / denominator
            weight = float(self.world_size) if real else 0.0
            self._backward(self.policy_engine, loss * weight if weight != 1.0 else loss, logprobs)
            if real:
                micro_losses.append(loss.detach())
        values = read_scalars(micro_losses)
        finite = all(math.isfinite(v) for v in values)
        (total,) = all_reduce_floats([sum(values, 0.0)], self.world_size, "sum")
        applied, grad_norm = self._optimizer_step(self.policy_engine, finite)
        if not applied:
            self.nonfinite_steps_total += 1
        self.policy_version += 1
        step_s = time.perf_counter() - start
        return SupervisedStepMetrics(
            loss=total,
            grad_norm=grad_norm,
            num_policy_tokens=batch.num_policy_tokens,
            skipped=not applied,
            policy_version=self.policy_version,
            step_s=step_s,
            tokens_per_s=batch.num_tokens / step_s,
        )

    def warm_start(
        self, demonstrations: Sequence[Trajectory], config: SFTConfig
    ) -> WarmStartReport:
        """Warm-start SFT on demonstrations (:func:`learner.sft.run_warm_start`, seeded with
        the learner's seed); returns its :class:`learner.sft.WarmStartReport`."""
        report = run_warm_start(
            self,
            demonstrations,
            config,
            seed=self.seed,
            progress=print_progress if self.rank == 0 else None,
        )
        if config.reference_from_warm_start:
            self.reset_reference_to_policy()
        return report

    def reset_reference_to_policy(self) -> None:
        """Copy the current policy weights into the frozen reference (``kl_ref`` is measured
        against these from now on); :meth:`save_checkpoint` then saves the reference too.
        """
        reference = self.reference_engine.module
        # a replicated reference loads the full state on every rank; a ZeRO-3 one on rank 0
        keep = self.rank == 0 or not self._zero3(reference)
        state = self._module_state(self.policy_engine.module, keep=keep)
        self._load_module_state(reference, state)
        self.reference_version = self.policy_version
