"""A scripted :class:`~actors.engines.protocol.GenerationEngine`: the cheap implementation
of the engine seam, for tests of the rollout loop and of the service layer (a test helper:
the product never imports it).

It plays a fixed policy: for the question of a prompt (the text after ``Question: `` in the
user turn) it writes ``scripts[question][k]`` in its k-th turn, k = environment blocks
(``<information>`` or the invalid-action reply) already in the response. It applies the
engine contract itself -- stop strings (the completing token kept), EOS, ``max_new_tokens``
-- and gives the i-th token of a turn the log-prob ``-(i + 1) / 100`` so tests can write
the expected behaviour log-probs down. No model, no torch.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from actors.engines.interrupt import Interrupt
from actors.engines.protocol import (
    GenerationResult,
    SamplingParams,
    check_prompts,
    check_version,
    find_stop,
)
from actors.prompts import INVALID_SEARCH_MESSAGE

_QUESTION = re.compile(r"Question: (.*?)<\|im_end\|>", re.DOTALL)


class ScriptedEngine:
    """Replays per-question turn scripts (see the module docstring).

    Args:
        tokenizer: The chat tokenizer (ChatML markers ``<|im_start|>assistant``, ``<|im_end|>``).
        scripts: question text -> the text of each policy turn.
        bump_after_calls: Raise ``policy_version`` by 1 after this many ``generate`` calls
            (simulates a weight update between turns).

    Attributes:
        calls: The prompts of every ``generate`` call, in order (what the engine saw).
        safe_point_hook: Called with the safe point's index (0, 1, ... per call) just
            before each safe point of an interruptible call (tests start a loader there).
    """

    def __init__(
        self, tokenizer, scripts: dict[str, list[str]], bump_after_calls: int | None = None
    ):
        self.tokenizer = tokenizer
        self.scripts = scripts
        self.calls: list[list[list[int]]] = []
        self.bump_after_calls = bump_after_calls
        self.safe_point_hook: Callable[[int], None] | None = None
        self._version = 0

    @property
    def policy_version(self) -> int:
        """Current version (changed by ``load_weights`` or ``bump_after_calls``)."""
        return self._version

    def load_weights(self, weights, policy_version: int) -> None:
        """Only records the version (there are no weights; a stream is consumed, as the
        weight-sync group needs)."""
        check_version(self._version, policy_version)
        if not isinstance(weights, dict):
            for _ in weights:
                pass
        self._version = policy_version

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        interrupt: Interrupt | None = None,
    ) -> list[GenerationResult]:
        """Play the scripted turn of each prompt.

        With ``interrupt``, the batch is played token-synchronously: after every
        ``interrupt.every_tokens`` tokens (while a row still has tokens to come)
        ``safe_point_hook(index)`` (if set) then ``interrupt.safe_point()`` run, and the
        tokens after it carry the version the engine holds then.

        Raises:
            KeyError: a question or turn with no script.
        """
        check_prompts(prompts)
        self.calls.append([list(p) for p in prompts])
        out = [self._one(p, params) for p in prompts]
        if interrupt is not None:
            self._interruptible_versions(out, interrupt)
        if self.bump_after_calls is not None and len(self.calls) == self.bump_after_calls:
            self._version += 1
        return out

    def _interruptible_versions(self, out: list[GenerationResult], interrupt: Interrupt) -> None:
        longest = max(len(r.token_ids) for r in out)
        versions, version, points = [], self._version, 0
        for k in range(longest):
            versions.append(version)
            if (k + 1) % interrupt.every_tokens == 0 and k + 1 < longest:
                if self.safe_point_hook is not None:
                    self.safe_point_hook(points)
                points += 1
                interrupt.safe_point()
                version = self._version
        for r in out:
            r.policy_version = versions[0]
            r.token_versions = versions[: len(r.token_ids)]

    def _turn_text(self, prompt: list[int]) -> str:
        text = self.tokenizer.decode(prompt)
        found = _QUESTION.search(text)
        if found is None:
            raise KeyError("prompt has no 'Question: ...' user turn")
        response = text.split("<|im_start|>assistant\n", 1)[
            1
        ]  # the system prompt names the tags too
        turn = response.count("<information>") + response.count(INVALID_SEARCH_MESSAGE.strip())
        turns = self.scripts[found.group(1)]
        if turn >= len(turns):
            raise KeyError(f"no script for turn {turn} of question {found.group(1)!r}")
        return turns[turn]

    def _one(self, prompt: list[int], params: SamplingParams) -> GenerationResult:
        ids = self.tokenizer(self._turn_text(prompt), add_special_tokens=False)["input_ids"]
        reason, stop, n = "length", None, min(len(ids), params.max_new_tokens)
        for k in range(1, n + 1):
            s = find_stop(self.tokenizer.decode(ids[:k]), params.stop)
            if s is not None:
                reason, stop, n = "stop", s, k
                break
            if ids[k - 1] == self.tokenizer.eos_token_id:
                reason, n = "eos", k
                break
        logprobs = [-(k + 1) / 100 for k in range(n)]
        return GenerationResult(ids[:n], logprobs, reason, stop, self._version)
