"""Hugging Face transformers generation engine (bf16 on CPU, or any torch device).

Batched ``model.generate`` with left padding. Behaviour log-probs are taken from the logits
of every decoding step divided by the sampling temperature, by a logits processor that runs
before the temperature / top-p warpers, so they follow the convention of
:mod:`actors.engines.protocol` (the temperature-T policy the tokens are sampled from, before
top-p truncation; natural log). Only one step's
``[B, V]`` log-softmax is held at a time (``output_logits=True`` would keep all ``N`` steps,
``B * N * V * 4`` bytes: 400 MB for 16 x 128 tokens with SmolLM2's 49,152-token vocabulary).

Stop strings are detected on decoded text (a custom stopping criterion), and every row is
trimmed after the first EOS or the first token that completes a stop string, the same
semantics as vLLM's ``stop`` (the completing token is kept, later tokens are dropped).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedTokenizerBase,
    StoppingCriteria,
    StoppingCriteriaList,
)

from actors.engines.protocol import (
    GenerationResult,
    SamplingParams,
    check_prompts,
    check_version,
    find_stop,
)


class _LogprobRecorder(LogitsProcessor):
    """Records ``log_softmax(raw_logits / temperature)`` of each sampled token, one step
    behind (temperature 1 for greedy decoding).

    At step t+1 the processor sees ``input_ids`` ending with the token sampled at step t and
    gathers its log-prob from the step-t log-softmax it kept; :meth:`finish` gathers the
    last step's token after ``generate`` returns.
    """

    def __init__(self, temperature: float = 1.0) -> None:
        if temperature <= 0.0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.temperature = temperature
        self._prev: torch.Tensor | None = None  # float32 [B, V], previous step's log-softmax
        self.steps: list[torch.Tensor] = []  # float32 [B] per generated position

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self._prev is not None:
            self.steps.append(self._prev.gather(1, input_ids[:, -1:]).squeeze(1))
        logits = scores.float()
        if self.temperature != 1.0:
            logits = logits / self.temperature
        self._prev = torch.log_softmax(logits, dim=-1)
        return scores

    def finish(self, sequences: torch.LongTensor) -> torch.Tensor:
        """float32 [B, N]: log-probs of the N generated tokens (N = len(self.steps) + 1)."""
        if self._prev is None:
            raise RuntimeError("generate produced no step: the logits processor was never called")
        self.steps.append(self._prev.gather(1, sequences[:, -1:]).squeeze(1))
        self._prev = None
        return torch.stack(self.steps, dim=1)


class _StopOnStrings(StoppingCriteria):
    """Marks a row done once its generated text contains a stop string.

    Decodes only the last ``window`` generated tokens of each row per step (a stop string of
    c characters spans at most c tokens), so the cost is O(B * window) per step.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stops: tuple[str, ...], prompt_len: int):
        self.tokenizer = tokenizer
        self.stops = stops
        self.prompt_len = prompt_len
        self.window = max(len(s) for s in stops) + 2

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        gen = input_ids[:, self.prompt_len :]
        tails = gen[:, -self.window :].tolist()
        texts = self.tokenizer.batch_decode(tails, skip_special_tokens=False)
        done = [find_stop(t, self.stops) is not None for t in texts]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


def trim_generation(
    token_ids: list[int],
    logprobs: list[float],
    tokenizer: PreTrainedTokenizerBase,
    eos_ids: set[int],
    stops: tuple[str, ...],
) -> tuple[int, str, str | None]:
    """Where one generated row ends: ``(length, finish_reason, stop_string)``.

    The row ends after the first EOS token (``eos``) or after the first token whose prefix
    text contains a stop string (``stop``), whichever comes first; otherwise it keeps every
    token (``length``). Binary search over prefixes: O(log N) decodes.
    """
    del logprobs  # same length as token_ids; trimmed by the caller
    eos_at = next((i for i, t in enumerate(token_ids) if t in eos_ids), None)
    end = len(token_ids) if eos_at is None else eos_at
    if stops:
        stop = find_stop(tokenizer.decode(token_ids[:end], skip_special_tokens=False), stops)
        if stop is not None:
            lo, hi = 1, end  # smallest k with a stop in decode(token_ids[:k])
            while lo < hi:
                mid = (lo + hi) // 2
                text = tokenizer.decode(token_ids[:mid], skip_special_tokens=False)
                if find_stop(text, stops) is not None:
                    hi = mid
                else:
                    lo = mid + 1
            stop = find_stop(tokenizer.decode(token_ids[:lo], skip_special_tokens=False), stops)
            return lo, "stop", stop
    if eos_at is not None:
        return eos_at + 1, "eos", None
    return len(token_ids), "length", None


