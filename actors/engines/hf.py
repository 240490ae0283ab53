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

Interruptible generation (``generate(..., interrupt=Interrupt(N, safe_point))``,
:mod:`actors.engines.interrupt`): the engine runs its own decode loop (prefill, then one
forward per token with a KV cache; the same temperature / top-p warpers and the same
log-prob convention as ``generate``) and calls ``safe_point`` after every N tokens. If the
weights changed there, the KV cache is **recomputed**: one prefill of every row's
``prompt + tokens so far`` under the new weights (cost: one forward over ``B * (P + t)``
tokens per update that lands, against ``t`` sequential decode forwards already spent; it
parallelises like any prefill). Keeping the old cache instead would sample the later
tokens from a mixture (new weights attending to keys/values of the old ones), a policy
the learner cannot recompute; with the recompute, each token after the update is sampled
from, and its log-prob is, exactly the new version's ``pi(y_t | prefix)``. Each token
records the version that sampled it (``GenerationResult.token_versions``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DynamicCache,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedTokenizerBase,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

from actors.engines.interrupt import Interrupt
from actors.engines.protocol import (
    GenerationResult,
    SamplingParams,
    Weights,
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
    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        interrupt: Interrupt | None = None,
    ) -> list[GenerationResult]:
        """Sample one continuation per prompt (see the protocol). Batched, left-padded.

        Args:
            prompts, params: see the protocol.
            interrupt: None: transformers ``generate``, weights fixed for the call. Else
                the interruptible loop (module docstring): ``interrupt.safe_point()``
                after every ``interrupt.every_tokens`` tokens; a weight update applied
                there changes the version (and the KV cache) of the tokens after it.

        Raises:
            ValueError: empty batch or empty prompt.
        """
        check_prompts(prompts)
        if params.seed is not None:
            torch.manual_seed(params.seed)
        if interrupt is not None:
            return self._generate_interruptible(prompts, params, interrupt)
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
        self,
        token_ids: list[int],
        logprobs: list[float],
        params: SamplingParams,
        versions: list[int] | None = None,
    ) -> GenerationResult:
        n, reason, stop = trim_generation(
            token_ids, logprobs, self.tokenizer, self.eos_ids, params.stop
        )
        return GenerationResult(
            token_ids=token_ids[:n],
            logprobs=logprobs[:n],
            finish_reason=reason,
            stop_string=stop,
            policy_version=self._policy_version if versions is None else versions[0],
            token_versions=None if versions is None else versions[:n],
        )

    def _forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache: DynamicCache
    ) -> torch.Tensor:
        """float [B, V]: next-token logits after ``input_ids`` ([B, L], the new tokens),
        appending their keys/values to ``cache``. ``attention_mask`` [B, past + L] covers
        the cache and the new tokens (0 on left padding); positions count real tokens only,
        as ``generate`` does for left-padded batches."""
        past = cache.get_seq_length()
        new = input_ids.shape[1]
        positions = (attention_mask.cumsum(dim=1) - 1).clamp_min(0)[:, past : past + new]
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions,
            past_key_values=cache,
            cache_position=torch.arange(past, past + new, device=self.device),
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1, :]

    def _generate_interruptible(
        self, prompts: list[list[int]], params: SamplingParams, interrupt: Interrupt
    ) -> list[GenerationResult]:
        """The decode loop with safe points (module docstring). Sampling follows
        transformers' ``generate``: temperature, then top-p, then ``multinomial``; argmax
        when greedy. Rows that finished keep being fed padding (as ``generate`` does) and
        are trimmed afterwards by :func:`trim_generation`."""
        ids, mask = self._left_pad(prompts)
        batch = ids.shape[0]
        temperature = 1.0 if params.greedy else params.temperature
        warpers = LogitsProcessorList()
        if not params.greedy:
            warpers.append(TemperatureLogitsWarper(params.temperature))
            if params.top_p < 1.0:
                warpers.append(TopPLogitsWarper(params.top_p))
        stopper = _StopOnStrings(self.tokenizer, params.stop, ids.shape[1]) if params.stop else None
        eos = torch.tensor(sorted(self.eos_ids), device=self.device)
        done = torch.zeros(batch, dtype=torch.bool, device=self.device)
        tokens: list[torch.Tensor] = []  # long [B] per step
        logprobs: list[torch.Tensor] = []  # float32 [B] per step
        versions: list[int] = []  # per step
        version = self._policy_version
        cache = DynamicCache()
        logits = self._forward(ids, mask, cache)
        for step in range(params.max_new_tokens):
            scores = logits.float()
            logp = torch.log_softmax(scores / temperature if temperature != 1.0 else scores, -1)
            if params.greedy:
                token = scores.argmax(dim=-1)
            else:
                probs = torch.softmax(warpers(ids, scores), dim=-1)
                token = torch.multinomial(probs, num_samples=1).squeeze(1)
            token = torch.where(done, torch.full_like(token, self.pad_id), token)
            tokens.append(token)
            logprobs.append(logp.gather(1, token[:, None]).squeeze(1))
            versions.append(version)
            ids = torch.cat([ids, token[:, None]], dim=1)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            done |= torch.isin(token, eos)
            if stopper is not None:
                done |= stopper(ids, None).to(self.device)
            if bool(done.all()) or step + 1 == params.max_new_tokens:
                break
            if (step + 1) % interrupt.every_tokens == 0:
                interrupt.safe_point()
                if self._policy_version != version:  # new weights: recompute the KV cache
                    version = self._policy_version
                    cache = DynamicCache()
                    logits = self._forward(ids, mask, cache)
                    continue
            logits = self._forward(token[:, None], mask, cache)
        generated = torch.stack(tokens, dim=1).cpu()
        recorded = torch.stack(logprobs, dim=1).cpu()
        return [
            self._result(generated[i].tolist(), recorded[i].tolist(), params, versions)
            for i in range(batch)
        ]

    @torch.no_grad()
    def load_weights(self, weights: Weights, policy_version: int) -> None:
        """Copy ``weights`` into the model's parameters in place (no disk, no re-init).

        ``weights`` is a dict (checked whole before anything is copied) or a stream of
        ``(name, tensor)`` pairs (each copied as it arrives, so the stream is never held
        whole; names and shapes are checked pair by pair, coverage at its end). Every
        parameter of the model must be present (a silent partial update would mix
        versions); tied aliases such as ``lm_head.weight`` may be present or not.

        Raises:
            KeyError: an unknown name, or a parameter missing from ``weights`` (a stream's
                missing names are found after the others were copied: the engine then
                holds a mixed version and must not generate before a complete load).
            ValueError: a shape mismatch, or a decreasing ``policy_version``.
        """
        check_version(self._policy_version, policy_version)
        targets = self.model.state_dict(keep_vars=True)
        required = dict(self.model.named_parameters()).keys()
        if isinstance(weights, Mapping):
            check_state_dict(weights, targets, required)
            weights = weights.items()
        loaded: set[str] = set()
        for name, tensor in weights:
            check_state_dict({name: tensor}, targets, ())
            targets[name].data.copy_(
                tensor.to(dtype=targets[name].dtype, device=targets[name].device)
            )
            loaded.add(name)
        missing = sorted(set(required) - loaded)
        if missing:
            raise KeyError(f"load_weights: {len(missing)} parameter(s) missing, e.g. {missing[:5]}")
        self._policy_version = policy_version


def check_state_dict(
    state_dict: Mapping[str, torch.Tensor], targets: Mapping[str, torch.Tensor], required
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