class HFEngine:
    """:class:`~actors.engines.protocol.GenerationEngine` on transformers ``generate``.

    Args:
        model_path: HF model folder (safetensors + tokenizer), e.g.
            ``data/model/smollm2-135m-instruct``.
        dtype: Parameter dtype (bf16 by default; CPUs with AVX-512 bf16 run it natively).
        device: torch device string; ``cpu`` here, ``cuda`` on a GPU box.
        seed: Seeds torch's global RNG once (sampling uses it).

    Example:
        >>> engine = HFEngine("data/model/smollm2-135m-instruct")
        >>> out = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=8, temperature=0))
    """

    def __init__(
        self,
        model_path: str | Path,
        dtype: torch.dtype = torch.bfloat16,
        device: str = "cpu",
        seed: int = 0,
    ) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device)
        self.model.eval()
        self.device = torch.device(device)
        self.pad_id = self._pad_id()
        self.eos_ids = self._eos_ids()
        self._policy_version = 0
        torch.manual_seed(seed)

    def _pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        pad = self.tokenizer.eos_token_id if pad is None else pad
        if pad is None:
            raise ValueError(
                "tokenizer has neither a pad nor an EOS token; cannot left-pad a batch"
            )
        return int(pad)

    def _eos_ids(self) -> set[int]:
        ids = {self.tokenizer.eos_token_id}
        cfg_eos = self.model.generation_config.eos_token_id
        ids.update(cfg_eos if isinstance(cfg_eos, list) else [cfg_eos])
        return {int(i) for i in ids if i is not None}

    @property
    def policy_version(self) -> int:
        """Version of the loaded weights (0 = the checkpoint at ``model_path``)."""
        return self._policy_version

    def _left_pad(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p) :] = 1
        return ids.to(self.device), mask.to(self.device)

    def _generation_config(self, params: SamplingParams) -> GenerationConfig:
        # A fresh config: no repetition penalty, top-k or other processor from the model's
        # defaults runs before the log-prob recorder.
        common = dict(
            max_new_tokens=params.max_new_tokens,
            pad_token_id=self.pad_id,
            eos_token_id=sorted(self.eos_ids),
        )
        if params.greedy:
            return GenerationConfig(do_sample=False, **common)
        return GenerationConfig(
            do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=0, **common
        )

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[GenerationResult]:
        """Sample one continuation per prompt (see the protocol). Batched, left-padded.

        Raises:
            ValueError: empty batch or empty prompt.
        """
        check_prompts(prompts)
        if params.seed is not None:
            torch.manual_seed(params.seed)
        input_ids, attention_mask = self._left_pad(prompts)
        recorder = _LogprobRecorder(1.0 if params.greedy else params.temperature)
        criteria = StoppingCriteriaList()
        if params.stop:
            criteria.append(_StopOnStrings(self.tokenizer, params.stop, input_ids.shape[1]))
        sequences = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            generation_config=self._generation_config(params),
            logits_processor=LogitsProcessorList([recorder]),
            stopping_criteria=criteria,
        )
        generated = sequences[:, input_ids.shape[1] :].cpu()
        logprobs = recorder.finish(sequences).cpu()
        return [
            self._result(generated[i].tolist(), logprobs[i].tolist(), params)
            for i in range(len(prompts))
        ]

    def _result(
        self, token_ids: list[int], logprobs: list[float], params: SamplingParams
    ) -> GenerationResult:
        n, reason, stop = trim_generation(
            token_ids, logprobs, self.tokenizer, self.eos_ids, params.stop
        )
        return GenerationResult(
            token_ids=token_ids[:n],
            logprobs=logprobs[:n],
            finish_reason=reason,
            stop_string=stop,
            policy_version=self._policy_version,
        )

    @torch.no_grad()
    def load_weights(self, state_dict: dict[str, torch.Tensor], policy_version: int) -> None:
        """Copy ``state_dict`` into the model's parameters in place (no disk, no re-init).

        Every parameter of the model must be present (a silent partial update would mix
        versions); tied aliases such as ``lm_head.weight`` may be present or not.

        Raises:
            KeyError: an unknown name, or a parameter missing from ``state_dict``.
            ValueError: a shape mismatch, or a decreasing ``policy_version``.
        """
        check_version(self._policy_version, policy_version)
        targets = self.model.state_dict(keep_vars=True)
        check_state_dict(state_dict, targets, dict(self.model.named_parameters()).keys())
        for name, tensor in state_dict.items():
            targets[name].data.copy_(
                tensor.to(dtype=targets[name].dtype, device=targets[name].device)
            )
        self._policy_version = policy_version


def check_state_dict(
    state_dict: dict[str, torch.Tensor], targets: dict[str, torch.Tensor], required
) -> None:
    """Validate a weight update against the model's tensors (names and shapes).

    Args:
        state_dict: The update, name -> tensor.
        targets: The model's ``state_dict(keep_vars=True)`` (includes tied aliases).
        required: Names that must be present (the model's distinct parameters).

    Raises:
        KeyError: unknown or missing names (listed, at most 5 shown).
        ValueError: a shape mismatch (name and both shapes).
    """
    unknown = sorted(set(state_dict) - set(targets))
    if unknown:
        raise KeyError(
            f"load_weights: {len(unknown)} unknown parameter name(s), e.g. {unknown[:5]}"
        )
    missing = sorted(set(required) - set(state_dict))
    if missing:
        raise KeyError(f"load_weights: {len(missing)} parameter(s) missing, e.g. {missing[:5]}")
    for name, tensor in state_dict.items():
        if tuple(tensor.shape) != tuple(targets[name].shape):
            raise ValueError(
                f"load_weights: {name} has shape {tuple(tensor.shape)}, model has {tuple(targets[name].shape)}"
            )
